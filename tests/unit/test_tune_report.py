"""`visionloop.tune.report` on a real Optuna study in a temporary SQLite control-plane database,
its trials made with ask/tell (no training): rows, rungs, the best trial, importances, plots;
`visionloop.tune.tracking.nest`; and the train spec's tracking fields that nesting uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest

from visionloop.core.errors import NotFoundError, SpecError
from visionloop.core.settings import load_settings
from visionloop.specs import TrainSpec, validate_train_spec
from visionloop.tune.report import best_trial, study_report, write_plots
from visionloop.tune.space import apply, suggest
from visionloop.tune.spec import TuneSpec, validate_tune_spec
from visionloop.tune.study import create_or_load, load
from visionloop.tune.tracking import nest
from visionloop.tune.tuner import END_ATTR, JOB_ATTR

TRAIN: dict[str, Any] = {
    "data": {"dataset": "/ds", "batch_size": 32, "image_size": 16},
    "model": {"arch": "small_cnn"},
    "epochs": 4,
    "tracking": {"experiment": "tune-tests", "tags": {"team": "vision"}},
}
PARENT = "0123456789abcdef0123456789abcdef"


def tune_spec(**fields: Any) -> TuneSpec:
    doc: dict[str, Any] = {
        "name": "lr-study",
        "train": TRAIN,
        "space": {
            "optimizer.lr": {"loguniform": [1e-4, 1e-1]},
            "model.kwargs.drop_rate": {"uniform": [0, 0.5]},
        },
        "sampler": {"name": "random", "seed": 0},
        "pruner": {"name": "asha", "min_epochs": 1, "reduction_factor": 2},
        "trials": 4,
    }
    doc.update(fields)
    return validate_tune_spec(doc, "tune.yaml", Path("/"))


def run_trial(
    study: optuna.Study, spec: TuneSpec, curve: list[float], *, job: int, end: str = "complete"
) -> int:
    """Ask a trial, report `curve` (one value per epoch) and tell it the way the tuner does:
    COMPLETE with the last value, PRUNED, or left running."""
    trial = study.ask()
    suggest(trial, spec.space)
    trial.set_user_attr(JOB_ATTR, job)
    for epoch, value in enumerate(curve, start=1):
        trial.report(value, epoch)
    if end == "complete":
        study.tell(trial, curve[-1])
    elif end == "pruned":
        trial.set_user_attr(END_ATTR, f"pruned at epoch {len(curve)}")
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
    return trial.number


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'state.db'}"


def test_the_report_has_every_trial_its_rungs_the_best_and_importances(url: str, tmp_path: Path) -> None:
    spec = tune_spec()
    study = create_or_load(spec, url)
    run_trial(study, spec, [0.5, 0.6, 0.7, 0.8], job=11)
    run_trial(study, spec, [0.6, 0.75, 0.85, 0.9], job=12)
    pruned = run_trial(study, spec, [0.1], job=13, end="pruned")
    running = study.ask()
    suggest(running, spec.space)

    report = study_report(study, None, no_jobs_reason="the control plane is not reachable")
    assert [t.number for t in report.trials] == [0, 1, 2, 3]
    assert [t.state for t in report.trials] == ["complete", "complete", "pruned", "running"]
    first, _second, third, fourth = report.trials
    assert first.intermediate == {1: 0.5, 2: 0.6, 3: 0.7, 4: 0.8} and first.value == 0.8
    # Successive halving from 1 epoch, factor 2, 4 epochs: rungs at epochs 1, 2 and 4.
    assert first.rungs == {1: 0.5, 2: 0.6}  # the last epoch is the end, not a rung
    assert third.number == pruned and third.value is None and third.end == "pruned at epoch 1"
    assert third.intermediate == {1: 0.1} and third.rungs == {1: 0.1}
    assert [t.job_id for t in report.trials] == [11, 12, 13, None]
    assert fourth.intermediate == {} and fourth.value is None
    assert report.best is not None and report.best.number == 1 and report.best.value == 0.9
    assert report.metric == "val/accuracy" and report.direction == "maximize"
    assert report.counts == {"complete": 2, "pruned": 1, "running": 1}
    assert set(report.importances) == {"optimizer.lr", "model.kwargs.drop_rate"}
    assert sum(report.importances.values()) == pytest.approx(1.0)
    assert report.importances_note is None
    # No control plane: no cost, and the report says why.
    assert all(t.gpu_hours is None and t.cost is None for t in report.trials)
    assert report.gpu_hours is None and report.cost_note == "the control plane is not reachable"
    doc = report.to_json()
    assert doc["best"]["number"] == 1 and doc["trials"][0]["rungs"] == {1: 0.5, 2: 0.6}


def test_importances_need_two_complete_trials_and_say_so(url: str) -> None:
    spec = tune_spec()
    study = create_or_load(spec, url)
    assert study_report(study, None).importances_note == (
        "parameter importances need at least 2 complete trials; this study has 0."
    )
    run_trial(study, spec, [0.5, 0.6, 0.7, 0.8], job=1)
    report = study_report(study, None)
    assert report.importances == {}
    assert report.importances_note is not None and "this study has 1." in report.importances_note
    assert report.best is not None and report.best.number == 0


def test_plots_are_written_as_png_and_empty_ones_are_skipped_with_the_reason(
    url: str, tmp_path: Path
) -> None:
    spec = tune_spec()
    study = create_or_load(spec, url)
    empty = write_plots(study, tmp_path / "none")
    assert empty.written == {}
    assert empty.skipped == {
        "optimization_history": "no complete trial yet",
        "parallel_coordinate": "no complete trial yet",
        "intermediate_values": "no trial has reported an intermediate value yet",
    }
    run_trial(study, spec, [0.5, 0.6, 0.7, 0.8], job=1)
    run_trial(study, spec, [0.4, 0.5, 0.6, 0.9], job=2)
    with pytest.warns() as caught:  # anything but Optuna's "experimental" warning gets through
        import warnings

        warnings.warn("sentinel", UserWarning, stacklevel=1)
        plots = write_plots(study, tmp_path / "plots")
    assert [str(w.message) for w in caught] == ["sentinel"]
    assert set(plots.written) == {"optimization_history", "parallel_coordinate", "intermediate_values"}
    assert plots.skipped == {}
    for name, path in plots.written.items():
        assert path == tmp_path / "plots" / f"lr-study-{name}.png"
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_best_trial_without_a_complete_trial_says_what_the_study_has(url: str) -> None:
    spec = tune_spec()
    study = create_or_load(spec, url)
    run_trial(study, spec, [0.5, 0.6], job=1, end="running")
    with pytest.raises(NotFoundError) as e:
        best_trial(study, None, load_settings())
    assert "has no complete trial yet (1 running)" in str(e.value)


def test_best_trial_without_control_plane_or_tracked_run_says_why_the_run_dir_is_unknown(url: str) -> None:
    spec = tune_spec()
    study = create_or_load(spec, url)
    run_trial(study, spec, [0.5, 0.9], job=7)
    best = best_trial(study, None, load_settings(), no_jobs_reason="no control plane")
    assert (best.number, best.value, best.job_id, best.run_dir) == (0, 0.9, 7, None)
    assert best.params == study.trials[0].params
    assert best.run_dir_note == "no control plane; the tracking store has no runs"


def test_nest_sets_the_parent_run_and_tags_and_leaves_the_base_document_alone() -> None:
    spec = tune_spec()
    base = spec.train_doc()
    doc = nest(base, PARENT, "lr-study", 3)
    assert base["tracking"]["parent_run_id"] is None and base["tracking"]["tags"] == {"team": "vision"}
    assert doc["tracking"]["parent_run_id"] == PARENT
    assert doc["tracking"]["tags"] == {
        "team": "vision",
        "visionloop.study": "lr-study",
        "visionloop.trial": "3",
    }
    assert doc["tracking"]["run_name"] == "lr-study-t3"
    assert doc["tracking"]["experiment"] == "tune-tests"
    # What the tuner makes of it: the trial's parameters applied, validated as a train spec.
    train = apply(doc, {"optimizer.lr": 0.01})
    assert isinstance(train, TrainSpec)
    assert train.tracking.parent_run_id == PARENT and train.optimizer.lr == 0.01
    assert train.tracking.tags["visionloop.trial"] == "3"


@pytest.mark.parametrize(
    ("tracking", "message"),
    [
        ({"parent_run_id": "not-a-run"}, "must be an MLflow run id: 32 lowercase hex characters"),
        ({"parent_run_id": PARENT.upper()}, "must be an MLflow run id"),
        ({"tags": {"mlflow.parentRunId": PARENT}}, "is MLflow's own; nest a run with parent_run_id"),
        ({"tags": {"-x": "1"}}, "tag key '-x' is not usable"),
        ({"tags": {"k": "v" * 1001}}, "tag 'k' is longer than 1000 characters"),
        ({"tags": {f"k{i}": "v" for i in range(33)}}, "takes at most 32 tags"),
    ],
)
def test_tracking_fields_are_validated(tracking: dict[str, Any], message: str) -> None:
    doc = {**TRAIN, "tracking": tracking}
    with pytest.raises(SpecError) as e:
        validate_train_spec(doc, "train.yaml")
    text = " ".join(str(e.value).split())
    assert "tracking." in text and message in text, text
    ok = validate_train_spec(
        {**TRAIN, "tracking": {"parent_run_id": PARENT, "tags": {"a/b c": "1"}}}, "t.yaml"
    )
    assert ok.tracking.parent_run_id == PARENT and ok.tracking.tags == {"a/b c": "1"}


def test_loading_a_study_from_a_database_that_does_not_exist_creates_nothing(tmp_path: Path) -> None:
    # `tune show` and `tune best` only read: a mistyped home or --db must not leave an empty
    # database behind (it did), and the error says where it looked.
    missing = tmp_path / "home" / "state.db"
    with pytest.raises(NotFoundError) as e:
        load("nosuch", f"sqlite:///{missing}")
    assert f"database {missing} does not exist yet" in str(e.value)
    assert not missing.exists() and not missing.parent.exists()
    # An existing database names the studies it has.
    url = f"sqlite:///{tmp_path / 'state.db'}"
    create_or_load(tune_spec(), url)
    with pytest.raises(NotFoundError) as e:
        load("nosuch", url)
    assert "no study named 'nosuch' in the control plane's database (studies: " in str(e.value)
