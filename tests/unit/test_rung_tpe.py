"""TPE under asha's promotion: trials paused at a rung (RUNNING, with values reported) are
what it learns from, as Optuna's TPE learns from PRUNED trials; the study is left as it was."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from visionloop.tune.rung_tpe import RungTPESampler

optuna.logging.set_verbosity(optuna.logging.WARNING)

GOOD = 0.8  # where the objective peaks
RUNG = 3


def paused_study(sampler: optuna.samplers.BaseSampler, n: int = 24) -> optuna.Study:
    """`n` trials spread over x in [0, 1], each paused at the rung: reported there, never told."""
    study = optuna.create_study(direction="maximize", sampler=sampler)
    for k in range(n):
        study.enqueue_trial({"x": (k + 0.5) / n})
        trial = study.ask()
        x = trial.suggest_float("x", 0.0, 1.0)
        trial.report(1.0 - abs(x - GOOD), RUNG)
    return study


def next_points(study: optuna.Study, n: int) -> list[float]:
    """What the sampler proposes for `n` new trials (each asked and left without a value)."""
    return [study.ask().suggest_float("x", 0.0, 1.0) for _ in range(n)]


def near_good(xs: list[float]) -> int:
    return sum(abs(x - GOOD) <= 0.15 for x in xs)


def test_paused_trials_steer_the_search_toward_the_best_of_the_rung() -> None:
    rung_tpe = next_points(paused_study(RungTPESampler(seed=1)), 20)
    plain = next_points(paused_study(optuna.samplers.TPESampler(seed=1)), 20)
    # The paused trials say x near 0.8 is best: rung-aware TPE samples there; Optuna's TPE,
    # which sees no COMPLETE or PRUNED trial, is still sampling at random (0.3 of [0, 1]).
    assert near_good(rung_tpe) >= 15, rung_tpe
    assert near_good(plain) <= 10, plain


def test_deeper_rungs_count_as_better_than_shallower_ones() -> None:
    """A trial that went on to a later rung is ranked above every trial stopped earlier, as
    Optuna ranks PRUNED trials: two trials near x = 0.2 promoted to epoch 9 outweigh the
    better-looking rung-3 values near 0.8 (12 trials: TPE's "good" group is its best 2)."""
    study = paused_study(RungTPESampler(seed=3), n=12)
    nearest = sorted(study.get_trials(deepcopy=False), key=lambda t: abs(t.params["x"] - 0.2))[:2]
    for trial in nearest:
        optuna.trial.Trial(study, trial._trial_id).report(0.5, 9)
    xs = next_points(study, 20)
    assert sum(abs(x - 0.2) <= 0.15 for x in xs) >= 12, xs
    assert near_good(xs) <= 3, xs


def test_the_view_changes_nothing_stored() -> None:
    study = paused_study(RungTPESampler(seed=2), n=12)
    next_points(study, 3)
    states = [t.state for t in study.get_trials(deepcopy=False)]
    assert states == [TrialState.RUNNING] * 15
    assert all(len(t.intermediate_values) == 1 for t in study.get_trials(deepcopy=False)[:12])


def test_finished_trials_are_read_as_before() -> None:
    """COMPLETE and PRUNED trials are TPE's own business: a study with no paused trial samples
    exactly as Optuna's TPESampler does under the same seed."""

    def finished_study(sampler: optuna.samplers.BaseSampler) -> optuna.Study:
        study = optuna.create_study(direction="maximize", sampler=sampler)
        for k in range(16):
            study.enqueue_trial({"x": (k + 0.5) / 16})
            trial = study.ask()
            x = trial.suggest_float("x", 0.0, 1.0)
            if k % 2:
                trial.report(x, 1)
                study.tell(trial, state=TrialState.PRUNED)
            else:
                study.tell(trial, 1.0 - abs(x - GOOD))
        return study

    ours = next_points(finished_study(RungTPESampler(seed=5)), 5)
    optunas = next_points(finished_study(optuna.samplers.TPESampler(seed=5)), 5)
    assert ours == optunas
