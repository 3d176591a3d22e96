"""A loop's state on disk: `<home>/loops/<name>/state.json` (the current dataset version and
every round with its steps) and `events.jsonl` (what happened, when and why, one line each).

A round is one retraining: opened by a trigger, then its steps in order. Each step's record is
written before the step acts (running) and after (done, with what it made: the dataset
version, the queue job, the registered version, ...), so a loop killed at any point resumes at
the step it was in, and every step reads back what an earlier attempt of it made instead of
making it again (the queue job by its idempotency key, the registered version by its run).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from visionloop.core.errors import SpecError
from visionloop.core.fsutil import atomic_write_bytes

STEPS = ("dataset", "train", "register", "evaluate", "gate", "export", "canary", "promote")
StepName = Literal["dataset", "train", "register", "evaluate", "gate", "export", "canary", "promote"]
StepStatus = Literal["pending", "running", "waiting", "done", "skipped", "failed"]
Outcome = Literal["promoted", "rejected", "failed"]
MAX_STATE_BYTES = 16 * 2**20
MAX_ROUNDS_KEPT = 1000


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


def load_state(home: Path, name: str) -> LoopState | None:
    path = loop_dir(home, name) / "state.json"
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_STATE_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(raw) > MAX_STATE_BYTES:
        raise SpecError(f"{path} is over {MAX_STATE_BYTES // 2**20} MiB; it is not a loop's state")
    try:
        return LoopState.model_validate(orjson.loads(raw))
    except (orjson.JSONDecodeError, ValidationError) as e:
        raise SpecError(
            f"{path} is not a loop state this visionloop can read ({str(e)[:300]}); move it aside to "
            "start the loop afresh (its rounds' datasets, jobs and versions stay where they are)."
        ) from e


def save_state(home: Path, state: LoopState) -> None:
    state.rounds = state.rounds[-MAX_ROUNDS_KEPT:]
    folder = loop_dir(home, state.name)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(
        folder / "state.json", orjson.dumps(state.model_dump(mode="json"), option=orjson.OPT_INDENT_2)
    )


def record_event(home: Path, name: str, round_number: int | None, what: str, reason: str = "") -> None:
    """Append one line to the loop's event log (kept whole lines: one write each)."""
    folder = loop_dir(home, name)
    folder.mkdir(parents=True, exist_ok=True)
    line = orjson.dumps({"at": time.time(), "round": round_number, "event": what, "reason": reason[:2000]})
    with open(folder / "events.jsonl", "ab") as f:
        f.write(line + b"\n")


def read_events(home: Path, name: str, limit: int = 50) -> list[dict[str, Any]]:
    path = loop_dir(home, name) / "events.jsonl"
    try:
        lines = path.read_bytes().splitlines()[-limit:]
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            doc = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue  # a line cut by a crash mid-write
        if isinstance(doc, dict):
            events.append(doc)
    return events
