"""The retraining loop's state and event log, dataset manifests and `data add` against hostile
input: files edited into garbage, swapped for FIFOs or for links out of their folder, a second
runner of the same loop, a source that overlaps the dataset. Each case asserts the exact
refusal and that nothing was lost or written elsewhere."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from _hangkit import in_thread
from visionloop.core.errors import DataError, SpecError
from visionloop.core.settings import Settings
from visionloop.data.derive import add_images
from visionloop.data.manifest import MAX_LINEAGE, read_manifest
from visionloop.loop import state as loop_state
from visionloop.loop.runner import advance
from visionloop.loop.state import (
    LoopState,
    Round,
    load_state,
    loop_dir,
    loop_lock,
    read_events,
    record_event,
    save_state,
)


def _state_file(home: Path, name: str = "demo") -> Path:
    folder = loop_dir(home, name)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / "state.json"


# --------------------------------------------------------------------------- loop state


def test_state_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    path = _state_file(tmp_path)
    os.mkfifo(path)
    e = in_thread(lambda: load_state(tmp_path, "demo"))
    assert isinstance(e, SpecError)
    assert "is a FIFO (named pipe), not a regular file" in str(e)
    assert "move it aside" in str(e)


def test_state_that_is_a_folder_is_a_clear_error(tmp_path: Path) -> None:
    _state_file(tmp_path).mkdir()
    with pytest.raises(SpecError, match="is a folder, not a regular file"):
        load_state(tmp_path, "demo")


def test_state_link_out_of_its_folder_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "elsewhere.json"
    other.write_bytes(orjson.dumps(LoopState(name="demo", dataset="/d", dataset_version="v").model_dump()))
    _state_file(tmp_path).symlink_to(other)
    with pytest.raises(SpecError, match=r"state\.json is a symbolic link, not the loop's own state"):
        load_state(tmp_path, "demo")


def test_state_naming_another_loop_is_refused_and_nothing_is_written_outside(tmp_path: Path) -> None:
    home = tmp_path / "home"
    doc = LoopState(name="../../escaped", dataset="/d", dataset_version="v").model_dump()
    _state_file(home).write_bytes(orjson.dumps(doc))
    with pytest.raises(SpecError, match=r"is the state of loop '\.\./\.\./escaped', not of 'demo'"):
        load_state(home, "demo")
    assert not (tmp_path / "escaped").exists()


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"\xff\xfe not utf-8", "is not a loop state this visionloop can read"),
        (b"[" * 100_000, "is not a loop state this visionloop can read"),
        (b'{"name": 5, "dataset": [], "dataset_version": null}', "is not a loop state"),
        (b'{"name": "demo", "dataset": "/d", "dataset_version": "v", "rounds": NaN}', "is not a loop state"),
    ],
    ids=["non-utf8", "deep", "wrong-types", "nan"],
)
def test_state_garbage_is_a_one_line_refusal(tmp_path: Path, content: bytes, needle: str) -> None:
    _state_file(tmp_path).write_bytes(content)
    with pytest.raises(SpecError, match=needle):
        load_state(tmp_path, "demo")


# --------------------------------------------------------------------------- event log


def test_events_link_is_not_appended_to(tmp_path: Path) -> None:
    victim = tmp_path / "bashrc"
    victim.write_text("export PATH=/usr/bin\n")
    folder = loop_dir(tmp_path / "home", "demo")
    folder.mkdir(parents=True)
    (folder / "events.jsonl").symlink_to(victim)
    with pytest.raises(SpecError, match=r"events\.jsonl cannot be appended to"):
        record_event(tmp_path / "home", "demo", 1, "opened", "why")
    assert victim.read_text() == "export PATH=/usr/bin\n"
    assert read_events(tmp_path / "home", "demo") == []  # not read through the link either


def test_events_fifo_neither_blocks_the_writer_nor_the_reader(tmp_path: Path) -> None:
    folder = loop_dir(tmp_path, "demo")
    folder.mkdir(parents=True)
    os.mkfifo(folder / "events.jsonl")
    e = in_thread(lambda: record_event(tmp_path, "demo", 1, "opened"))
    assert isinstance(e, SpecError) and "cannot be appended to" in str(e)
    assert in_thread(lambda: read_events(tmp_path, "demo")) == []


def test_read_events_reads_only_the_tail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop_state, "MAX_EVENTS_TAIL_BYTES", 4096)
    record_event(tmp_path, "demo", 1, "first")
    path = loop_dir(tmp_path, "demo") / "events.jsonl"
    with open(path, "ab") as f:
        f.write(b"x" * 10_000 + b"\n")
    record_event(tmp_path, "demo", 1, "last")
    events = read_events(tmp_path, "demo", limit=1000)
    assert [e["event"] for e in events] == ["last"]  # "first" lies before the tail


# --------------------------------------------------------------------------- two runners


def test_second_runner_of_a_loop_is_refused(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    spec: Any = SimpleNamespace(name="demo")
    saved = LoopState(name="demo", dataset="/d", dataset_version="v")
    save_state(tmp_path, saved)
    before = (loop_dir(tmp_path, "demo") / "state.json").read_bytes()
    with (
        loop_lock(tmp_path, "demo"),
        pytest.raises(SpecError, match="'demo' is being run by another process"),
    ):
        advance(spec, settings, lambda: None)
    assert (loop_dir(tmp_path, "demo") / "state.json").read_bytes() == before
    with loop_lock(tmp_path, "demo"):  # released: taken again
        pass


def test_lock_file_that_is_a_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    folder = loop_dir(tmp_path, "demo")
    folder.mkdir(parents=True)
    os.mkfifo(folder / ".lock")

    def take() -> None:
        with loop_lock(tmp_path, "demo"):
            pass

    e = in_thread(take)
    assert isinstance(e, SpecError) and "is not a regular file" in str(e)


# --------------------------------------------------------------------------- loop status


def test_status_survives_hand_edited_times_and_markup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, vl_home: Path
) -> None:
    from visionloop.cli.loop import _when, app
    from visionloop.loop import spec as spec_module

    assert _when("yesterday") == "?"
    assert _when(1e300) == "?"
    assert _when(None) == "-"
    spec = SimpleNamespace(name="demo", model="m", labels=tmp_path / "labels")
    monkeypatch.setattr(spec_module, "load_loop_spec", lambda path: spec)
    st = LoopState(name="demo", dataset="/d", dataset_version="[/]v")
    st.rounds.append(Round(number=1, opened_at=1e300, trigger="[/bold] edited"))
    save_state(vl_home, st)
    path = loop_dir(vl_home, "demo") / "events.jsonl"
    path.write_bytes(b'{"at": "noon", "round": "[/]", "event": "[/x]", "reason": "[/]"}\n')
    r = CliRunner().invoke(app, ["status", str(tmp_path / "loop.yaml")])
    assert r.exit_code == 0, r.output
    assert "(version [/]v)" in r.output and "opened ?: [/bold]" in r.output
    assert "  ?  round [/] [/x]  [/]" in r.output


# --------------------------------------------------------------------------- manifest


def _manifest_dir(tmp_path: Path, content: bytes) -> Path:
    d = tmp_path / "ds"
    d.mkdir()
    (d / "dataset.json").write_bytes(content)
    return d


def test_manifest_fifo_is_named_not_reported_missing(tmp_path: Path) -> None:
    d = tmp_path / "ds"
    d.mkdir()
    os.mkfifo(d / "dataset.json")
    e = in_thread(lambda: read_manifest(d))
    assert isinstance(e, DataError)
    assert "is a FIFO (named pipe), not a regular file" in str(e)


def test_manifest_link_out_of_the_dataset_is_refused(tmp_path: Path, digits_dataset: Path) -> None:
    d = tmp_path / "ds"
    d.mkdir()
    (d / "dataset.json").symlink_to(digits_dataset / "dataset.json")
    with pytest.raises(DataError, match="is a link leading outside the dataset folder"):
        read_manifest(d)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nests too deeply to be a manifest"),
        (b'{"format_version": ' + b"9" * 5000 + b"}", "cannot be read as JSON"),
        (b'{"format_version": "2"}', "has format_version '2', not a number"),
        (b'{"channel_stats": {"mean": [NaN, 0, 0]}}', "NaN is not a number a manifest may hold"),
        (b"\xff\xfe", "cannot be read as JSON"),
    ],
    ids=["deep", "huge-int", "string-version", "nan", "non-utf8"],
)
def test_manifest_garbage_is_a_data_error(tmp_path: Path, content: bytes, needle: str) -> None:
    with pytest.raises(DataError, match=needle) as e:
        read_manifest(_manifest_dir(tmp_path, content))
    assert "set_int_max_str_digits" not in str(e.value)


# --------------------------------------------------------------------------- data add


def _folder_with_file(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "keep.txt").write_text("labelled work")
    return path


@pytest.mark.parametrize(
    ("source", "out", "what"),
    [
        ("labels", "labels", "--out"),  # with --overwrite, the labels would be replaced
        ("labels", "labels/v2", "--out"),
        ("work", "work/labels/v2", "--out"),
        ("data/parent", "v2", "the parent dataset"),
        ("data", "v2", "the parent dataset"),  # holds the parent
        ("data/parent/sub", "v2", "the parent dataset"),
    ],
)
def test_add_source_overlapping_out_or_parent_is_refused(
    tmp_path: Path, source: str, out: str, what: str
) -> None:
    data = tmp_path / "data"
    parent = _folder_with_file(data / "parent")
    (parent / "sub").mkdir()
    _folder_with_file(tmp_path / "labels")
    _folder_with_file(tmp_path / "work" / "labels")
    src = tmp_path / source
    src.mkdir(parents=True, exist_ok=True)
    with pytest.raises(DataError, match=f"overlaps {what} "):
        add_images(parent, src, tmp_path / out, overwrite=True)
    assert (tmp_path / "labels" / "keep.txt").read_text() == "labelled work"
    assert (parent / "keep.txt").read_text() == "labelled work"


def test_add_to_a_parent_at_the_lineage_limit_is_refused(tmp_path: Path, digits_dataset: Path) -> None:
    parent = tmp_path / "parent"
    shutil.copytree(digits_dataset, parent)
    doc = json.loads((parent / "dataset.json").read_text())
    step = {
        "parent": "a" * 64,
        "parent_path": "/d",
        "added": {"train": 1},
        "relabelled": 0,
        "source": "/s",
        "created_at": "2024-01-01T00:00:00+00:00",
    }
    doc["lineage"] = [step] * MAX_LINEAGE
    (parent / "dataset.json").write_text(json.dumps(doc))
    assert len(read_manifest(parent).lineage or []) == MAX_LINEAGE
    labels = _folder_with_file(tmp_path / "labels")
    with pytest.raises(DataError, match=f"already records {MAX_LINEAGE} lineage steps"):
        add_images(parent, labels, tmp_path / "v2")
    assert not (tmp_path / "v2").exists()
