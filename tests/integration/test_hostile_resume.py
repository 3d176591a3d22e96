"""Resuming a real run whose directory was tampered with or damaged: the newest checkpoint is
impossible (a step past the run's end, NaN weights) or the trainer's own files are not plain
files. Resume refuses with a message naming the file and what to do, and keeps every good
checkpoint; after the bad one is moved away, the run resumes from the previous one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from _hangkit import in_thread
from _trainkit import spec_doc
from visionloop.core.errors import CheckpointError, TrainingError
from visionloop.specs import validate_train_spec
from visionloop.train.api import train
from visionloop.train.checkpoint import checkpoint_name, encode, load_verified
from visionloop.train.report import Reporter
from visionloop.train.signals import StopRequest


class StopAt(Reporter):
    def __init__(self, step: int, stop: StopRequest) -> None:
        self.at, self.stop_request = step, stop

    def step(self, step: int, loss: float | None, lr: float, images_per_s: float | None) -> None:
        if step == self.at:
            self.stop_request.request("test")


def _stopped_run(tmp_path: Path, dataset: Path) -> tuple[dict[str, Any], Path]:
    """A run of 8 steps stopped at step 4, with checkpoints at 2 and 4."""
    doc = spec_doc(dataset, epochs=None, steps=8, data__workers=0, checkpoint__every_steps=2)
    stop = StopRequest()
    run = tmp_path / "run"
    first = train(validate_train_spec(doc), run, reporter=StopAt(4, stop), track=False, stop=stop)
    assert first.exit_code == 75 and first.step == 4
    return doc, run


def _plant(run: Path, step: int, change: Any) -> Path:
    """A checkpoint at `step` made from the run's step-4 one, changed by `change(state)`, with a
    valid checksum (whoever can write the file can compute one)."""
    state = load_verified(run / "checkpoints" / checkpoint_name(4))
    change(state)
    path = run / "checkpoints" / checkpoint_name(step)
    path.write_bytes(encode(state, step, None))
    return path


def _past_the_end(state: dict[str, Any]) -> None:
    state["position"]["step"] = 10**9


def _nan_weights(state: dict[str, Any]) -> None:
    name = next(k for k, v in state["model"].items() if v.is_floating_point())
    state["model"][name] = torch.full_like(state["model"][name], float("nan"))


@pytest.mark.parametrize(
    ("change", "problem"),
    [(_past_the_end, r"step 1000000000 is past this run's last, 8"), (_nan_weights, "NaN or infinite")],
    ids=["step-past-the-end", "nan-weights"],
)
def test_an_impossible_latest_checkpoint_is_refused_by_name_and_the_good_ones_kept(
    tmp_path: Path, digits_dataset: Path, change: Any, problem: str
) -> None:
    doc, run = _stopped_run(tmp_path, digits_dataset)
    bad = _plant(run, 5, change)
    good = {p.name: p.read_bytes() for p in (run / "checkpoints").glob("step-*.ckpt") if p != bad}
    with pytest.raises(CheckpointError, match=problem) as e:
        train(validate_train_spec(doc), run, track=False)
    assert str(bad) in str(e.value) and f"move {bad.name} out of" in str(e.value)
    assert bad.is_file()
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").glob("step-*.ckpt") if p != bad} == good
    # Doing what the message says resumes from the good one before it.
    bad.rename(tmp_path / bad.name)
    done = train(validate_train_spec(doc), run, track=False)
    assert done.exit_code == 0 and done.step == 8


def test_a_fifo_train_log_is_refused_not_waited_on(tmp_path: Path, digits_dataset: Path) -> None:
    doc, run = _stopped_run(tmp_path, digits_dataset)
    (run / "train.log").unlink()
    os.mkfifo(run / "train.log")
    got = in_thread(lambda: train(validate_train_spec(doc), run, track=False))
    assert isinstance(got, TrainingError), got
    assert "train.log is not a regular file" in str(got) and "Remove it" in str(got)
    (run / "train.log").unlink()
    done = train(validate_train_spec(doc), run, track=False)
    assert done.exit_code == 0 and done.step == 8


def test_an_eval_report_folder_taken_by_a_file_stops_the_run_by_name_and_it_resumes(
    tmp_path: Path, digits_dataset: Path
) -> None:
    doc, run = _stopped_run(tmp_path, digits_dataset)
    planted = run / "eval" / "step-000000008"  # the final evaluation's
    planted.parent.mkdir(exist_ok=True)
    planted.write_text("not a folder")
    with pytest.raises(TrainingError, match=r"step-000000008 is not a folder.*Remove it, then rerun") as e:
        train(validate_train_spec(doc), run, track=False)
    assert "FileExistsError" not in str(e.value)
    planted.unlink()
    done = train(validate_train_spec(doc), run, track=False)
    assert done.exit_code == 0 and done.step == 8
    assert (run / "eval" / "step-000000008" / "report.json").is_file()


@pytest.mark.parametrize("kind", ["file", "symlink"])
@pytest.mark.parametrize("name", ["checkpoints", "eval"])
def test_a_checkpoints_or_eval_path_that_is_no_folder_is_refused_before_training(
    tmp_path: Path, digits_dataset: Path, name: str, kind: str
) -> None:
    doc, run = _stopped_run(tmp_path, digits_dataset)
    kept = tmp_path / "kept"
    if (run / name).exists():
        (run / name).rename(kept)  # what the run had, moved aside
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if kind == "file":
        (run / name).write_text("x")
    else:
        (run / name).symlink_to(elsewhere)
    with pytest.raises(TrainingError, match=rf"{name} is .*Remove it, then rerun"):
        train(validate_train_spec(doc), run, track=False)
    assert list(elsewhere.iterdir()) == []  # nothing written through the link
    assert not (run / "final.safetensors").exists()
