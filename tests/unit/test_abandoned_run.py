"""`close_abandoned_run` touches only runs that are really abandoned: never one whose trainer
still holds the run directory's lock, nor one the trainer ended itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from visionloop.core.settings import Settings
from visionloop.train.abandoned import close_abandoned_run
from visionloop.train.rundir import RunDir

HOLD_LOCK = """
import sys, time
from pathlib import Path
from visionloop.train.rundir import RunDir
rd = RunDir(Path(sys.argv[1])); rd.lock(); print("locked", flush=True); time.sleep(60)
"""


def _settings(tmp_path: Path) -> Settings:
    # Never opened: these runs have no MLflow run id, so only run.json is read and written.
    return Settings(home=tmp_path, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")


def _run_dir(tmp_path: Path, status: str) -> RunDir:
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    rd.write_meta({"status": status})  # no MLflow run: only run.json is at stake
    return rd


@pytest.mark.parametrize("status", ["running", "preempted"])
def test_a_dead_or_stopped_run_is_marked_and_its_lock_released(tmp_path: Path, status: str) -> None:
    rd = _run_dir(tmp_path, status)
    assert close_abandoned_run(rd.path, _settings(tmp_path), "failed", "job 7 failed: exit 137") is None
    meta = rd.read_meta() or {}
    assert meta["status"] == "failed" and meta["error"] == "job 7 failed: exit 137"
    rd.lock()  # released again: a new trainer can take the run
    rd.unlock()


def test_a_live_trainer_or_a_run_ended_by_its_trainer_is_left_alone(tmp_path: Path) -> None:
    rd = _run_dir(tmp_path, "running")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(rd.path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        close_abandoned_run(rd.path, _settings(tmp_path), "failed", "x")
        assert (rd.read_meta() or {})["status"] == "running"
    finally:
        holder.kill()
        holder.wait()
    rd.write_meta({"status": "succeeded"})
    close_abandoned_run(rd.path, _settings(tmp_path), "cancelled", "x")
    assert json.loads(rd.meta_file.read_text()) == {"status": "succeeded"}
    assert close_abandoned_run(tmp_path / "never-started", _settings(tmp_path), "failed", "x") is None
    assert not (tmp_path / "never-started").exists()
