"""Alias history: every alias change with who and when, kept as one small JSON file per model.

MLflow keeps only the current alias → version mapping; rollback needs to know what the
champion was before, and `models show` prints the story. The file is rewritten atomically under
the model lock, so concurrent changes are never lost.
"""

from __future__ import annotations

import getpass
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from visionloop.core.errors import VisionloopError
from visionloop.core.fsutil import atomic_write_text
from visionloop.registry.files import UnreadableFileError, read_json


class AliasEvent(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    at: str
    actor: str
    action: str  # "set", "rollback" or "unset" (the alias removed; `version` is the one it left)
    alias: str
    version: int
    previous: int | None = None
    # Why the change was made, as its maker said (required to force past the promotion gate).
    reason: str | None = None
    # What the promotion gate decided (visionloop.eval.gate: outcome, criteria with values,
    # the two reports compared); the registry stores it as given and never reads it.
    gate: dict[str, Any] | None = None


_EVENTS = TypeAdapter(list[AliasEvent])


def default_actor() -> str:
    """Who is making the change: $VISIONLOOP_ACTOR (set by a control plane acting for a user),
    else the login name."""
    actor = os.environ.get("VISIONLOOP_ACTOR")
    if actor:
        return actor
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers)
        return f"uid:{os.getuid()}"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# Thousands of alias changes with their gate decisions fit with room to spare.
MAX_HISTORY_BYTES = 64 * 2**20


def read_history(path: Path) -> list[AliasEvent]:
    # files.read_json: a FIFO (it used to read as "no history", then be replaced), a folder,
    # bytes that are not UTF-8, a 5000-digit number or deep nesting used to escape as a
    # traceback or hang; each is now this one error.
    try:
        raw: Any = read_json(path, MAX_HISTORY_BYTES)
        return _EVENTS.validate_python(raw)
    except FileNotFoundError:
        return []
    except (UnreadableFileError, ValidationError) as e:
        raise VisionloopError(
            f"{path} (the alias history) is unreadable: {e}. Move it aside to start a new history; "
            "the aliases themselves are safe in the MLflow registry."
        ) from e


def append_event(path: Path, event: AliasEvent) -> None:
    events = [*read_history(path), event]
    # Unset fields are left out, so a history without reasons or gate decisions stays readable
    # by a visionloop that predates them.
    atomic_write_text(path, _EVENTS.dump_json(events, indent=2, exclude_none=True).decode() + "\n")


def champion_stack(events: list[AliasEvent], alias: str, current: int | None) -> list[int]:
    """The versions `alias` pointed to, oldest first, with rolled-back ones removed.

    A `set` pushes a version; a `rollback` pops the version it rolled back from. So set v1, v2,
    v3 then rollback gives [1, 2]; a second rollback gives [1]. If the alias was moved outside
    visionloop (the MLflow UI), the current version is pushed so that rollback returns to what
    the history last knew.
    """
    stack: list[int] = []
    for e in events:
        if e.alias != alias or e.action == "unset":
            continue
        if e.action == "rollback" and stack:
            stack.pop()
        if not stack or stack[-1] != e.version:
            stack.append(e.version)
    if current is not None and (not stack or stack[-1] != current):
        stack.append(current)
    return stack
