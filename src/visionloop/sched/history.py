"""How long a job should run, from the runs of the same spec and architecture before it.

Reservations plan with each running job's expected end: from its reported pace once it runs,
else from the time limit its owner gave (`max_runtime`), else from history (this module),
else a conservative default (`default_runtime_s`). A job's history is the jobs that ran the
same work to an end before it, read from the job store, where every run through the queue
is recorded with its GPUs and its attempts (the MLflow tracking store knows neither).

Two keys say what "the same" is, both hashes of the job's workload and resources:
- **spec**: everything that decides the run's length (the architecture, the data and how it
  is read, the precision, the devices, the optimiser and the epochs or steps it runs), but
  not its seed or how it is tracked. Same spec: the median of their run times.
- **shape**: the same without the optimiser, schedule, loss and length: the architecture on
  the same data and GPUs. Same shape: the median time per epoch (or step) times this job's
  epochs (or steps), so a 90-epoch run learns from 10-epoch ones, and a tuning trial heading
  for a rung from the trials that paused there.

A sample is a job that ended after running its whole length: succeeded, or a tuning trial
paused at its rung. Its run time is the time its attempts held their GPUs, so a preempted
run counts the work it lost too: an estimate on the long side, which a reservation prefers.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

# The most recent samples per shape that an estimate reads: old enough runs stop counting
# once the code, data or machines have changed, and a median over 20 is stable.
SAMPLES_PER_SHAPE = 20

LengthUnit = Literal["epochs", "steps"]


@dataclass(frozen=True, slots=True)
class RuntimeProfile:
    """What a workload says about its own length (`TrainWorkload.runtime_profile`): the parts
    of its spec that decide its speed (`shape`) and those that decide its length as well
    (`detail`), and how many epochs or steps it runs."""

    shape: Mapping[str, Any]
    detail: Mapping[str, Any]
    length: int
    unit: LengthUnit


@dataclass(frozen=True, slots=True)
class RuntimeKey:
    """A job's keys into the history, as stored with it (jobs.spec_key, shape_key, run_length)."""

    spec: str
    shape: str
    length: int


def _digest(doc: Mapping[str, Any]) -> str:
    text = json.dumps(doc, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def runtime_key(profile: RuntimeProfile, gpus: int, nodes: int) -> RuntimeKey:
    """The keys of a workload run on `gpus` GPUs over `nodes` nodes: more GPUs, another speed."""
    shape = {"shape": profile.shape, "unit": profile.unit, "gpus": gpus, "nodes": nodes}
    spec = {"shape": shape, "detail": profile.detail, "length": profile.length}
    return RuntimeKey(spec=_digest(spec), shape=_digest(shape), length=profile.length)


@dataclass(frozen=True, slots=True)
class Sample:
    """One earlier run: its keys and the seconds its attempts held their GPUs."""

    spec_key: str
    shape_key: str
    length: int
    ran_s: float


@dataclass(frozen=True, slots=True)
class Estimate:
    seconds: float
    runs: int  # how many earlier runs it rests on
    basis: str  # shown to users: "the median of 3 earlier runs of this spec"
    # The shortest and longest of those runs (scaled to this run's length): how far to
    # trust the median. Runs of one spec that range from 1 h to 9 h say little.
    shortest: float
    longest: float


class RuntimeHistory:
    """The samples of some shapes (`Store.runtime_samples`), and the estimates they give."""

    def __init__(self, samples: Iterable[Sample]) -> None:
        self._by_spec: dict[str, list[float]] = {}
        self._per_unit: dict[str, list[float]] = {}
        for s in samples:
            if s.ran_s <= 0 or s.length <= 0:
                continue  # a clock that went backwards, or a hand-edited row: says nothing
            self._by_spec.setdefault(s.spec_key, []).append(s.ran_s)
            self._per_unit.setdefault(s.shape_key, []).append(s.ran_s / s.length)
        self._memo: dict[tuple[str, str, int], Estimate | None] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_spec.values())

    def estimate(self, spec_key: str | None, shape_key: str | None, length: int | None) -> Estimate | None:
        """How long a run with these keys should take, or None when nothing like it ran."""
        if spec_key is None or shape_key is None or not length:
            return None
        memo_key = (spec_key, shape_key, length)
        if memo_key in self._memo:
            return self._memo[memo_key]
        found: Estimate | None = None
        same = self._by_spec.get(spec_key)
        if same:
            basis = f"the median of {_runs(len(same))} of this spec"
            found = Estimate(statistics.median(same), len(same), basis, min(same), max(same))
        elif per := self._per_unit.get(shape_key):
            found = Estimate(
                statistics.median(per) * length,
                len(per),
                f"{_runs(len(per))} of this architecture on the same data and GPUs, "
                "at their median time per epoch (or step), times this run's length",
                min(per) * length,
                max(per) * length,
            )
        self._memo[memo_key] = found
        return found


def _runs(n: int) -> str:
    return f"{n} earlier run" + ("" if n == 1 else "s")
