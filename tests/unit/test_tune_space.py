"""The search space on Optuna: in-memory studies whose trials' train specs validate and hold
the sampled values, the grid, seeded reproducibility, and pruners whose rungs are epochs."""

from __future__ import annotations

import math
from typing import Any

import optuna
import pytest

from visionloop.core.errors import SpecError
from visionloop.tune.space import (
    AskTellGridSampler,
    apply,
    direction_of,
    grid_of,
    make_pruner,
    make_sampler,
    suggest,
)
from visionloop.tune.spec import TuneSpec, validate_tune_spec

optuna.logging.set_verbosity(optuna.logging.WARNING)

TRAIN: dict[str, Any] = {
    "data": {"dataset": "ds", "batch_size": 32, "image_size": 32},
    "model": {"arch": "small_cnn"},
    "epochs": 9,
}
SPACE: dict[str, Any] = {
    "optimizer.lr": {"loguniform": [1e-4, 1e-1]},
    "optimizer.weight_decay": {"uniform": [0.0, 0.1]},
    "optimizer.momentum": {"float": [0.8, 0.95], "step": 0.05},
    "data.batch_size": {"int": [16, 64], "step": 16},
    "model.arch": {"choice": ["small_cnn", "tiny_resnet"]},
    "model.kwargs.drop_rate": {"choice": [0.0, 0.2]},
}


def spec_of(**fields: Any) -> TuneSpec:
    doc: dict[str, Any] = {"name": "t", "train": dict(TRAIN), "space": dict(SPACE), "trials": 16}
    doc.update(fields)
    return validate_tune_spec(doc)


def study_of(spec: TuneSpec) -> optuna.Study:
    return optuna.create_study(
        storage=None, sampler=make_sampler(spec), pruner=make_pruner(spec), direction=direction_of(spec)
    )


def test_tpe_trials_apply_to_valid_train_specs_holding_the_sampled_values() -> None:
    spec = spec_of(space={k: v for k, v in SPACE.items() if k != "model.kwargs.drop_rate"})
    study = study_of(spec)
    assert isinstance(study.sampler, optuna.samplers.TPESampler)
    for _ in range(14):  # past TPE's 10 random start-up trials
        trial = study.ask()
        params = suggest(trial, spec.space)
        train = apply(spec.train_doc(), params)
        assert set(params) == set(spec.space)
        assert train.optimizer.lr == params["optimizer.lr"] and 1e-4 <= train.optimizer.lr <= 1e-1
        assert train.optimizer.weight_decay == params["optimizer.weight_decay"]
        assert train.optimizer.momentum == params["optimizer.momentum"]
        assert any(math.isclose(train.optimizer.momentum, m) for m in (0.8, 0.85, 0.9, 0.95))
        assert train.data.batch_size == params["data.batch_size"]
        assert train.data.batch_size in (16, 32, 48, 64)
        assert train.model.arch == params["model.arch"] in ("small_cnn", "tiny_resnet")
        # Everything the space does not name is the base spec's.
        assert (train.epochs, train.data.image_size, train.optimizer.name) == (9, 32, "adamw")
        study.tell(trial, -abs(math.log10(train.optimizer.lr) + 2))
    assert len(study.trials) == 14 and all(t.params for t in study.trials)


def test_free_form_kwargs_are_set_in_the_model_kwargs() -> None:
    spec = spec_of(
        train=dict(TRAIN, model={"arch": "small_cnn", "kwargs": {"drop_rate": 0.5}}),
        space={"model.kwargs.drop_rate": {"choice": [0.0, 0.2]}},
    )
    study = study_of(spec)
    trial = study.ask()
    params = suggest(trial, spec.space)
    train = apply(spec.train_doc(), params)
    assert train.model.kwargs == {"drop_rate": params["model.kwargs.drop_rate"]}
    assert params["model.kwargs.drop_rate"] in (0.0, 0.2)


def test_grid_sampler_visits_every_point_once_and_its_last_tell_does_not_raise() -> None:
    space = {
        "optimizer.lr": {"choice": [0.1, 0.01]},
        "optimizer.momentum": {"float": [0.8, 0.9], "step": 0.05},
        "data.batch_size": {"int": [16, 32], "step": 16},
    }
    spec = spec_of(space=space, sampler={"name": "grid"}, trials=12)
    assert grid_of(spec.space) == {
        "optimizer.lr": [0.1, 0.01],
        "optimizer.momentum": [0.8, 0.85, 0.9],  # exact decimals, not 0.8500000000000001
        "data.batch_size": [16, 32],
    }
    study = study_of(spec)
    seen = []
    for _ in range(spec.trials):
        trial = study.ask()
        params = suggest(trial, spec.space)
        train = apply(spec.train_doc(), params)
        assert (train.optimizer.lr, train.optimizer.momentum, train.data.batch_size) == tuple(params.values())
        seen.append(tuple(params.values()))
        study.tell(trial, 1.0)  # Optuna's own GridSampler raises RuntimeError on the last one
    assert len(set(seen)) == 12
    assert len(study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))) == 12


def test_optunas_grid_sampler_is_what_raises_without_the_ask_tell_variant() -> None:
    # Why AskTellGridSampler exists; if Optuna stops raising, the subclass can go.
    grid = {"optimizer.lr": [0.1, 0.01]}
    study = optuna.create_study(sampler=optuna.samplers.GridSampler(grid, seed=0))
    first = study.ask()
    first.suggest_categorical("optimizer.lr", [0.1, 0.01])
    study.tell(first, 1.0)
    last = study.ask()
    last.suggest_categorical("optimizer.lr", [0.1, 0.01])
    with pytest.raises(RuntimeError, match=r"Study\.stop"):
        study.tell(last, 1.0)
    assert issubclass(AskTellGridSampler, optuna.samplers.GridSampler)


def test_grid_of_refuses_a_continuous_dimension() -> None:
    spec = spec_of()
    with pytest.raises(SpecError, match=r"space\.optimizer\.lr is continuous"):
        grid_of(spec.space)


def _params_of(spec: TuneSpec, n: int) -> list[dict[str, Any]]:
    study = study_of(spec)
    out = []
    for _ in range(n):
        trial = study.ask()
        params = suggest(trial, spec.space)
        out.append(params)
        study.tell(trial, -abs(math.log10(params["optimizer.lr"]) + 2))
    return out


@pytest.mark.parametrize("sampler", ["tpe", "random", "cmaes"])
def test_a_seeded_sampler_reproduces_its_params(sampler: str) -> None:
    numeric = {k: v for k, v in SPACE.items() if "choice" not in v}
    one = _params_of(spec_of(space=numeric, sampler={"name": sampler, "seed": 7}), 12)
    two = _params_of(spec_of(space=numeric, sampler={"name": sampler, "seed": 7}), 12)
    other = _params_of(spec_of(space=numeric, sampler={"name": sampler, "seed": 8}), 12)
    assert one == two
    assert one != other
    assert all(1e-4 <= p["optimizer.lr"] <= 1e-1 for p in one)


def test_apply_names_the_params_that_make_an_invalid_spec() -> None:
    spec = spec_of()
    with pytest.raises(SpecError) as e:
        apply(spec.train_doc(), {"optimizer.lr": -1.0, "data.batch_size": 32})
    msg = str(e.value)
    assert "optimizer.lr = -1.0" in msg and "optimizer.lr: Input should be greater than 0" in msg
    with pytest.raises(SpecError, match="`lr` is a value in the train spec, not a section"):
        apply(spec.train_doc(), {"optimizer.lr.x": 1})


def _report(study: optuna.Study, values_by_epoch: dict[int, float]) -> optuna.Trial:
    """A trial that reported these values and asked the pruner after each, as a trainer does
    (successive halving records a trial's value at a rung only when it is asked)."""
    trial = study.ask()
    for epoch, value in values_by_epoch.items():
        trial.report(value, epoch)
        trial.should_prune()
    return trial


def test_asha_with_promotion_leaves_judging_to_the_tuner() -> None:
    # The tuner promotes paused trials itself (tune/asha.py): Optuna's pruner never stops one.
    pruner = make_pruner(spec_of(pruner={"name": "asha", "min_epochs": 2, "reduction_factor": 3}))
    assert isinstance(pruner, optuna.pruners.NopPruner)


def test_stop_only_asha_judges_trials_at_rungs_in_epochs() -> None:
    spec = spec_of(pruner={"name": "asha", "min_epochs": 2, "reduction_factor": 3, "promotion": False})
    pruner = make_pruner(spec)
    assert isinstance(pruner, optuna.pruners.SuccessiveHalvingPruner)
    study = optuna.create_study(direction="maximize", pruner=pruner)
    for good in (0.9, 0.8, 0.7):
        study.tell(_report(study, {1: good, 2: good}), good)
    # Epoch 1 is before the first rung (min_epochs 2): never stopped there, however bad.
    bad = _report(study, {1: 0.01})
    assert not bad.should_prune()
    bad.report(0.01, 2)
    assert bad.should_prune()
    best = _report(study, {1: 0.95, 2: 0.95})
    assert not best.should_prune()


def test_hyperband_and_median_pruners_take_epochs() -> None:
    hyperband = make_pruner(spec_of(pruner={"name": "hyperband", "min_epochs": 1, "reduction_factor": 3}))
    assert isinstance(hyperband, optuna.pruners.HyperbandPruner)
    median = make_pruner(spec_of(pruner={"name": "median", "min_epochs": 3}))
    assert isinstance(median, optuna.pruners.MedianPruner)
    study = optuna.create_study(direction="maximize", pruner=median)
    for good in (0.9, 0.8, 0.7, 0.6, 0.5):  # MedianPruner's 5 start-up trials
        study.tell(_report(study, dict.fromkeys(range(1, 5), good)), good)
    bad = _report(study, {1: 0.0, 2: 0.0})
    assert not bad.should_prune()  # before min_epochs
    bad.report(0.0, 3)
    assert bad.should_prune()
    assert isinstance(make_pruner(spec_of(pruner={"name": "none"})), optuna.pruners.NopPruner)


def test_direction_follows_the_objective() -> None:
    assert direction_of(spec_of()) == optuna.study.StudyDirection.MAXIMIZE
    loss = spec_of(objective={"metric": "val/loss"})
    assert direction_of(loss) == optuna.study.StudyDirection.MINIMIZE
