"""Reading a job's progress lines (see visionloop.train.progress) back from its attempt's log.

The control plane learns of a job's checkpoints from the job itself rather than by listing
its run directory, which it may not share (a Ray cluster). Each cycle, `ProgressReader`
reads every open attempt's new log bytes through the executor (`read_log(handle, offset)`),
remembering per attempt, in memory only, where it stopped. After a control-plane restart it
reads each log from the start again, which is harmless: the reconciler records a checkpoint
step once (it checks the store).

The log is written by user code, so the reader trusts nothing in it:

- only complete lines that start with the prefix are parsed; a line longer than
  MAX_LINE_BYTES is skipped whole, however it arrives;
- a line's JSON must be an object with a known `event` and fields of the right types and
  ranges, or it is ignored;
- a read parses at most the newest MAX_READ_BYTES of what is new (older progress is
  superseded by newer anyway); when the executor can say the log's size (a local file), it
  seeks there rather than read the rest, so a job flooding its log costs a bounded read per
  cycle and never lags further and further behind;
- what a line can do is limited to its own job: record a checkpoint step (at a time within
  the attempt's life), and its pace (step of total, steps per second), from which `jobs list`
  and `jobs show` give a running job's expected end. Eval events are parsed, typed, and
  appended to the job folder's `evals.jsonl` (service_reconcile), which the tuner reads.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from visionloop.sched.executors.base import Executor, Handle
from visionloop.train.progress import MAX_LINE_BYTES, MAX_METRICS, PREFIX

MAX_READ_BYTES = 1 << 20
# A log the control plane cannot read locally (Ray's) comes whole with every read, so while
# the attempt runs it is read at most once per (its size / REMOTE_BYTES_PER_S) seconds, and
# at least every REMOTE_EVERY_S: a short log every cycle, a long one every few seconds (and
# once more when the attempt ends).
REMOTE_BYTES_PER_S = 256 * 1024
REMOTE_EVERY_S = 10.0
# A step is stored in a 32-bit integer column (PostgreSQL's INTEGER).
MAX_STEP = 2**31 - 1
_PREFIX = PREFIX.encode()


@dataclass(frozen=True, slots=True)
class CheckpointEvent:
    step: int
    at: float  # when the job says the checkpoint became durable (epoch seconds)


@dataclass(frozen=True, slots=True)
class EvalEvent:
    step: int
    epoch: float
    metrics: dict[str, float]

    @classmethod
    def from_doc(cls, doc: Any) -> EvalEvent:
        """One from its stored or served form ({"step", "epoch", "metrics"}); ValueError,
        TypeError, KeyError or AttributeError when it is not one."""
        metrics = {str(k): float(v) for k, v in doc["metrics"].items()}
        return cls(int(doc["step"]), float(doc["epoch"]), metrics)


@dataclass(frozen=True, slots=True)
class PaceEvent:
    """How far the attempt has got and how fast: `step` of `total` at `rate` steps per second
    (wall clock since the attempt's first step), as of `at` (the job's clock)."""

    step: int
    total: int
    rate: float
    at: float


Event = CheckpointEvent | EvalEvent | PaceEvent
# A pace above this many steps per second is no training step (and would put the expected
# end in the past at once): the line is ignored.
MAX_RATE = 1e6


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _step(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_STEP else None


def parse_line(line: bytes) -> Event | None:
    """One log line (without its newline) as an event; None unless it is a well-formed one."""
    if len(line) > MAX_LINE_BYTES or not line.startswith(_PREFIX):
        return None
    try:
        doc = json.loads(line[len(_PREFIX) :].decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    if not isinstance(doc, dict):
        return None
    kind = doc.get("event")
    step = _step(doc.get("step"))
    if step is None:
        return None
    if kind == "checkpoint":
        at = _number(doc.get("at"))
        return None if at is None else CheckpointEvent(step, at)
    if kind == "pace":
        total, rate, at = _step(doc.get("total")), _number(doc.get("rate")), _number(doc.get("at"))
        if total is None or total < max(step, 1) or rate is None or not 0 < rate <= MAX_RATE or at is None:
            return None
        return PaceEvent(step, total, rate, at)
    if kind == "eval":
        epoch, raw = _number(doc.get("epoch")), doc.get("metrics")
        if epoch is None or not isinstance(raw, dict) or len(raw) > MAX_METRICS:
            return None
        metrics = {}
        for name, value in raw.items():
            v = _number(value)
            if v is None or len(name) > 64:
                return None
            metrics[name] = v
        return EvalEvent(step, epoch, metrics)
    return None


@dataclass(slots=True)
class _Cursor:
    offset: int = 0  # the first byte not consumed yet: always a line's start, unless skipping
    skipping: bool = False  # inside an over-long line: drop bytes up to its newline
    read_at: float = -math.inf  # when it was last read


@dataclass
class ProgressReader:
    """Each open attempt's new progress events, read incrementally through its executor."""

    max_read_bytes: int = MAX_READ_BYTES
    remote_every_s: float = REMOTE_EVERY_S
    remote_bytes_per_s: float = REMOTE_BYTES_PER_S
    _cursors: dict[tuple[int, int], _Cursor] = field(default_factory=dict)

    def read(
        self, executor: Executor, handle: Handle, key: tuple[int, int], *, now: float, final: bool = False
    ) -> list[Event]:
        """The events the attempt `key` (job, attempt) logged since the last call (`final`:
        the attempt has ended, read what is left whatever the interval). Raises what the
        executor raises (ExecutorError, OSError); the position is then unchanged."""
        cur = self._cursors.get(key) or _Cursor()
        offset, skipping = cur.offset, cur.skipping
        path = executor.log_path(handle)
        if path is None:
            interval = min(self.remote_every_s, offset / self.remote_bytes_per_s)
            if not final and now - cur.read_at < interval:
                return []
        else:
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                return []  # no log yet
            if size < offset:  # the log was replaced: start over
                offset, skipping = 0, False
            if size - offset > self.max_read_bytes:
                offset, skipping = size - self.max_read_bytes, True  # mid-line, most likely
        data = bytearray()
        for piece in executor.read_log(handle, offset):
            data += piece
            if len(data) > self.max_read_bytes:  # (a log with no size to jump by) keep the newest
                cut = len(data) - self.max_read_bytes
                del data[:cut]
                offset, skipping = offset + cut, True
        events: list[Event] = []
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            if skipping:
                skipping = False
            else:
                event = parse_line(bytes(data[start:end]).rstrip(b"\r"))
                if event is not None:
                    events.append(event)
            start = end + 1
        # An unfinished line is read again next time, unless it is already too long to count.
        if len(data) - start > MAX_LINE_BYTES:
            start, skipping = len(data), True
        self._cursors[key] = _Cursor(offset + start, skipping, now)
        return events

    def forget_except(self, keep: set[tuple[int, int]]) -> None:
        """Drop the positions of attempts that are no longer open."""
        for key in [k for k in self._cursors if k not in keep]:
            del self._cursors[key]


__all__ = ["CheckpointEvent", "EvalEvent", "Event", "ProgressReader", "parse_line"]
