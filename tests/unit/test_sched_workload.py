"""The training workload: the command it builds, and what each way an attempt ends means."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from _trainkit import spec_doc
from visionloop.sched.states import JobState
from visionloop.sched.workload import WORKLOAD, AttemptExit, CommandContext, Ending, TrainWorkload
from visionloop.specs import TrainSpec

RUNNING, PREEMPTING, CANCELLING = JobState.RUNNING, JobState.PREEMPTING, JobState.CANCELLING
REQUEUE = "requeued to resume"


def _workload(tmp_path: Path) -> TrainWorkload:
    return TrainWorkload(train=TrainSpec.model_validate(spec_doc(tmp_path / "ds")))


@pytest.mark.parametrize(
    ("ex", "expected"),
    [
        (AttemptExit(0, RUNNING), Ending("succeeded", JobState.SUCCEEDED, "finished (exit 0)")),
        (
            AttemptExit(75, PREEMPTING),
            Ending(
                "preempted", JobState.QUEUED, f"preempted: checkpointed and exited 75; {REQUEUE}", False, True
            ),
        ),
        (
            AttemptExit(137, PREEMPTING),
            Ending(
                "preempted",
                JobState.QUEUED,
                f"preempted: exit 137 after the grace period; {REQUEUE}",
                False,
                True,
            ),
        ),
        (
            AttemptExit(75, PREEMPTING, gpu_lost=True),
            Ending(
                "interrupted",
                JobState.QUEUED,
                f"interrupted: checkpointed and exited 75; {REQUEUE}",
                False,
                True,
            ),
        ),
        (AttemptExit(0, PREEMPTING), Ending("succeeded", JobState.SUCCEEDED, "finished (exit 0)")),
        (
            AttemptExit(75, RUNNING),
            Ending(
                "preempted",
                JobState.QUEUED,
                f"stopped after a checkpoint (exit 75, signalled outside visionloop); {REQUEUE}",
            ),
        ),
        (AttemptExit(1, RUNNING), Ending("failed", JobState.FAILED, "exit 1", retry=True)),
        (
            AttemptExit(126, RUNNING, "Ray could not start it: no env"),
            Ending("failed", JobState.FAILED, "exit 126 (Ray could not start it: no env)", retry=True),
        ),
        (AttemptExit(-1, RUNNING), Ending("failed", JobState.FAILED, "exit -1", retry=True)),
        (AttemptExit(75, CANCELLING), Ending("cancelled", JobState.CANCELLED, "cancelled (exit 75)")),
        (AttemptExit(137, CANCELLING), Ending("cancelled", JobState.CANCELLED, "cancelled (exit 137)")),
        (
            AttemptExit(0, CANCELLING),
            Ending("succeeded", JobState.SUCCEEDED, "finished before the cancel took effect"),
        ),
    ],
)
def test_each_way_a_training_attempt_ends_maps_to_its_ending(
    tmp_path: Path, ex: AttemptExit, expected: Ending
) -> None:
    assert _workload(tmp_path).ending(ex) == expected


def test_the_command_runs_the_trainer_on_a_spec_written_once_in_the_job_folder(tmp_path: Path) -> None:
    w = _workload(tmp_path)
    job_dir, run_dir = tmp_path / "jobs" / "job-3", tmp_path / "runs" / "job-3"
    cmd = w.command(CommandContext(job_dir, run_dir, gpus=1))
    spec = job_dir / "train.yaml"
    assert cmd == [sys.executable, "-m", "visionloop", "train", str(spec), "--run-dir", str(run_dir)]
    assert TrainSpec.model_validate(yaml.safe_load(spec.read_text())) == w.train
    # Every attempt runs the spec the first one ran, even if the file was edited meanwhile.
    spec.write_text("kept: as it is\n")
    cmd = w.command(CommandContext(job_dir, run_dir, gpus=2, python="/opt/py"))
    assert cmd[0] == "/opt/py" and cmd[-2:] == ["--nproc-per-node", "2"]
    assert spec.read_text() == "kept: as it is\n"


def test_a_workload_document_is_told_apart_by_its_kind(tmp_path: Path) -> None:
    w = _workload(tmp_path)
    doc = w.model_dump(mode="json")
    assert doc["kind"] == "train" and "SPEC_FILE" not in doc
    assert WORKLOAD.validate_python(doc) == w
    with pytest.raises(ValidationError, match="does not match any of the expected tags: 'train'"):
        WORKLOAD.validate_python({**doc, "kind": "tune"})
