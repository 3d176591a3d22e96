"""The promotion rule of asynchronous successive halving (tune/asha.py), on real Optuna
trials: the best 1/η of the trials that reached a rung may go on, the highest rung first,
and a trial is never judged against trials that have not reached its rung."""

from __future__ import annotations

from optuna.distributions import FloatDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial

from visionloop.tune.asha import promotable

RUNGS = [1, 3]  # min_epochs 1, η 3, 9 epochs


def trial(number: int, values: dict[int, float], state: TrialState = TrialState.RUNNING) -> FrozenTrial:
    t = create_trial(
        state=state,
        value=None if state != TrialState.COMPLETE else values[max(values)],
        params={"lr": 0.1},
        distributions={"lr": FloatDistribution(1e-4, 1.0)},
        intermediate_values=values,
    )
    t.number = number
    return t


def test_nobody_goes_on_until_a_rung_has_eta_trials() -> None:
    trials = [trial(0, {1: 0.9}), trial(1, {1: 0.5})]
    assert promotable(trials, {0: 1, 1: 1}, RUNGS, 3, maximize=True) is None
    trials.append(trial(2, {1: 0.7}))
    found = promotable(trials, {0: 1, 1: 1, 2: 1}, RUNGS, 3, maximize=True)
    assert found is not None
    assert (found.number, found.rung, found.rank, found.reached) == (0, 1, 0, 3)


def test_only_the_top_fraction_goes_on_and_direction_matters() -> None:
    values = [0.2, 0.9, 0.4, 0.8, 0.1, 0.3]  # 6 trials at rung 1: the best 2 may go on
    trials = [trial(i, {1: v}) for i, v in enumerate(values)]
    paused = dict.fromkeys(range(6), 1)
    first = promotable(trials, paused, RUNGS, 3, maximize=True)
    assert first is not None and first.number == 1
    del paused[1]  # promoted: it is no longer paused at rung 1
    second = promotable(trials, paused, RUNGS, 3, maximize=True)
    assert second is not None and second.number == 3
    del paused[3]
    assert promotable(trials, paused, RUNGS, 3, maximize=True) is None  # 0.4 is third of six
    # Minimising a loss, the smallest values go on.
    low = promotable(trials, dict.fromkeys(range(6), 1), RUNGS, 3, maximize=False)
    assert low is not None and low.number == 4


def test_the_highest_rung_is_served_first_and_finished_trials_count() -> None:
    trials = [
        trial(0, {1: 0.9, 3: 0.95}),  # paused at rung 3
        trial(1, {1: 0.8, 3: 0.7}, TrialState.PRUNED),
        trial(2, {1: 0.7, 3: 0.6}, TrialState.FAIL),
        trial(3, {1: 0.85}),  # paused at rung 1, promotable there too
        trial(4, {1: 0.1}),
        trial(5, {1: 0.2}),
    ]
    found = promotable(trials, {0: 3, 3: 1, 4: 1, 5: 1}, RUNGS, 3, maximize=True)
    assert found is not None and (found.number, found.rung) == (0, 3)
    found = promotable(trials, {3: 1, 4: 1, 5: 1}, RUNGS, 3, maximize=True)
    # Rung 1: six reached it, the best two are 0 (gone on) and 3.
    assert found is not None and (found.number, found.rung) == (3, 1)


def test_a_late_trial_is_promoted_once_enough_have_done_worse() -> None:
    # Trial 0 is judged against trials that came later: with one rival it waits; with three
    # that did worse it goes on (a stop-only pruner would have stopped it at once).
    trials = [trial(0, {1: 0.5}), trial(1, {1: 0.6})]
    assert promotable(trials, {0: 1}, RUNGS, 3, maximize=True) is None
    trials += [trial(2, {1: 0.1}), trial(3, {1: 0.2}), trial(4, {1: 0.3}), trial(5, {1: 0.4})]
    found = promotable(trials, {0: 1}, RUNGS, 3, maximize=True)
    assert found is not None and found.number == 0 and found.rank == 1


def test_ties_break_by_trial_number_and_non_finite_values_never_go_on() -> None:
    trials = [trial(0, {1: float("nan")}), trial(1, {1: 0.5}), trial(2, {1: 0.5}), trial(3, {1: 0.1})]
    found = promotable(trials, {0: 1, 1: 1, 2: 1, 3: 1}, RUNGS, 3, maximize=True)
    assert found is not None and found.number == 1 and found.reached == 3
