"""Latency percentiles and throughput from a list of per-call timings.

Percentiles interpolate linearly between the two nearest ranks (numpy's default, "type 7"),
so p99 of 50 calls is not simply the slowest call, and the numbers agree with what a user gets
from `numpy.percentile` on the same timings in the JSON file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field


class LatencyStats(BaseModel):
    """One batch size of one configuration, in milliseconds per call (one call = one batch)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: int = Field(ge=1)
    iterations: int = Field(ge=1, description="timed calls, after warm-up")
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    throughput_ips: float = Field(description="images per second: batch_size * calls / total time")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) of `values`, linear between closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def throughput(batch_size: int, timings_s: Sequence[float]) -> float:
    """Images per second over the timed calls: every image counted, every second counted."""
    total = math.fsum(timings_s)
    if total <= 0.0:
        raise ValueError("throughput needs a positive total time")
    return batch_size * len(timings_s) / total


def summarize(batch_size: int, timings_s: Sequence[float]) -> LatencyStats:
    """Per-call timings in seconds → milliseconds percentiles and images/s."""
    if not timings_s:
        raise ValueError("summarize needs at least one timing")
    ms = [t * 1000.0 for t in timings_s]
    return LatencyStats(
        batch_size=batch_size,
        iterations=len(ms),
        mean_ms=math.fsum(ms) / len(ms),
        p50_ms=percentile(ms, 50),
        p90_ms=percentile(ms, 90),
        p99_ms=percentile(ms, 99),
        max_ms=max(ms),
        throughput_ips=throughput(batch_size, timings_s),
    )
