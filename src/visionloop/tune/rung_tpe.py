"""TPE that learns from the trials paused at a rung, not only from the finished ones.

Optuna's TPE builds its model from COMPLETE and PRUNED trials; a PRUNED trial counts as good
or bad by its deepest reported step first, then its value there (a trial that got further is
better than one stopped earlier), which is how Optuna makes TPE and successive halving work
together. Under asynchronous successive halving with promotion (tune/asha.py) a trial is
neither: it pauses at a rung through a checkpoint and stays RUNNING in Optuna until it is
promoted and finishes, or is pruned at the end of the study. With a fixed trial budget that
is nearly every trial (η = 3: one in nine finishes), so plain TPE saw one or two
observations a study and sampled as randomly as the random sampler, its model blind to the
dozens of rung results the study had paid for.

`RungTPESampler` shows TPE the study with each RUNNING trial that has reported a value as a
PRUNED trial at its deepest step: the same evidence, read the same way, as if the trial had
been stopped there. A trial still short of its first rung stays RUNNING (nothing to learn;
with the constant liar it is the "bad" guess TPE makes of running trials). Nothing is
written: the view lives only for one sampling call, and the study's storage and the trials'
states are untouched.
"""

from __future__ import annotations

import copy
from collections.abc import Container
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState


class _RungView:
    """`study`, except that `_get_trials` (all TPE reads trials through) shows a RUNNING trial
    with reported values as PRUNED at its deepest step. Everything else is the study's own."""

    def __init__(self, study: optuna.Study) -> None:
        self._study = study

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)

    def _get_trials(
        self,
        deepcopy: bool = True,
        states: Container[TrialState] | None = None,
        use_cache: bool = False,
    ) -> list[FrozenTrial]:
        if states is None:
            return self._study._get_trials(deepcopy=deepcopy, states=None, use_cache=use_cache)
        wanted = tuple(s for s in TrialState if s in states)
        if TrialState.PRUNED not in wanted:
            return self._study._get_trials(deepcopy=deepcopy, states=wanted, use_cache=use_cache)
        fetch = wanted if TrialState.RUNNING in wanted else (*wanted, TrialState.RUNNING)
        out: list[FrozenTrial] = []
        for trial in self._study._get_trials(deepcopy=deepcopy, states=fetch, use_cache=use_cache):
            if trial.state == TrialState.RUNNING and trial.intermediate_values:
                shown = copy.copy(trial)  # the cached trial itself must keep its state
                shown.state = TrialState.PRUNED
                out.append(shown)
            elif trial.state in wanted:
                out.append(trial)
        return out


class RungTPESampler(optuna.samplers.TPESampler):
    """Optuna's TPESampler over `_RungView(study)`: see the module docstring."""

    def infer_relative_search_space(
        self, study: optuna.Study, trial: FrozenTrial
    ) -> dict[str, BaseDistribution]:
        return super().infer_relative_search_space(_RungView(study), trial)  # type: ignore[arg-type]

    def sample_relative(
        self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, BaseDistribution]
    ) -> dict[str, Any]:
        return super().sample_relative(_RungView(study), trial, search_space)  # type: ignore[arg-type]

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: BaseDistribution,
    ) -> Any:
        view = _RungView(study)
        return super().sample_independent(view, trial, param_name, param_distribution)  # type: ignore[arg-type]


__all__ = ["RungTPESampler"]
