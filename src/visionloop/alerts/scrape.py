"""The inference servers' request counters, read from their /metrics (Prometheus text format,
parsed by prometheus_client's own parser), and what happened between two readings: the
requests, the server errors and the 99th-percentile latency per model.

Counters only grow while a server runs, so the difference between two readings is the traffic
in between. A reading lower than the previous one means the server restarted; then the new
reading itself is the traffic since the restart (as Prometheus' `increase()` does).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

# The server's metric names (serve/metrics.py); a unit test checks them against what a real
# ServeMetrics renders, so a rename there fails a test here instead of silencing the alerts.
REQUESTS = "visionloop_serve_requests"
ERRORS = "visionloop_serve_errors"
LATENCY = "visionloop_serve_request_seconds"


@dataclass(frozen=True)
class ModelCounters:
    """One model's counters in one reading, summed over versions and endpoints."""

    requests: float = 0.0  # answered successfully
    errors: float = 0.0  # answered with an error, any status
    server_errors: float = 0.0  # of which 5xx
    # Cumulative latency histogram: upper bound (s) -> requests at or under it; +inf last.
    buckets: Mapping[float, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "server_errors": self.server_errors,
            # JSON has no infinity: bounds as strings ("+Inf" as Prometheus writes it).
            "buckets": {_le_text(le): n for le, n in self.buckets.items()},
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> ModelCounters:
        return cls(
            requests=float(doc["requests"]),
            errors=float(doc["errors"]),
            server_errors=float(doc["server_errors"]),
            buckets={float(le): float(n) for le, n in doc["buckets"].items()},
        )


@dataclass(frozen=True)
class Reading:
    url: str
    at: float
    models: Mapping[str, ModelCounters]

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "at": self.at, "models": {m: c.to_json() for m, c in self.models.items()}}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Reading:
        return cls(
            url=str(doc["url"]),
            at=float(doc["at"]),
            models={str(m): ModelCounters.from_json(c) for m, c in doc["models"].items()},
        )


@dataclass(frozen=True)
class Traffic:
    """One model's traffic between two readings."""

    model: str
    seconds: float
    requests: float  # all answered: successes and errors
    server_errors: float
    p99_s: float | None  # None without requests that have a latency

    @property
    def error_ratio(self) -> float:
        return self.server_errors / self.requests if self.requests else 0.0


class ScrapeError(Exception):
    """The server did not answer its /metrics with the text format."""


def scrape(url: str, *, at: float, timeout_s: float, api_key: str | None = None) -> Reading:
    """GET `<url>/metrics` and sum its counters per model."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url.rstrip('/')}/metrics", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise ScrapeError(f"{url}/metrics did not answer ({type(e).__name__}: {e})") from e
    if r.status_code != 200:
        hint = (
            "; give a key for all models in the environment variable it names "
            "(`visionloop serve keys create alerts --models '*'`)"
            if r.status_code in (401, 403)
            else ""
        )
        raise ScrapeError(f"{url}/metrics answered HTTP {r.status_code}{hint}")
    try:
        return parse(url, r.text, at)
    except ValueError as e:
        raise ScrapeError(f"{url}/metrics is not Prometheus text format ({e})") from e


def parse(url: str, text: str, at: float) -> Reading:
    from prometheus_client.parser import text_string_to_metric_families

    acc: dict[str, dict[str, Any]] = {}

    def model(name: str) -> dict[str, Any]:
        return acc.setdefault(name, {"requests": 0.0, "errors": 0.0, "server_errors": 0.0, "buckets": {}})

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name, labels, value = s.name, s.labels, float(s.value)
            if name == f"{REQUESTS}_total":
                model(labels["model"])["requests"] += value
            elif name == f"{ERRORS}_total":
                m = model(labels["model"])
                m["errors"] += value
                if labels.get("code", "").startswith("5"):
                    m["server_errors"] += value
            elif name == f"{LATENCY}_bucket":
                buckets = model(labels["model"])["buckets"]
                le = float(labels["le"])
                buckets[le] = buckets.get(le, 0.0) + value
    return Reading(
        url=url,
        at=at,
        models={
            name: ModelCounters(
                m["requests"], m["errors"], m["server_errors"], dict(sorted(m["buckets"].items()))
            )
            for name, m in acc.items()
        },
    )


def traffic(previous: Reading, current: Reading) -> list[Traffic]:
    """Each model's traffic between two readings of the same server."""
    out: list[Traffic] = []
    for name, now in sorted(current.models.items()):
        before = previous.models.get(name, ModelCounters())
        restarted = now.requests < before.requests or now.errors < before.errors
        if restarted:
            before = ModelCounters()
        requests = (now.requests - before.requests) + (now.errors - before.errors)
        buckets = {le: n - before.buckets.get(le, 0.0) for le, n in now.buckets.items()}
        out.append(
            Traffic(
                model=name,
                seconds=current.at - previous.at,
                requests=requests,
                server_errors=now.server_errors - before.server_errors,
                p99_s=quantile(0.99, buckets),
            )
        )
    return out


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile of a cumulative histogram, interpolated linearly inside its bucket, as
    Prometheus' `histogram_quantile` does (so `alerts check` and a Prometheus rule agree). In
    the +Inf bucket, the largest finite bound is the answer: all that is known is "above it"."""
    bounds = sorted(buckets)
    if not bounds or not math.isinf(bounds[-1]):
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def _le_text(le: float) -> str:
    return "+Inf" if math.isinf(le) else repr(le)
