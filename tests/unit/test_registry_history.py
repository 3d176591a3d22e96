"""Alias history replay (what rollback returns to) and its file."""

from __future__ import annotations

from pathlib import Path

import pytest

from visionloop.core.errors import VisionloopError
from visionloop.registry.history import AliasEvent, append_event, champion_stack, read_history


def _ev(action: str, version: int, alias: str = "champion") -> AliasEvent:
    return AliasEvent(at="2026-01-01T00:00:00+00:00", actor="t", action=action, alias=alias, version=version)


def test_sets_push_and_rollbacks_pop() -> None:
    events = [_ev("set", 1), _ev("set", 2), _ev("set", 3)]
    assert champion_stack(events, "champion", 3) == [1, 2, 3]
    events.append(_ev("rollback", 2))
    assert champion_stack(events, "champion", 2) == [1, 2]
    events.append(_ev("rollback", 1))
    assert champion_stack(events, "champion", 1) == [1]


def test_other_aliases_and_repeats_are_ignored() -> None:
    events = [_ev("set", 1), _ev("set", 1), _ev("set", 5, alias="challenger"), _ev("set", 2)]
    assert champion_stack(events, "champion", 2) == [1, 2]
    assert champion_stack(events, "challenger", 5) == [5]


def test_a_move_outside_visionloop_is_pushed() -> None:
    # Someone moved the champion to v4 in the MLflow UI: rollback goes back to v2.
    assert champion_stack([_ev("set", 1), _ev("set", 2)], "champion", 4) == [1, 2, 4]
    assert champion_stack([], "champion", 4) == [4]


def test_history_file_round_trip_and_damage(tmp_path: Path) -> None:
    path = tmp_path / "alias_history.json"
    assert read_history(path) == []
    append_event(path, _ev("set", 1))
    append_event(path, _ev("set", 2))
    assert [e.version for e in read_history(path)] == [1, 2]
    path.write_text("{not json")
    with pytest.raises(VisionloopError, match=r"alias history.*Move it aside"):
        read_history(path)
