"""A tune spec's search space, sampler and pruner as Optuna objects.

    study = optuna.create_study(direction=..., sampler=make_sampler(spec), pruner=make_pruner(spec))
    trial = study.ask()
    params = suggest(trial, spec.space)             # {"optimizer.lr": 0.0031, "model.arch": ...}
    train = apply(spec.train_doc(), params)         # the trial's validated TrainSpec

Optuna's parameter names are the dotted train-spec paths. A trial reports its objective with
`trial.report(value, step=epochs_completed)`, so the pruners' resources are epochs: asynchronous
successive halving judges a trial after min_epochs × reduction_factor^k epochs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from pydantic import ValidationError

from visionloop.core.errors import SpecError
from visionloop.spec_errors import format_validation_error
from visionloop.specs import TrainSpec
from visionloop.tune.dimensions import AnyDimension, Choice, FloatRange, IntRange, LogUniform, Uniform
from visionloop.tune.rung_tpe import RungTPESampler
from visionloop.tune.space_checks import with_params
from visionloop.tune.spec import TuneSpec


def suggest(trial: optuna.trial.BaseTrial, space: Mapping[str, AnyDimension]) -> dict[str, Any]:
    """Ask `trial` for a value of every dimension; return {dotted path: value}."""
    params: dict[str, Any] = {}
    for path, dim in space.items():
        if isinstance(dim, LogUniform):
            params[path] = trial.suggest_float(path, *dim.bounds, log=True)
        elif isinstance(dim, Uniform):
            params[path] = trial.suggest_float(path, *dim.bounds)
        elif isinstance(dim, IntRange):
            params[path] = trial.suggest_int(path, *dim.bounds, step=dim.step, log=dim.log)
        elif isinstance(dim, FloatRange):
            params[path] = trial.suggest_float(path, *dim.bounds, step=dim.step, log=dim.log)
        elif isinstance(dim, Choice):
            params[path] = trial.suggest_categorical(path, dim.values)
        else:  # pragma: no cover - the Dimension union is closed
            raise TypeError(f"unknown dimension {dim!r}")
    return params


def apply(train_doc: Mapping[str, Any], params: Mapping[str, Any]) -> TrainSpec:
    """The base train document with each dotted path set to its value, validated. The tune
    spec's checks make this succeed for every value its space can produce; a SpecError naming
    the parameters is for params that came from elsewhere (an edited study)."""
    doc = with_params(train_doc, params)
    try:
        return TrainSpec.model_validate(doc)
    except ValidationError as e:
        shown = ", ".join(f"{path} = {value!r}" for path, value in params.items())
        raise SpecError(format_validation_error(e, TrainSpec, f"the train spec with {shown}")) from e


def grid_of(space: Mapping[str, AnyDimension]) -> dict[str, list[Any]]:
    """The grid sampler's search space: every value of each dimension. SpecError for a
    continuous dimension (the tune spec refuses those with the grid sampler)."""
    grid: dict[str, list[Any]] = {}
    for path, dim in space.items():
        values = dim.grid()
        if values is None:
            raise SpecError(
                f"space.{path} is continuous, so it has no grid; give it a step or make it a choice."
            )
        grid[path] = values
    return grid


class AskTellGridSampler(optuna.samplers.GridSampler):
    """Optuna's grid sampler, minus its `study.stop()` when the grid is done: that call is
    only allowed inside `study.optimize`, and under ask-and-tell it makes the last `tell`
    raise RuntimeError (after storing the trial). The tuner stops at `trials`, which the spec
    keeps within the grid's size."""

    def after_trial(
        self,
        study: optuna.Study,
        trial: optuna.trial.FrozenTrial,
        state: optuna.trial.TrialState,
        values: Sequence[float] | None,
    ) -> None:
        return None


def make_sampler(spec: TuneSpec, asked: int = 0) -> optuna.samplers.BaseSampler:
    """The spec's sampler, seeded with `sampler.seed`, moved on by `asked`: the trials the
    study already has. A tuner restarted mid-study with the same seed would otherwise draw
    the same random points again (a seeded sampler's stream starts over in each process),
    and its random and TPE start-up trials would repeat the first ones."""
    # Modulo numpy's seed range: a seed near its top, moved on by the trials asked, must not
    # make a restarted study fail.
    seed = None if spec.sampler.seed is None else (spec.sampler.seed + 7919 * asked) % 2**32
    name = spec.sampler.name
    if name == "tpe":
        # With trials running side by side, the constant liar makes TPE treat the running ones
        # as bad results, so that it does not propose the same point to every free worker.
        # RungTPESampler: TPE that learns from the trials paused at a rung (most of them, under
        # asha's promotion), not only from the finished ones (tune/rung_tpe.py).
        return RungTPESampler(seed=seed, constant_liar=spec.concurrency > 1)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        return AskTellGridSampler(grid_of(spec.space), seed=seed)
    if name == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed)
    raise AssertionError(f"unhandled sampler {name!r}")


def make_pruner(spec: TuneSpec) -> optuna.pruners.BasePruner:
    """The spec's pruner, its resources in epochs (a trial reports at step = epochs completed)."""
    p = spec.pruner
    if p.promotes:
        # The tuner promotes paused trials itself (tune/asha.py); Optuna's pruner only stops.
        return optuna.pruners.NopPruner()
    if p.name == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=p.min_epochs, reduction_factor=p.reduction_factor, min_early_stopping_rate=0
        )
    if p.name == "hyperband":
        max_epochs = spec.max_epochs()
        assert max_epochs is not None  # the spec refuses a pruner without epochs
        return optuna.pruners.HyperbandPruner(
            min_resource=p.min_epochs, max_resource=max_epochs, reduction_factor=p.reduction_factor
        )
    if p.name == "median":
        # The earliest a trial can be stopped is at step == n_warmup_steps: after min_epochs.
        return optuna.pruners.MedianPruner(n_warmup_steps=p.min_epochs)
    if p.name == "none":
        return optuna.pruners.NopPruner()
    raise AssertionError(f"unhandled pruner {p.name!r}")


def direction_of(spec: TuneSpec) -> optuna.study.StudyDirection:
    """The study's direction, from the objective's."""
    if spec.objective.direction == "max":
        return optuna.study.StudyDirection.MAXIMIZE
    return optuna.study.StudyDirection.MINIMIZE
