"""Progress lines: how a job tells the control plane what it has done, through its own log.

The control plane may not share the job's filesystem (a Ray cluster), so it cannot learn of
checkpoints by listing the run directory. Instead, when it sets `VISIONLOOP_PROGRESS=1` in
the job's environment, the trainer's rank 0 writes one line per event to stdout:

    @@visionloop-progress {"event":"checkpoint","step":200,"at":1764040000.5}
    @@visionloop-progress {"event":"eval","step":200,"epoch":2,"metrics":{"accuracy":0.91}}
    @@visionloop-progress {"event":"pace","step":230,"total":5000,"rate":3.41,"at":1764040030.2}

and the control plane reads them back from the attempt's log (`Executor.read_log`). A
checkpoint line is written only once the checkpoint is durable (renamed and its folder
synced), so a step the control plane records can always be resumed from. Every line is one
`write` of at most MAX_LINE_BYTES, so it lands whole in the log and the reader never drops it.

A pace line says how far the attempt has got (`step` of `total`) and how fast it goes
(`rate`, steps per second of wall clock since its first step, evaluations included), at most
once every PACE_EVERY_S: the control plane derives the job's expected end from it.

The log is written by user code: the reader (visionloop.sched.progress) trusts a line no
further than recording its own job's checkpoint steps and pace.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping

ENV = "VISIONLOOP_PROGRESS"
PREFIX = "@@visionloop-progress "
# Longer lines are ignored by the reader; the emitter drops metrics until a line fits.
MAX_LINE_BYTES = 4096
# An eval event carries at most this many metrics (the headline ones, not per-class tables).
MAX_METRICS = 32
# Pace lines at most this often; `VISIONLOOP_PACE_EVERY_S` in the job's environment changes it
# (the control plane passes it on when `[jobs] env_allow` names it).
PACE_EVERY_S = 30.0
PACE_ENV = "VISIONLOOP_PACE_EVERY_S"


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def checkpoint(step: int) -> None:
    """A checkpoint at `step` is durable. Call on the rank that wrote it."""
    if enabled():
        _emit({"event": "checkpoint", "step": int(step), "at": round(time.time(), 3)})


def evaluation(step: int, epoch: float, metrics: Mapping[str, float]) -> None:
    """An evaluation at `step` finished with these metrics (names without the "val/" prefix).
    Only finite scalar metrics with plain names go out, at most MAX_METRICS of them."""
    if not enabled():
        return
    kept: dict[str, float] = {}
    for name, value in metrics.items():
        if len(kept) >= MAX_METRICS:
            break
        if "/" in name or len(name) > 64 or isinstance(value, bool):
            continue
        try:
            v = float(value)
        except (TypeError, ValueError):
            continue
        if math.isfinite(v):
            kept[name] = v
    event = {"event": "eval", "step": int(step), "epoch": float(epoch), "metrics": kept}
    while len(_line(event).encode()) > MAX_LINE_BYTES and kept:
        kept.popitem()
    _emit(event)


class Pace:
    """The attempt's pace, told at most every `every_s` seconds (`tick` after each step: a
    clock read and a comparison when nothing is due). The rate counts from the attempt's first
    step, so start-up (data, model, compilation) is not in it and evaluations are."""

    def __init__(self, every_s: float | None = None) -> None:
        if every_s is None:
            try:
                every_s = float(os.environ.get(PACE_ENV, PACE_EVERY_S))
            except ValueError:
                every_s = PACE_EVERY_S
        self.every_s = every_s if math.isfinite(every_s) and every_s >= 0 else PACE_EVERY_S
        self._first: tuple[int, float] | None = None  # (step, monotonic time) of the first tick
        self._told = -math.inf

    def tick(self, step: int, total: int) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = (step, now)
            self._told = now
            return
        if now - self._told < self.every_s or not enabled():
            return
        steps, seconds = step - self._first[0], now - self._first[1]
        if steps <= 0 or seconds <= 0:
            return
        self._told = now
        rate = float(f"{steps / seconds:.6g}")
        at = round(time.time(), 3)
        _emit({"event": "pace", "step": int(step), "total": int(total), "rate": rate, "at": at})


def _line(event: Mapping[str, object]) -> str:
    return PREFIX + json.dumps(event, separators=(",", ":"), allow_nan=False) + "\n"


def _emit(event: Mapping[str, object]) -> None:
    # One write of the whole line: with the log opened for appending, it is not interleaved
    # with other writers' output. Progress is advisory: a closed stdout must not fail training.
    try:
        sys.stdout.write(_line(event))
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
