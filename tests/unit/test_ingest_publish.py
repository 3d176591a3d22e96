"""Building a folder beside its place and moving it in whole."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from visionloop.core.errors import DataError
from visionloop.data.publish import building, publish


def siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def test_a_finished_folder_lands_at_a_new_or_empty_path(tmp_path: Path) -> None:
    for out in (tmp_path / "new" / "ds", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        with building(out) as tmp:
            assert tmp.parent == out.parent and tmp.name.startswith(f".{out.name}.partial-")
            (tmp / "dataset.json").write_text("{}")
            publish(tmp, out, replace=False)
        assert (out / "dataset.json").read_text() == "{}"
        assert siblings(out) == []


def test_replace_swaps_the_old_folder_out_and_deletes_it(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with building(out) as tmp:
        (tmp / "new.txt").write_text("new")
        publish(tmp, out, replace=True)
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert siblings(out) == []


def test_an_occupied_path_is_not_replaced_without_permission(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(DataError, match="pass --overwrite"), building(out) as tmp:
        (tmp / "new.txt").write_text("new")
        publish(tmp, out, replace=False)
    assert (out / "old.txt").read_text() == "old"
    assert siblings(out) == []  # the unpublished build was removed


def test_a_failed_build_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    with pytest.raises(KeyboardInterrupt), building(out) as tmp:
        (tmp / "half.bin").write_bytes(b"x" * 10)
        raise KeyboardInterrupt
    assert not out.exists() and siblings(out) == []


def test_stale_partial_folders_of_dead_processes_are_removed(tmp_path: Path) -> None:
    import subprocess
    import sys

    from visionloop.data.publish import remove_stale_partials

    out = tmp_path / "ds"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    stale = tmp_path / f".ds.partial-{int(dead.stdout)}-abcd1234"
    stale.mkdir()
    (stale / "chunk.bin").write_bytes(b"half")
    live = tmp_path / f".ds.partial-{os.getppid()}-abcd1234"  # a running process: left alone
    live.mkdir()
    other = tmp_path / ".other.partial-1-abcd1234"
    other.mkdir()
    assert remove_stale_partials(out) == [stale]
    assert not stale.exists() and live.exists() and other.exists()
