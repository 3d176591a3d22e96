"""Run directories: one trainer at a time, and resumption only with a compatible spec."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from visionloop.core.errors import TrainingError
from visionloop.train.launch import combine_exit_codes
from visionloop.train.rundir import RunDir

SPEC: dict[str, Any] = {
    "data": {"dataset": "/d", "workers": 2, "batch_size": 64},
    "optimizer": {"lr": 0.1},
    "device": "auto",
}


def test_first_prepare_creates_uid_and_saves_the_spec_verbatim(tmp_path: Path) -> None:
    rd = RunDir(tmp_path / "run")
    rd.lock()
    meta, resuming = rd.prepare("# my comment\nepochs: 1\n", SPEC)
    assert not resuming and len(meta["uid"]) == 32
    assert (rd.path / "spec.yaml").read_text() == "# my comment\nepochs: 1\n"
    again, resuming = rd.prepare("anything", SPEC)
    assert resuming and again["uid"] == meta["uid"]
    rd.unlock()


def test_execution_only_changes_may_resume(tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    rd.prepare("", SPEC)
    changed = {**SPEC, "data": {**SPEC["data"], "workers": 8}, "device": "cpu"}
    _, resuming = rd.prepare("", changed)
    assert resuming


def test_a_different_spec_is_refused_with_the_differences(tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    rd.prepare("", SPEC)
    with pytest.raises(TrainingError) as e:
        rd.prepare("", {**SPEC, "optimizer": {"lr": 0.2}})
    msg = str(e.value)
    assert "optimizer.lr: 0.1 -> 0.2" in msg and "new --run-dir" in msg


def test_a_run_from_a_release_without_a_new_field_resumes_when_it_is_at_its_default(tmp_path: Path) -> None:
    # The run was started by a release whose train spec had no `distributed` field; this
    # release adds it with the default, which trains what the old one did.
    rd = RunDir(tmp_path)
    rd.prepare("", SPEC)
    _, resuming = rd.prepare("", {**SPEC, "distributed": "ddp"})
    assert resuming
    _, resuming = rd.prepare("", {**SPEC, "distributed": "ddp"})  # and from then on, as recorded
    assert resuming
    # Not at its default, or a field the old spec had with another value: refused.
    other = RunDir(tmp_path / "other")
    other.prepare("", SPEC)
    with pytest.raises(TrainingError, match="distributed: None -> 'fsdp'"):
        other.prepare("", {**SPEC, "distributed": "fsdp"})
    with pytest.raises(TrainingError, match=r"optimizer\.lr"):
        other.prepare("", {**SPEC, "distributed": "ddp", "optimizer": {"lr": 0.2}})


def test_a_folder_that_is_not_a_run_keeps_its_files(tmp_path: Path) -> None:
    """`train configs/a.yaml --run-dir configs` overwrote the folder's own spec.yaml (and a
    folder's final.safetensors or model_card.json): a folder without run.json that holds what
    a run writes is refused, and nothing in it changes."""
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "spec.yaml").write_text("mine: 1\n")
    (configs / "model_card.json").write_text("{}")
    with pytest.raises(TrainingError, match=r"no run\.json\) but holds spec\.yaml, model_card\.json"):
        RunDir(configs).prepare("epochs: 1\n", SPEC)
    assert (configs / "spec.yaml").read_text() == "mine: 1\n"
    assert sorted(p.name for p in configs.iterdir()) == ["model_card.json", "spec.yaml"]
    # Other files are no run's: a folder holding them may be a run's.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    _, resuming = RunDir(other).prepare("epochs: 1\n", SPEC)
    assert not resuming and (other / "run.json").is_file()
    # A crash between spec.yaml and run.json leaves the same spec: the rerun starts.
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "spec.yaml").write_text("epochs: 1\n")
    _, resuming = RunDir(crashed).prepare("epochs: 1\n", SPEC)
    assert not resuming and (crashed / "run.json").is_file()


def test_a_second_trainer_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    rd = RunDir(tmp_path)
    rd.lock()
    code = (
        "import sys\nfrom visionloop.train.rundir import RunDir\n"
        "from visionloop.core.errors import TrainingError\n"
        f"try:\n    RunDir({str(tmp_path)!r}).lock()\nexcept TrainingError as e:\n    print(e); sys.exit(3)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 3 and "is in use by pid" in p.stdout
    rd.unlock()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


@pytest.mark.parametrize(
    ("codes", "expected"),
    [
        ([0, 0], 0),
        ([75, 75], 75),
        ([0, 75], 75),
        ([75, 1], 1),
        ([0, -9], 137),
        ([3, 75, 0], 3),
        ([76, 76], 76),  # every rank paused at the rung
        ([76, 75], 75),  # a stop wins: it resumes as stopped
        ([76, 2], 2),
    ],
)
def test_launcher_exit_code_mapping(codes: list[int], expected: int) -> None:
    assert combine_exit_codes(codes) == expected
