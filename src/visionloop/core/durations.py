"""Durations as people write them: `90s`, `15m`, `6h`, `2d`, or a plain number of seconds.

One grammar for every place a user gives a span of time (a job's `max_runtime`, the monitor's
windows), so that what works in one works in all.
"""

from __future__ import annotations

import math
import re

UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", re.IGNORECASE)


def parse_duration(value: str | float) -> float:
    """`value` in seconds: a string such as '90s', '15m', '6h', '2d' (a bare number is
    seconds), or a number of seconds. ValueError, with examples, for anything else (a
    negative, infinite or NaN number included); callers check their own bounds."""
    if isinstance(value, bool):  # a bool is an int to Python, never a duration to a user
        raise ValueError(f"{value!r} is not a duration; write e.g. 6h, 90m, 2d or 3600 (seconds)")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        m = _DURATION.fullmatch(value) if isinstance(value, str) else None
        if m is None:
            raise ValueError(f"{value!r} is not a duration; write e.g. 6h, 90m, 2d or 3600 (seconds)")
        seconds = float(m.group(1)) * UNITS[(m.group(2) or "s").lower()]
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{value!r} is not a duration; write e.g. 6h, 90m, 2d or 3600 (seconds)")
    return seconds


def format_duration(seconds: float) -> str:
    """Seconds as the largest units that say it: 21600 → '6h', 5400 → '1h 30m', 90 → '1m 30s'."""
    s = round(seconds)
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if s >= size or (unit == "s" and not parts):
            parts.append(f"{s // size}{unit}")
            s %= size
    return " ".join(parts)
