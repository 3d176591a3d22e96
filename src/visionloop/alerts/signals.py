"""Reading what the rules judge from visionloop's own stores, typed: the monitor's window logs,
the job store (queue, finished jobs, running jobs, the cost ledger), the run directories
(checkpoints set aside as corrupt) and the tracking store (GPU utilisation).

Nothing here decides whether something is wrong; evaluate.py does. Each reader is one small
function over one store, so a rule can be tested on the real store it reads.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import statistics
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from visionloop.core.errors import VisionloopError
from visionloop.monitor.history import WindowRecord, read_windows, windows_path
from visionloop.sched.cost import summarise
from visionloop.sched.prices import PriceCatalog
from visionloop.sched.records import Job
from visionloop.sched.states import JobState
from visionloop.train.rundir import RunDir

if TYPE_CHECKING:
    from visionloop.core.settings import Settings
    from visionloop.sched.store import Store

log = logging.getLogger(__name__)

DAY_S = 86400.0
CORRUPT_SUFFIX = ".corrupt"  # what the checkpoint managers rename an unusable checkpoint to
_GPU_UTIL = re.compile(r"system/gpu(\d+)/utilization_percent")  # track/system.py's keys


# ----------------------------------------------------------------------------- models


def monitored_models(home: Path) -> list[str]:
    """Models with a monitor window log under the home, by name."""
    root = windows_path(home, "x").parent.parent
    if not root.is_dir():
        return []
    names: list[str] = []
    for d in sorted(root.iterdir()):
        try:
            if windows_path(home, d.name).is_file():
                names.append(d.name)
        except VisionloopError:  # a folder whose name is no model name: not the monitor's
            continue
    return names


def recent_windows(home: Path, model: str, n: int) -> list[WindowRecord]:
    """The last `n` windows of `model` that were judged (status "ok"), oldest first. Windows
    with too few samples carry no verdict: they neither break nor extend a run of drift."""
    last: deque[WindowRecord] = deque(maxlen=n)
    for record in read_windows(home, model):
        if record.status == "ok":
            last.append(record)
    return list(last)


# ----------------------------------------------------------------------------- jobs


def queued_jobs(store: Store) -> list[Job]:
    return store.list_jobs(states=[JobState.QUEUED])


def running_jobs(store: Store) -> list[Job]:
    return store.list_jobs(states=[JobState.RUNNING])


@dataclass(frozen=True)
class FinishedJobs:
    succeeded: int
    failed: int
    failed_ids: tuple[int, ...]

    @property
    def total(self) -> int:
        return self.succeeded + self.failed


def finished_since(store: Store, since: float) -> FinishedJobs:
    """Jobs that succeeded or failed at or after `since` (cancelled and pruned ones are
    neither: someone chose to stop them)."""
    # The store lists terminal jobs without a time filter; this reads the light columns of
    # every finished job, newest first (~40 ms per 10,000 on SQLite).
    jobs = store.list_jobs(states=[JobState.SUCCEEDED, JobState.FAILED], newest_first=True)
    recent = [j for j in jobs if j.finished_at is not None and j.finished_at >= since]
    failed = sorted(j.id for j in recent if j.state is JobState.FAILED)
    return FinishedJobs(len(recent) - len(failed), len(failed), tuple(failed))


def jobs_to_scan(store: Store, since: float, also: Iterable[int]) -> list[Job]:
    """Jobs whose run directories may hold a checkpoint that failed to restore: those not
    finished, those finished since `since`, and `also` (jobs with an open alert, so that an
    alert on an old job resolves when its file goes, rather than when the job ages out)."""
    also = set(also)
    return [
        j
        for j in store.list_jobs()
        if not j.state.terminal or (j.finished_at is not None and j.finished_at >= since) or j.id in also
    ]


def corrupt_checkpoints(run_dir: Path) -> list[str]:
    """Checkpoints set aside in `run_dir` because they failed verification on resume (the
    managers in train/checkpoint.py rename them `*.corrupt` rather than delete evidence)."""
    folder = RunDir(run_dir).checkpoints
    try:
        return sorted(p.name for p in folder.iterdir() if p.name.endswith(CORRUPT_SUFFIX))
    except OSError:  # no checkpoints yet, or the folder is on another machine
        return []


# ----------------------------------------------------------------------------- cost


@dataclass(frozen=True)
class DailyCost:
    last_day: float  # the 24 hours before now
    trailing: tuple[float, ...]  # the 24-hour periods before that, most recent first
    currency: str

    @property
    def median(self) -> float:
        return statistics.median(self.trailing) if self.trailing else 0.0


def daily_cost(store: Store, catalog: PriceCatalog, now: float, trailing_days: int) -> DailyCost:
    """GPU cost of the last 24 hours and of each of the `trailing_days` 24-hour periods
    before, priced by the cost ledger's own arithmetic (sched/cost.py). Rolling periods ending
    now rather than calendar days: no time zone to choose, and a spike is seen as it happens."""
    start = now - (trailing_days + 1) * DAY_S
    rows = store.allocations(since=start)
    costs: list[float] = []
    currency = "USD"
    for k in range(trailing_days + 1):
        hi = now - k * DAY_S
        lo = hi - DAY_S
        clipped = [
            dataclasses.replace(r, start=max(r.start, lo), end=min(hi if r.end is None else r.end, hi))
            for r in rows
            if r.start < hi and (r.end is None or r.end > lo)
        ]
        # The store's rows are what cost_report prices too (it passes them untyped).
        report = summarise(cast("list[Any]", clipped), catalog, now=hi)
        costs.append(report.total.cost)
        currency = report.currency
    return DailyCost(costs[0], tuple(costs[1:]), currency)


# ----------------------------------------------------------------------------- GPU utilisation


@dataclass(frozen=True)
class GpuUtilisation:
    job_id: int
    mean_percent: float
    samples: int  # readings of all the job's GPUs in the window


def gpu_utilisation(
    settings: Settings, jobs: Sequence[Job], since: float
) -> tuple[dict[int, GpuUtilisation], list[str]]:
    """Each job's mean GPU utilisation since `since`, from the system metrics its trainer logs
    to MLflow (`system/gpu<i>/utilization_percent`, one series per visible GPU), and the
    problems met. A job with no reading in the window is left out: no data is not idleness."""
    from visionloop.track import store as track_store

    if not jobs or not track_store.store_exists(settings):
        return {}, []
    problems: list[str] = []
    try:
        client = track_store.client(settings)
    except VisionloopError as e:
        return {}, [f"GPU utilisation not read: {e}"]
    out: dict[int, GpuUtilisation] = {}
    for job in jobs:
        try:
            found = _job_utilisation(client, job, since)
        except Exception as e:  # one unreadable run must not hide the others
            problems.append(f"GPU utilisation of job {job.id} not read: {type(e).__name__}: {e}")
            continue
        if found is not None:
            out[job.id] = found
    return out, problems


def _job_utilisation(client: object, job: Job, since: float) -> GpuUtilisation | None:
    from visionloop.track.store import latest_metrics

    meta = RunDir(job.run_dir).read_meta() or {}
    run_id = meta.get("mlflow_run_id")
    if not isinstance(run_id, str) or not run_id:
        return None
    run = client.get_run(run_id)  # type: ignore[attr-defined]
    keys = [k for k in latest_metrics(run) if _GPU_UTIL.fullmatch(k)]
    values = list(_values_since(client, run_id, keys, since))
    if not values:
        return None
    return GpuUtilisation(job.id, sum(values) / len(values), len(values))


def _values_since(client: object, run_id: str, keys: Iterable[str], since: float) -> Iterator[float]:
    since_ms = since * 1000.0
    for key in keys:
        for m in client.get_metric_history(run_id, key):  # type: ignore[attr-defined]
            if m.timestamp >= since_ms:
                yield float(m.value)
