"""Tune spec validation: defaults from the task, the train spec inline or by path, and a clear
error (field, value, example) for every space, sampler, pruner or job that cannot work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from visionloop.core.errors import SpecError
from visionloop.specs import JobSpec, TrainSpec
from visionloop.tune.dimensions import Choice, FloatRange, IntRange, LogUniform
from visionloop.tune.space_checks import rung_epochs
from visionloop.tune.spec import load_tune_spec, validate_tune_spec

TRAIN: dict[str, Any] = {
    "data": {"dataset": "ds", "batch_size": 32, "image_size": 32},
    "model": {"arch": "small_cnn"},
    "epochs": 9,
}
DET_TRAIN: dict[str, Any] = {
    "task": "detection",
    "data": {"dataset": "ds", "batch_size": 4, "image_size": 64},
    "model": {"arch": "native_detector"},
    "epochs": 9,
}
LR = {"optimizer.lr": {"loguniform": [1e-4, 1e-1]}}


def tune(**fields: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"name": "digits-lr", "train": dict(TRAIN), "space": dict(LR), "trials": 8}
    doc.update(fields)
    return doc


def error_of(doc: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as e:
        validate_tune_spec(doc, "tune.yaml")
    return str(e.value)


# --------------------------------------------------------------------------- valid specs


def test_inline_spec_gets_the_defaults_and_the_tasks_objective(tmp_path: Path) -> None:
    spec = validate_tune_spec(tune(), "tune.yaml", tmp_path)
    assert (spec.objective.metric, spec.objective.direction) == ("val/accuracy", "max")
    assert (spec.sampler.name, spec.sampler.seed) == ("tpe", 0)
    assert (spec.pruner.name, spec.pruner.min_epochs, spec.pruner.reduction_factor) == ("asha", 1, 3)
    assert spec.max_epochs() == 9 and spec.concurrency == 1 and spec.budget is None
    assert isinstance(spec.space["optimizer.lr"], LogUniform)
    assert spec.space["optimizer.lr"].bounds == (1e-4, 1e-1)
    # An inline train spec's relative paths are relative to the tune spec's folder.
    assert spec.train.data.dataset == (tmp_path / "ds").resolve()


def test_detection_objective_defaults_to_map() -> None:
    spec = validate_tune_spec(tune(train=dict(DET_TRAIN)))
    assert (spec.objective.metric, spec.objective.direction) == ("val/mAP", "max")
    assert spec.train.task == "detection"


def test_objective_direction_follows_a_known_metric_and_is_required_otherwise() -> None:
    spec = validate_tune_spec(tune(objective={"metric": "val/loss"}))
    assert (spec.objective.metric, spec.objective.direction) == ("val/loss", "min")
    spec = validate_tune_spec(tune(objective={"metric": "val/top5", "direction": "max"}))
    assert (spec.objective.metric, spec.objective.direction) == ("val/top5", "max")
    msg = error_of(tune(objective={"metric": "val/top5"}))
    assert "objective.direction" in msg and "missing" in msg and "Example: direction: max" in msg
    msg = error_of(tune(objective={"metric": "accuracy", "direction": "max"}))
    assert "objective.metric" in msg and "'accuracy'" in msg and "val/accuracy" in msg


def test_train_spec_by_path_is_read_relative_to_the_tune_spec(tmp_path: Path) -> None:
    (tmp_path / "train").mkdir()
    (tmp_path / "tune").mkdir()
    (tmp_path / "train" / "digits.yaml").write_text(
        "data: {dataset: ../data/digits, batch_size: 32, image_size: 32}\n"
        "model: {arch: small_cnn}\nepochs: 9\n",
        encoding="utf-8",
    )
    text = (
        "name: digits-lr\ntrain: ../train/digits.yaml\n"
        "space:\n  optimizer.lr: {loguniform: [1.0e-4, 1.0e-1]}\n"
        "  model.arch: {choice: [small_cnn, resnet18]}\n"
        "  data.batch_size: {int: [16, 64], step: 16}\n"
        "trials: 12\nconcurrency: 3\nbudget: {gpu_hours: 2.5}\n"
        "job: {team: vision, priority: high, spot: preferred}\n"
    )
    path = tmp_path / "tune" / "t.yaml"
    path.write_text(text, encoding="utf-8")
    spec, got_text = load_tune_spec(path)
    assert got_text == text
    # The train spec's own relative paths are relative to the train spec's file.
    assert spec.train.data.dataset == (tmp_path / "data" / "digits").resolve()
    assert spec.space["model.arch"] == Choice.model_validate({"choice": ["small_cnn", "resnet18"]})
    assert isinstance(spec.space["data.batch_size"], IntRange) and spec.space["data.batch_size"].step == 16
    assert spec.budget is not None and spec.budget.gpu_hours == 2.5 and spec.budget.usd is None
    job = spec.trial_job(spec.train, "digits-lr-3")
    assert isinstance(job, JobSpec)
    assert (job.team, job.priority, job.spot, job.name) == ("vision", "high", "preferred", "digits-lr-3")
    assert job.max_restarts == JobSpec.model_fields["max_restarts"].default


def test_a_missing_train_file_or_an_invalid_train_spec_names_it(tmp_path: Path) -> None:
    msg = error_of(tune(train="nowhere.yaml"))
    assert "train" in msg and "nowhere.yaml does not exist" in msg
    bad = dict(TRAIN, data={"dataset": "ds", "batch_size": -1})
    msg = error_of(tune(train=bad))
    assert "the train spec in tune.yaml" in msg and "data.batch_size" in msg and "got -1" in msg


def test_kwargs_and_stepped_floats_are_searchable() -> None:
    spec = validate_tune_spec(
        tune(
            train=dict(TRAIN, model={"arch": "resnet18"}),
            space={"model.kwargs.zero_init_residual": {"choice": [True, False]}, **LR},
        )
    )
    assert spec.space["model.kwargs.zero_init_residual"] == Choice.model_validate({"choice": [True, False]})
    spec = validate_tune_spec(tune(space={"optimizer.weight_decay": {"float": [0.0, 0.3], "step": 0.1}}))
    dim = spec.space["optimizer.weight_decay"]
    assert isinstance(dim, FloatRange) and dim.grid() == [0.0, 0.1, 0.2, 0.3]


# --------------------------------------------------------------------------- the space


def test_unknown_path_names_the_field_and_suggests_the_closest() -> None:
    msg = error_of(tune(space={"optimizer.lrr": {"loguniform": [1e-4, 1e-1]}}))
    assert "space.optimizer.lrr" in msg and "optimizer has no field `lrr`" in msg
    assert "Did you mean `lr`?" in msg
    msg = error_of(tune(space={"optimizer": {"choice": [1, 2]}}))
    assert "space.optimizer" in msg and "is a section" in msg and "optimizer.name" in msg
    msg = error_of(tune(space={"optimizer.lr.x": {"choice": [1, 2]}}))
    assert "`optimizer.lr` is a value, not a section" in msg


def test_bounds_that_cannot_be_sampled_are_refused() -> None:
    msg = error_of(tune(space={"optimizer.lr": {"loguniform": [0, 1]}}))
    assert "space.optimizer.lr.loguniform" in msg and "0 < low < high" in msg and "got [0, 1]" in msg
    assert "Example: optimizer.lr: {loguniform: [1.0e-4, 0.1]}" in msg
    msg = error_of(tune(space={"optimizer.weight_decay": {"uniform": [0.3, 0.1]}}))
    assert "space.optimizer.weight_decay.uniform" in msg and "low < high" in msg
    msg = error_of(tune(space={"data.batch_size": {"int": [16, 100], "step": 16}}))
    assert "space.data.batch_size" in msg and "never reach 100" in msg and "make high 96 or 112" in msg


def test_bounds_outside_the_fields_limits_are_refused_up_front() -> None:
    # Optuna could sample 1.0, the train spec allows momentum < 1 only.
    msg = error_of(tune(space={"optimizer.momentum": {"uniform": [0.5, 1.0]}}))
    assert "space.optimizer.momentum: with optimizer.momentum = 1.0 the train spec is invalid" in msg
    assert "less than 1" in msg
    msg = error_of(tune(space={"optimizer.name": {"choice": ["sgd", "lion"]}}))
    assert "optimizer.name = lion" in msg and "'sgd', 'adamw' or 'adam'" in msg
    # Fields that constrain each other: every corner combination is validated.
    msg = error_of(
        tune(
            space={
                "schedule.warmup_steps": {"int": [0, 100], "step": 50},
                "schedule.warmup_epochs": {"float": [0.0, 1.0], "step": 0.5},
            }
        )
    )
    assert "schedule.warmup_steps = 100, schedule.warmup_epochs = 1.0" in msg and "not both" in msg


def test_distribution_must_match_the_field_type() -> None:
    msg = error_of(tune(space={"data.batch_size": {"uniform": [8, 64]}}))
    assert "space.data.batch_size: is an integer field, so uniform cannot sample it" in msg
    assert "{int: [lo, hi], step: k}" in msg and "Example value: data.batch_size: 64" in msg
    msg = error_of(tune(space={"model.channels_last": {"int": [0, 1]}}))
    assert "true/false field" in msg and "{choice: [...]}" in msg
    msg = error_of(tune(space={"optimizer.lr": {"foo": [1, 2]}}))
    assert "space.optimizer.lr: needs exactly one distribution" in msg and "got {'foo': [1, 2]}" in msg
    msg = error_of(tune(space={"optimizer.lr": {"choice": [[0.1, 0.2]]}}))
    assert "space.optimizer.lr.choice" in msg and "null, true/false, numbers or strings" in msg
    msg = error_of(tune(space={"task": {"choice": ["detection"]}}))
    assert "space.task: cannot be searched" in msg


def test_unknown_arch_in_a_choice_names_the_known_ones() -> None:
    msg = error_of(tune(space={"model.arch": {"choice": ["small_cnn", "resnet9000"]}}))
    assert "space.model.arch: with model.arch = resnet9000 the model cannot be built" in msg
    assert "unknown model 'resnet9000'" in msg and "resnet50" in msg and "visionloop archs" in msg
    assert "small_cnn the model" not in msg
    msg = error_of(tune(train=dict(DET_TRAIN), space={"model.arch": {"choice": ["native_detector", "yolo"]}}))
    assert "model.arch = yolo" in msg and "Known detection archs:" in msg and "native_detector" in msg
    # A kwarg the architecture does not take, caught the same way.
    msg = error_of(tune(space={"model.kwargs.width": {"choice": [8, 16]}}))
    assert "space.model.kwargs.width" in msg and "unexpected keyword argument 'width'" in msg


def test_extra_keys_are_refused_everywhere() -> None:
    msg = error_of(tune(trails=8))
    assert "trails: unknown field" in msg and "Did you mean `trials`?" in msg
    msg = error_of(tune(space={"optimizer.lr": {"loguniform": [1e-4, 1e-1], "stepp": 2}}))
    assert "space.optimizer.lr.stepp: unknown field" in msg and "loguniform" in msg
    msg = error_of(tune(sampler={"name": "tpe", "sede": 1}))
    assert "sampler.sede: unknown field" in msg and "Did you mean `seed`?" in msg


# --------------------------------------------------------------------------- sampler, pruner, job


def test_unknown_sampler_and_grid_over_a_continuous_range() -> None:
    msg = error_of(tune(sampler={"name": "bayes"}))
    assert "sampler.name" in msg and "'bayes'" in msg and "'tpe', 'random', 'grid' or 'cmaes'" in msg
    msg = error_of(tune(sampler={"name": "grid"}))
    assert "grid sampler needs every dimension to be a choice or a stepped range" in msg
    assert "optimizer.lr is continuous" in msg
    grid = {"optimizer.lr": {"choice": [0.1, 0.01]}, "data.batch_size": {"int": [16, 32], "step": 16}}
    assert validate_tune_spec(tune(space=grid, sampler={"name": "grid"}, trials=4)).trials == 4
    msg = error_of(tune(space=grid, sampler={"name": "grid"}, trials=5))
    assert "trials: 5, but the grid has only 4 points" in msg


def test_cmaes_refuses_choices() -> None:
    space = {"model.arch": {"choice": ["small_cnn", "resnet18"]}, **LR}
    msg = error_of(tune(space=space, sampler={"name": "cmaes"}))
    assert "CMA-ES searches numeric ranges only; model.arch is a choice" in msg
    assert validate_tune_spec(tune(sampler={"name": "cmaes"})).sampler.name == "cmaes"


def test_concurrency_and_trials() -> None:
    msg = error_of(tune(concurrency=9))
    assert "concurrency: 9 trials at once, but only 8 in all" in msg
    msg = error_of(tune(trials=0))
    assert "trials" in msg and "got 0" in msg and "Example: trials: 40" in msg


def test_pruner_rungs_need_epochs_and_evaluations() -> None:
    every3 = dict(TRAIN, eval={"every_epochs": 3})
    msg = error_of(tune(train=every3, pruner={"min_epochs": 2}))
    assert "judged after 2 epochs, but the train spec evaluates every 3 epochs" in msg
    # Rungs at 3 and 9 (< 27) are multiples of 3: fine.
    spec = validate_tune_spec(tune(train=dict(every3, epochs=27), pruner={"min_epochs": 3}))
    assert rung_epochs(3, 3, spec.max_epochs() or 0) == [3, 9]
    by_steps = {k: v for k, v in TRAIN.items() if k != "epochs"} | {"steps": 500}
    msg = error_of(tune(train=by_steps))
    assert "judges trials by epochs" in msg and "runs 500 steps" in msg
    assert validate_tune_spec(tune(train=by_steps, pruner={"name": "none"})).pruner.name == "none"
    msg = error_of(tune(pruner={"min_epochs": 9}))
    assert "pruner.min_epochs: 9" in msg and "none would ever be stopped early" in msg
    msg = error_of(tune(pruner={"name": "hyperband", "max_epochs": 20}))
    assert "pruner.max_epochs: 20 is more than the 9 epochs" in msg
    msg = error_of(tune(space={"epochs": {"int": [3, 9]}}))
    assert "space.epochs: cannot be searched while the asha pruner" in msg


def test_job_fields_are_the_queues() -> None:
    spec = validate_tune_spec(tune())
    job = spec.trial_job(spec.train, "t-0")
    defaults = JobSpec(train=TrainSpec.model_validate(TRAIN))
    assert (job.priority, job.spot, job.team, job.resources) == (
        defaults.priority,
        defaults.spot,
        defaults.team,
        defaults.resources,
    )
    msg = error_of(tune(job={"spot": "sometimes"}))
    assert "job.spot" in msg and "'sometimes'" in msg and "Example: spot: allowed" in msg
    msg = error_of(tune(job={"team": "a b"}))
    assert "job.team" in msg and "letters, digits" in msg and "got 'a b'" in msg
    msg = error_of(tune(job={"train": {}}))
    assert "job.train: unknown field" in msg


def test_name_and_budget() -> None:
    msg = error_of(tune(name="my study"))
    assert "name" in msg and "'my study'" in msg and "Example: name: digits-lr" in msg
    msg = error_of(tune(budget={}))
    assert "budget" in msg and "give gpu_hours, usd or both" in msg


def test_the_example_tune_spec_validates() -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "tune" / "digits-lr.yaml"
    spec, text = load_tune_spec(path)
    assert text == path.read_text(encoding="utf-8")
    lr = spec.space["optimizer.lr"]
    assert isinstance(lr, LogUniform) and lr.bounds == (1e-4, 1e-1)  # four decades
    assert set(spec.space) == {"optimizer.lr", "optimizer.weight_decay", "model.arch"}
    assert (spec.objective.metric, spec.objective.direction) == ("val/accuracy", "max")
    assert rung_epochs(spec.pruner.min_epochs, spec.pruner.reduction_factor, spec.max_epochs() or 0) == [1, 3]
