"""Recovery corner cases found in review: a crash right after a checkpoint, a refused second
trainer, a dataset without a validation split, checkpoints from another run, a mistyped
best metric."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _trainkit import spec_doc, write_spec
from visionloop.core.errors import CheckpointError, TrainingError
from visionloop.data.ingest import IngestOptions, ingest
from visionloop.specs import validate_train_spec
from visionloop.train.api import train
from visionloop.train.checkpoint import CheckpointManager
from visionloop.train.report import Reporter
from visionloop.train.rundir import RunDir
from visionloop.train.signals import StopRequest

# Train, and die (os._exit, no clean-up at all) the moment checkpoint 8 is durable.
CRASH_AFTER_8 = """
import os, sys
from pathlib import Path
import visionloop.train.checkpoint as ck
from visionloop.specs import load_train_spec
from visionloop.train.api import train
real = ck.write_checkpoint
def write_then_die(path, state, step, metric, before_commit=None):
    real(path, state, step, metric, before_commit)
    if step == 8:
        os._exit(9)
ck.write_checkpoint = write_then_die
spec, _ = load_train_spec(Path(sys.argv[1]))
train(spec, Path(sys.argv[2]))
"""


class StopAt(Reporter):
    def __init__(self, step: int, stop: StopRequest) -> None:
        self.at, self.stop_request = step, stop
        self.messages: list[str] = []

    def step(self, step: int, loss: float | None, lr: float, images_per_s: float | None) -> None:
        if step == self.at:
            self.stop_request.request("test")

    def message(self, text: str) -> None:
        self.messages.append(text)


def test_metrics_logged_before_a_checkpoint_survive_a_crash_right_after_it(
    tmp_path: Path, digits_dataset: Path
) -> None:
    from mlflow.tracking import MlflowClient

    from visionloop.core.settings import load_settings

    doc = spec_doc(digits_dataset, epochs=None, steps=12, data__workers=0, checkpoint__every_steps=4)
    spec = write_spec(tmp_path / "spec.yaml", doc)
    run_dir = tmp_path / "run"
    p = subprocess.run([sys.executable, "-c", CRASH_AFTER_8, str(spec), str(run_dir)], capture_output=True)
    assert p.returncode == 9, p.stderr.decode()[-2000:]
    result = train(validate_train_spec(doc), run_dir)
    assert result.exit_code == 0
    history = MlflowClient(load_settings().tracking_uri).get_metric_history(str(result.run_id), "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 13))


def test_a_trainer_refused_the_lock_leaves_the_live_runs_record_alone(
    tmp_path: Path, digits_dataset: Path
) -> None:
    doc = spec_doc(digits_dataset, epochs=None, steps=6, data__workers=0)
    stop = StopRequest()
    first = train(
        validate_train_spec(doc), tmp_path / "run", reporter=StopAt(2, stop), track=False, stop=stop
    )
    assert first.exit_code == 75
    owner = RunDir(tmp_path / "run")
    owner.lock()  # a live trainer holds the directory
    try:
        with pytest.raises(TrainingError, match="is in use by"):
            train(validate_train_spec(doc), tmp_path / "run", track=False)
        meta = json.loads((tmp_path / "run" / "run.json").read_text())
        assert meta["status"] == "preempted" and "error" not in meta
    finally:
        owner.unlock()


def test_without_a_validation_split_checkpoints_still_land_at_epoch_ends(
    tmp_path: Path, digits_dataset: Path
) -> None:
    images = tmp_path / "images"
    shutil.copytree(digits_dataset.parent / "digits-images", images)
    data = ingest(images, tmp_path / "ds", IngestOptions(val_fraction=0.0, workers=2)).out
    doc = spec_doc(
        data,
        epochs=2,
        data__workers=0,
        checkpoint={"every_steps": 1000, "every_minutes": None, "keep_last": 5, "keep_best": 0},
    )
    result = train(validate_train_spec(doc), tmp_path / "run", track=False)
    per_epoch = 1797 // 64
    assert [
        c.step for c in CheckpointManager(tmp_path / "run" / "checkpoints", keep_last=5, keep_best=0).infos()
    ] == [
        per_epoch,
        2 * per_epoch,
    ]
    assert result.final_metrics == {} and (tmp_path / "run" / "final.safetensors").is_file()


def test_checkpoints_copied_from_another_run_are_refused(tmp_path: Path, digits_dataset: Path) -> None:
    doc = spec_doc(digits_dataset, epochs=None, steps=4, data__workers=0)
    train(validate_train_spec(doc), tmp_path / "a", track=False)
    other = spec_doc(digits_dataset, epochs=None, steps=4, data__workers=0, optimizer__lr=0.5)
    # Into a folder that is no run (no run.json): refused before anything is written.
    shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / "fresh" / "checkpoints")
    with pytest.raises(TrainingError, match=r"no run\.json\) but holds checkpoints"):
        train(validate_train_spec(other), tmp_path / "fresh", track=False)
    assert sorted(p.name for p in (tmp_path / "fresh").iterdir()) == [".lock", "checkpoints"]
    # Into another (stopped) run's folder, over its own checkpoints: refused when read.
    stop = StopRequest()
    train(validate_train_spec(other), tmp_path / "b", reporter=StopAt(2, stop), track=False, stop=stop)
    shutil.rmtree(tmp_path / "b" / "checkpoints")
    shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints")
    with pytest.raises(CheckpointError, match="different spec"):
        train(validate_train_spec(other), tmp_path / "b", track=False)


def test_a_mistyped_best_metric_is_reported_once(tmp_path: Path, digits_dataset: Path) -> None:
    doc = spec_doc(digits_dataset, epochs=2, data__workers=0, checkpoint__best_metric="val/acuracy")
    rep = StopAt(-1, StopRequest())
    train(validate_train_spec(doc), tmp_path / "run", reporter=rep, track=False)
    warnings = [m for m in rep.messages if "is not measured" in m]
    assert len(warnings) == 1 and "val/accuracy" in warnings[0]
