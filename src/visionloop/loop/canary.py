"""The canary of a loop's rollout, as the server counts it: the candidate answers a share of the
served traffic (and, with a shadow share, a mirrored copy that is compared with the
champion's answer), and is judged on the difference between two readings of the server's
/metrics, per version:

    failures   the requests a version did not answer (queue full, timeout, non-finite output),
               as a rate over its requests, against the champion's rate over the same window
    latency    the 95th percentile of request time (canary answers only: a mirrored request's
               time is not a client's), against the champion's
    agreement  top-1 agreement of the candidate's mirrored answers with the champion's

A verdict needs `min_requests` candidate answers; before that it is "not yet". The readings are
plain data (`to_json`), so a loop that dies mid-watch resumes with the same window.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from visionloop.alerts.scrape import quantile
from visionloop.core.errors import VisionloopError
from visionloop.loop.spec import RolloutSpec

# The server's metric names (serve/metrics.py); tests read them from a real server.
REQUESTS = "visionloop_serve_requests_total"
REJECTED = "visionloop_serve_rejected_total"
LATENCY = "visionloop_serve_request_seconds_bucket"
SHADOW = "visionloop_serve_shadow_comparisons_total"
# A server's /metrics for a few models is tens of KiB; past this it is not one.
MAX_METRICS_BYTES = 16 * 2**20
MAX_ROUTING_BYTES = 64 * 1024
LATENCY_QUANTILE = 0.95


class ServerError(VisionloopError):
    """The serving endpoint did not answer as a visionloop server does."""


@dataclass(frozen=True)
class Counts:
    """One version's counters in one reading."""

    answered: float = 0.0  # requests it answered (its own, not mirrored)
    failed: float = 0.0  # requests it did not answer (a mirrored one included)
    buckets: Mapping[float, float] = field(default_factory=dict)  # latency, cumulative; +inf last

    def minus(self, other: Counts) -> Counts:
        return Counts(
            self.answered - other.answered,
            self.failed - other.failed,
            {le: n - other.buckets.get(le, 0.0) for le, n in self.buckets.items()},
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "answered": self.answered,
            "failed": self.failed,
            "buckets": {("+Inf" if math.isinf(le) else repr(le)): n for le, n in self.buckets.items()},
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Counts:
        return cls(
            float(doc["answered"]),
            float(doc["failed"]),
            {float(le): float(n) for le, n in doc["buckets"].items()},
        )


@dataclass(frozen=True)
class Reading:
    """One model's counters on one server: per version, and the shadow comparisons per
    (champion, challenger) pair as (agreed, disagreed)."""

    versions: Mapping[str, Counts]
    shadow: Mapping[str, tuple[float, float]]  # "CHAMPION>CHALLENGER" -> (agreed, disagreed)

    def get(self, version: int) -> Counts:
        return self.versions.get(str(version), Counts())

    def comparisons(self, champion: int, challenger: int) -> tuple[float, float]:
        return self.shadow.get(f"{champion}>{challenger}", (0.0, 0.0))

    def before(self, other: Reading) -> bool:
        """Whether `other` can have come after this reading on the same running server (its
        counters never lower); a lower one means the server restarted in between."""
        for v, c in self.versions.items():
            o = other.versions.get(v, Counts())
            if o.answered < c.answered or o.failed < c.failed:
                return False
        return all(
            other.shadow.get(k, (0.0, 0.0))[0] >= a and other.shadow.get(k, (0.0, 0.0))[1] >= d
            for k, (a, d) in self.shadow.items()
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "versions": {v: c.to_json() for v, c in self.versions.items()},
            "shadow": {k: list(v) for k, v in self.shadow.items()},
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Reading:
        return cls(
            {str(v): Counts.from_json(c) for v, c in doc["versions"].items()},
            {str(k): (float(v[0]), float(v[1])) for k, v in doc["shadow"].items()},
        )


def parse(text: str, model: str) -> Reading:
    """`model`'s series of a server's /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    acc: dict[str, dict[str, Any]] = {}
    shadow: dict[str, list[float]] = {}

    def of(version: str) -> dict[str, Any]:
        return acc.setdefault(version, {"answered": 0.0, "failed": 0.0, "buckets": {}})

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels, value = s.labels, float(s.value)
            if labels.get("model") != model:
                continue
            if s.name == REQUESTS:
                of(labels["version"])["answered"] += value
            elif s.name == REJECTED:
                of(labels["version"])["failed"] += value
            elif s.name == LATENCY:
                buckets = of(labels["version"])["buckets"]
                le = float(labels["le"])
                buckets[le] = buckets.get(le, 0.0) + value
            elif s.name == SHADOW:
                pair = shadow.setdefault(
                    f"{labels['champion_version']}>{labels['challenger_version']}", [0, 0]
                )
                pair[0 if labels.get("agree") == "true" else 1] += value
    return Reading(
        {v: Counts(c["answered"], c["failed"], dict(sorted(c["buckets"].items()))) for v, c in acc.items()},
        {k: (a, d) for k, (a, d) in shadow.items()},
    )


# --------------------------------------------------------------------------- the server


class Server:
    """The served model's routing and metrics on one `visionloop serve`."""

    def __init__(self, spec: RolloutSpec, model: str, timeout_s: float = 30.0) -> None:
        self.url, self.model = spec.server, spec.served_as or model
        key = os.environ.get(spec.key_env, "").strip() if spec.key_env else ""
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.key_env, self.timeout_s = spec.key_env, timeout_s

    def _call(self, method: str, path: str, limit: int, **kw: Any) -> bytes:
        where = f"{method} {self.url}{path}"
        try:
            with (
                httpx.Client(timeout=self.timeout_s, headers=self.headers) as c,
                c.stream(method, f"{self.url}{path}", **kw) as r,
            ):
                body = bytearray()
                for chunk in r.iter_bytes():
                    body += chunk
                    if len(body) > limit:
                        raise ServerError(
                            f"{where} answered more than {limit // 1024} KiB: not a visionloop server"
                        )
        except httpx.HTTPError as e:
            raise ServerError(f"{where} did not answer ({type(e).__name__}: {e})") from e
        if r.status_code in (401, 403):
            raise ServerError(
                f"{where} answered HTTP {r.status_code}: the loop needs a key for all models that may "
                f"change routing (`visionloop serve keys create loop --models '*' --routing`), in "
                f"${self.key_env or 'VISIONLOOP_SERVE_KEY'} (the rollout's key_env)"
            )
        if r.status_code != 200:
            raise ServerError(
                f"{where} answered HTTP {r.status_code}: {bytes(body[:300]).decode(errors='replace')}"
            )
        return bytes(body)

    def read(self) -> Reading:
        text = self._call("GET", "/metrics", MAX_METRICS_BYTES).decode("utf-8", errors="replace")
        try:
            return parse(text, self.model)
        except (ValueError, KeyError) as e:
            raise ServerError(f"{self.url}/metrics is not a visionloop server's metrics ({e})") from e

    def routing(self) -> dict[str, Any]:
        return self._json("GET", f"/v2/models/{self.model}/routing")

    def set_routing(self, canary: float, shadow: float) -> dict[str, Any]:
        body = {"canary_percent": canary, "shadow_percent": shadow}
        return self._json("PUT", f"/v2/models/{self.model}/routing", json=body)

    def _json(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        import orjson

        raw = self._call(method, path, MAX_ROUTING_BYTES, **kw)
        try:
            doc = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise ServerError(f"{self.url}{path} did not answer JSON ({e})") from e
        if not isinstance(doc, dict):
            raise ServerError(f"{self.url}{path} did not answer a routing object")
        return doc


# --------------------------------------------------------------------------- the verdict


@dataclass(frozen=True)
class Verdict:
    """`passed`: True (every criterion held), False (one failed: `reasons` say which) or None
    (too few candidate answers yet). `figures`: what was measured, for the round's record."""

    passed: bool | None
    reasons: tuple[str, ...]
    figures: dict[str, Any]

    def summary(self) -> str:
        return "; ".join(self.reasons)


def _rate(c: Counts, extra_answered: float = 0.0) -> float:
    total = c.answered + extra_answered + c.failed
    return c.failed / total if total else 0.0


def judge(window: Reading, champion: int, candidate: int, spec: RolloutSpec) -> Verdict:
    """The candidate against the champion over one window (the difference of two readings)."""
    champ, cand = window.get(champion), window.get(candidate)
    agreed, disagreed = window.comparisons(champion, candidate)
    mirrored = agreed + disagreed
    answers = cand.answered + mirrored
    figures: dict[str, Any] = {
        "candidate_answered": int(cand.answered),
        "candidate_mirrored": int(mirrored),
        "candidate_failed": int(cand.failed),
        "champion_answered": int(champ.answered),
        "champion_failed": int(champ.failed),
    }
    if answers < spec.min_requests:
        return Verdict(
            None, (f"{int(answers)} of the {spec.min_requests} candidate answers needed so far",), figures
        )
    failures: list[str] = []
    held: list[str] = []
    cand_rate, champ_rate = _rate(cand, mirrored), _rate(champ)
    figures.update(candidate_failure_rate=cand_rate, champion_failure_rate=champ_rate)
    rise = cand_rate - champ_rate
    line = f"failures {cand_rate:.2%} (champion {champ_rate:.2%}, may rise {spec.max_error_rate_rise:.2%})"
    (failures if rise > spec.max_error_rate_rise else held).append(line)
    if spec.max_latency_ratio is not None:
        p_cand = quantile(LATENCY_QUANTILE, cand.buckets) if cand.answered else None
        p_champ = quantile(LATENCY_QUANTILE, champ.buckets) if champ.answered else None
        figures.update(candidate_p95_s=p_cand, champion_p95_s=p_champ)
        if p_cand is None or p_champ is None or p_champ <= 0:
            held.append("p95 latency not compared (no canary answers of one of them)")
        else:
            ratio = p_cand / p_champ
            figures["latency_ratio"] = ratio
            line = (
                f"p95 latency {p_cand * 1000:.1f} ms = {ratio:.2f}x the champion's "
                f"{p_champ * 1000:.1f} ms (at most {spec.max_latency_ratio:g}x)"
            )
            (failures if ratio > spec.max_latency_ratio else held).append(line)
    if spec.min_agreement is not None:
        if mirrored == 0:
            failures.append("no mirrored answer was compared with the champion's (agreement unknown)")
        else:
            agreement = agreed / mirrored
            figures["agreement"] = agreement
            line = (
                f"agreement {agreement:.1%} over {int(mirrored)} mirrored requests "
                f"(at least {spec.min_agreement:.0%})"
            )
            (failures if agreement < spec.min_agreement else held).append(line)
    if failures:
        return Verdict(False, tuple(failures), figures)
    return Verdict(True, tuple(held), figures)


def difference(before: Reading, after: Reading) -> Reading:
    """The traffic between two readings of the same running server."""
    zero = (0.0, 0.0)
    return Reading(
        {v: c.minus(before.versions.get(v, Counts())) for v, c in after.versions.items()},
        {
            k: (a - before.shadow.get(k, zero)[0], d - before.shadow.get(k, zero)[1])
            for k, (a, d) in after.shadow.items()
        },
    )
