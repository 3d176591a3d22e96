"""Workload and spot traces for the simulator.

Job traces are CSV files `job_id,submit_time,gpus,duration_s,team,priority,spot` (the format
of the benchmark traces built from the Pollux/Philly workloads). Spot traces are the
skypilot-org/spot-traces JSON format: `{"metadata": {"gap_seconds": N}, "data": [1, 0, ...]}`,
one value per N seconds, 1 while the spot instance was up.
"""

from __future__ import annotations

import bisect
import csv
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from visionloop.core.errors import DataError
from visionloop.sched.view import SpotPolicy

TRACE_COLUMNS = ("job_id", "submit_time", "gpus", "duration_s", "team", "priority", "spot")


@dataclass(frozen=True, slots=True)
class TraceJob:
    id: str
    submit_time: float
    gpus: int
    duration_s: float  # run time on its GPUs without interruptions
    team: str
    priority: str  # class name, e.g. "normal"
    spot: SpotPolicy = "allowed"


def load_trace(path: Path) -> list[TraceJob]:
    """Jobs of a CSV trace, in submission order."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read job trace {path}: {e}; pass --data DIR with the traces.") from None
    reader = csv.DictReader(io.StringIO(text, newline=""))
    missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or [])]
    if missing:
        raise DataError(
            f"job trace {path} lacks column(s) {', '.join(missing)}; "
            f"the header must be {','.join(TRACE_COLUMNS)}"
        )
    jobs = []
    for line, row in enumerate(reader, start=2):
        try:
            spot = row["spot"] or "allowed"
            if spot not in ("never", "allowed", "preferred"):
                raise ValueError(f"spot must be never, allowed or preferred, not {spot!r}")
            job = TraceJob(
                id=row["job_id"],
                submit_time=float(row["submit_time"]),
                gpus=int(row["gpus"]),
                duration_s=float(row["duration_s"]),
                team=row["team"],
                priority=row["priority"],
                spot=cast(SpotPolicy, spot),
            )
            if job.gpus < 1 or job.duration_s <= 0 or job.submit_time < 0:
                raise ValueError("gpus must be >= 1, duration_s > 0 and submit_time >= 0")
        except (TypeError, ValueError) as e:
            raise DataError(
                f"job trace {path}, line {line}: {e}; e.g. 'job-1,0,4,3600,detection,normal,allowed'"
            ) from None
        jobs.append(job)
    jobs.sort(key=lambda j: (j.submit_time, j.id))
    return jobs


@dataclass(frozen=True)
class SpotTrace:
    """Up/down of one spot node over time, as runs of equal state: `starts[i]` is when run i
    begins (seconds from the trace's start) and `ups[i]` whether the node is up. Time 0 of
    the simulation is `offset_s` into the trace; past its end the trace repeats."""

    name: str
    starts: tuple[float, ...]
    ups: tuple[bool, ...]
    length_s: float
    offset_s: float = 0.0

    def up_at(self, t: float) -> bool:
        x = (t + self.offset_s) % self.length_s
        return self.ups[bisect.bisect_right(self.starts, x) - 1]

    def next_change(self, t: float) -> float:
        """The first time after `t` at which the state changes (inf if it never does)."""
        if len(self.starts) == 1:
            return float("inf")
        x = (t + self.offset_s) % self.length_s
        i = bisect.bisect_right(self.starts, x)
        state = self.ups[i - 1]
        base = t - x
        while True:
            if i == len(self.starts):  # wrap around
                base += self.length_s
                i = 0
            if self.ups[i] != state:
                return base + self.starts[i]
            state = self.ups[i]
            i += 1

    def uptime(self, t0: float, t1: float) -> float:
        """Seconds up within [t0, t1)."""
        total, t = 0.0, t0
        while t < t1:
            nxt = min(self.next_change(t), t1)
            if self.up_at(t):
                total += nxt - t
            t = nxt
        return total


def spot_trace(name: str, values: Sequence[int], gap_s: float, offset_s: float = 0.0) -> SpotTrace:
    if not values or gap_s <= 0:
        raise DataError(f"spot trace {name} is empty or has gap_seconds <= 0")
    starts, ups = [0.0], [bool(values[0])]
    for i, v in enumerate(values):
        if bool(v) != ups[-1]:
            starts.append(i * gap_s)
            ups.append(bool(v))
    return SpotTrace(name, tuple(starts), tuple(ups), len(values) * gap_s, offset_s)


def load_spot_trace(path: Path, offset_s: float = 0.0) -> SpotTrace:
    """A skypilot spot trace; any value > 0 counts as up."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
        gap = float(doc["metadata"]["gap_seconds"])
        values = [1 if int(v) > 0 else 0 for v in doc["data"]]
    except OSError as e:
        raise DataError(f"cannot read spot trace {path}: {e}; pass --data DIR with the traces.") from None
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(
            f"spot trace {path} is not {{'metadata': {{'gap_seconds': N}}, 'data': [1, 0, ...]}}: {e}"
        ) from None
    return spot_trace(path.stem, values, gap, offset_s)
