"""A loop's state on disk: `<home>/loops/<name>/state.json` (the current dataset version and
every round with its steps) and `events.jsonl` (what happened, when and why, one line each).

A round is one retraining: opened by a trigger, then its steps in order. Each step's record is
written before the step acts (running) and after (done, with what it made: the dataset
version, the queue job, the registered version, ...), so a loop killed at any point resumes at
the step it was in, and every step reads back what an earlier attempt of it made instead of
making it again (the queue job by its idempotency key, the registered version by its run).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from visionloop.core.errors import SpecError
from visionloop.core.fsutil import NotRegularFileError, TooLargeError, atomic_write_bytes, read_capped

log = logging.getLogger("visionloop.loop")

STEPS = ("dataset", "train", "register", "evaluate", "gate", "export", "canary", "promote")
StepName = Literal["dataset", "train", "register", "evaluate", "gate", "export", "canary", "promote"]
StepStatus = Literal["pending", "running", "waiting", "done", "skipped", "failed"]
Outcome = Literal["promoted", "rejected", "failed"]
MAX_STATE_BYTES = 16 * 2**20
MAX_ROUNDS_KEPT = 1000
# `loop status` shows the last few events: only the file's tail is read, however long it grew.
MAX_EVENTS_TAIL_BYTES = 1 * 2**20


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StepRecord(_Model):
    status: StepStatus = "pending"
    started_at: float | None = None
    ended_at: float | None = None
    reason: str = ""
    outputs: dict[str, Any] = Field(default_factory=dict)


class Round(_Model):
    number: int
    opened_at: float
    trigger: str  # why it opened
    labels: list[str] = Field(default_factory=list)  # the labelled folders it takes in, in order
    steps: dict[str, StepRecord] = Field(default_factory=lambda: {s: StepRecord() for s in STEPS})
    outcome: Outcome | None = None
    closed_at: float | None = None
    reason: str = ""  # of the outcome

    @property
    def open(self) -> bool:
        return self.outcome is None

    @model_validator(mode="before")
    @classmethod
    def _every_step(cls, doc: Any) -> Any:
        """A round recorded before a step existed (gate, export and canary came later) gets it:
        pending in an open round, skipped in a closed one."""
        if isinstance(doc, dict) and isinstance(doc.get("steps"), dict):
            missing = [s for s in STEPS if s not in doc["steps"]]
            if missing:
                status = "pending" if doc.get("outcome") is None else "skipped"
                doc = {**doc, "steps": {**doc["steps"], **{s: {"status": status} for s in missing}}}
        return doc


class LoopState(_Model):
    name: str
    dataset: str  # the current dataset version's folder: each round builds on it
    dataset_version: str
    consumed: list[str] = Field(default_factory=list)  # labelled folders already taken in
    rounds: list[Round] = Field(default_factory=list)

    @property
    def current(self) -> Round | None:
        return self.rounds[-1] if self.rounds and self.rounds[-1].open else None


def loop_dir(home: Path, name: str) -> Path:
    return home / "loops" / name


def _own_file(path: Path, what: str) -> None:
    """Refuse a symbolic link at `path`: the loop's files live in its own folder, and a link
    (to another loop's state, to ~/.bashrc) would have the loop read or append elsewhere."""
    if path.is_symlink():
        raise SpecError(
            f"{path} is a symbolic link, not the loop's own {what}; remove the link (the loop keeps its "
            "files in its own folder) and run the loop again."
        )


def load_state(home: Path, name: str) -> LoopState | None:
    path = loop_dir(home, name) / "state.json"
    try:
        _own_file(path, "state")
        # read_capped: a state.json swapped for a FIFO or a device must not hang the loop.
        raw = read_capped(path, MAX_STATE_BYTES, what="a loop's state")
    except FileNotFoundError:
        return None
    except NotRegularFileError as e:
        raise SpecError(f"{e}; move it aside to start the loop afresh.") from e
    except OSError as e:  # permissions, an I/O error: named, without a traceback
        raise SpecError(
            f"{path} cannot be read ({e.strerror or e}); fix its permissions or move it aside."
        ) from e
    except TooLargeError:
        raise SpecError(f"{path} is over {MAX_STATE_BYTES // 2**20} MiB; it is not a loop's state") from None
    try:
        state = LoopState.model_validate(orjson.loads(raw))
    except (orjson.JSONDecodeError, ValidationError) as e:
        raise SpecError(
            f"{path} is not a loop state this visionloop can read ({str(e)[:300]}); move it aside to "
            "start the loop afresh (its rounds' datasets, jobs and versions stay where they are)."
        ) from e
    if state.name != name:
        # save_state writes to loops/<state.name>/: a state edited to name another loop (or
        # "../../x") would have this loop overwrite that one's state, or write outside loops/.
        raise SpecError(
            f"{path} is the state of loop {state.name[:80]!r}, not of {name!r}; move it aside to start "
            "the loop afresh, or put it back under its own loop's folder."
        )
    return state


@contextlib.contextmanager
def loop_lock(home: Path, name: str) -> Iterator[None]:
    """Hold the loop's lock for one pass, refusing a second `loop run` of the same loop.

    Two runners would each load the state, act, and save over each other's rounds (a round
    opened twice, a job recorded by one and lost by the other). The lock is an flock, released
    by the kernel when its holder dies, so a crash never leaves the loop locked.
    """
    folder = loop_dir(home, name)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ".lock"
    try:
        # O_NOFOLLOW and O_NONBLOCK: a lock file replaced by a link or a FIFO is refused, never
        # followed or waited on.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise SpecError(
            f"{path} cannot be opened as the loop's lock ({e.strerror or e}); remove it and run the "
            "loop again."
        ) from e
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SpecError(f"{path} is not a regular file; remove it and run the loop again.")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise SpecError(
                f"loop {name!r} is being run by another process (it holds {path}); let that one drive "
                "it, or stop it first."
            ) from e
        yield
    finally:
        os.close(fd)  # releases the flock


def save_state(home: Path, state: LoopState) -> None:
    state.rounds = state.rounds[-MAX_ROUNDS_KEPT:]
    folder = loop_dir(home, state.name)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(
        folder / "state.json", orjson.dumps(state.model_dump(mode="json"), option=orjson.OPT_INDENT_2)
    )


def _open_events(path: Path, flags: int) -> int:
    # O_NOFOLLOW: an events.jsonl linked to another file (~/.bashrc) must not be appended to;
    # O_NONBLOCK: one replaced by a FIFO must not block the loop (opening it for writing waits
    # for a reader); anything but a regular file is refused.
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(errno.EINVAL, "is not a regular file; remove it", os.fspath(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def record_event(home: Path, name: str, round_number: int | None, what: str, reason: str = "") -> None:
    """Append one line to the loop's event log (kept whole lines: one write each)."""
    folder = loop_dir(home, name)
    folder.mkdir(parents=True, exist_ok=True)
    line = orjson.dumps({"at": time.time(), "round": round_number, "event": what, "reason": reason[:2000]})
    path = folder / "events.jsonl"
    try:
        fd = _open_events(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except OSError as e:
        raise SpecError(
            f"{path} cannot be appended to ({e.strerror or e}); it must be the loop's own regular "
            "file: remove it (a link, a FIFO) and run the loop again."
        ) from e
    try:
        os.write(fd, line + b"\n")
    finally:
        os.close(fd)


def read_events(home: Path, name: str, limit: int = 50) -> list[dict[str, Any]]:
    """The last `limit` events, from the last MiB of the log at most (the log only grows).
    An unreadable log (a link, a FIFO) reads as no events: it is for people, not the loop."""
    path = loop_dir(home, name) / "events.jsonl"
    try:
        fd = _open_events(path, os.O_RDONLY)
    except FileNotFoundError:
        return []
    except OSError as e:
        log.warning("not reading %s: %s", path, e.strerror or e)
        return []
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - MAX_EVENTS_TAIL_BYTES))
        lines = f.read(MAX_EVENTS_TAIL_BYTES).splitlines()[-limit:]
    events = []
    for line in lines:
        try:
            doc = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a line cut by a crash mid-write (or by reading from the middle)
        if isinstance(doc, dict):
            events.append(doc)
    return events
