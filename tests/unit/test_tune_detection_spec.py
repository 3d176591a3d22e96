"""The example tune spec over a detection train spec (examples/tune/detection.yaml): it
validates, its objective defaults to the detection task's primary metric (val/mAP, max),
asha pauses trials at its rungs and promotes them, and every trial the space can make is a
valid queue job with a detector that builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from visionloop.core.errors import SpecError
from visionloop.specs import TrialFields
from visionloop.tasks import get_task
from visionloop.tune.dimensions import Choice, LogUniform
from visionloop.tune.space_checks import with_params
from visionloop.tune.spec import load_tune_spec, validate_tune_spec

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tune" / "detection.yaml"


def test_the_detection_example_validates_with_the_tasks_objective() -> None:
    spec, text = load_tune_spec(EXAMPLE)
    assert text == EXAMPLE.read_text(encoding="utf-8")  # saved verbatim with the study
    assert spec.train.task == "detection" and spec.train.model.arch == "native_detector"
    # No objective in the file: the detection task's primary metric and its direction.
    task = get_task("detection")
    assert (task.primary_metric, task.primary_mode) == ("mAP", "max")
    assert (spec.objective.metric, spec.objective.direction) == ("val/mAP", "max")
    # asha with promotion: trials pause after 1 and 3 of 9 epochs, the best third go on.
    assert (spec.pruner.name, spec.pruner.promotes, spec.pruner.reduction_factor) == ("asha", True, 3)
    assert spec.train.epochs == 9 and spec.rungs() == [1, 3]
    assert (spec.next_rung(None), spec.next_rung(1), spec.next_rung(3)) == (1, 3, None)
    assert spec.train.eval.every_epochs == 1
    lr, wd, neck = (spec.space[k] for k in ("optimizer.lr", "optimizer.weight_decay", "model.kwargs.neck"))
    assert isinstance(lr, LogUniform) and lr.bounds == (1e-4, 1e-1)  # decades, on a log scale
    assert isinstance(wd, LogUniform) and wd.bounds == (1e-6, 1e-2)
    assert isinstance(neck, Choice) and neck.values == [32, 48, 64]
    assert (spec.trials, spec.concurrency, spec.budget) == (18, 2, None)


def test_every_corner_of_the_space_is_a_valid_detection_trial_job() -> None:
    spec, _ = load_tune_spec(EXAMPLE)
    base = spec.train_doc()
    for lr in (1e-4, 1e-1):
        for neck in (32, 48, 64):
            doc = with_params(base, {"optimizer.lr": lr, "model.kwargs.neck": neck})
            job = spec.trial_job(
                spec.train.model_validate(doc), "digit-detector-t0", TrialFields(study=spec.name, number=0)
            )
            assert job.train.task == "detection"
            assert (job.train.optimizer.lr, job.train.model.kwargs["neck"]) == (lr, neck)
            assert (job.team, job.resources.gpus) == ("vision", 0)


def test_a_detector_kwarg_the_native_detector_lacks_is_refused_at_validation() -> None:
    # The space is built on the meta device through the detection task's build_model, so a
    # kwarg the detector does not take fails before any trial is submitted.
    spec, _ = load_tune_spec(EXAMPLE)
    doc = {
        "name": "digit-detector",
        "train": spec.train_doc(),
        "space": {"model.kwargs.depth": {"choice": [2, 3]}},
        "trials": 4,
    }
    with pytest.raises(SpecError) as e:
        validate_tune_spec(doc, "tune.yaml")
    msg = str(e.value)
    assert "space.model.kwargs.depth" in msg and "cannot be built" in msg, msg
