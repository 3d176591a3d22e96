"""Every trial an MLflow run nested under its study's parent run, against a real MLflow SQLite
store: the parent run is made once per study (found again after a tuner died before storing
its id), `open_run` nests a run with MLflow's own tag, and a real tiny training run whose
spec `nest` made lands under the parent, tagged with its study and trial."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient
from optuna.distributions import FloatDistribution
from sqlalchemy import create_engine, text

from _mlflowkit import copy_migrated_store
from _trainkit import spec_doc
from visionloop.core.settings import Settings, load_settings
from visionloop.specs import validate_train_spec
from visionloop.track import open_run
from visionloop.tune.report import register_best
from visionloop.tune.spec import validate_tune_spec
from visionloop.tune.study import create_or_load, load
from visionloop.tune.tracking import PARENT_RUN_ATTR, nest, study_parent_run

PARENT_TAG = "mlflow.parentRunId"


@pytest.fixture
def settings(vl_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    copy_migrated_store(tmp_path_factory, vl_home)
    return load_settings()


def tune_doc(name: str = "lr-study", experiment: str = "tune-tests") -> dict[str, Any]:
    return {
        "name": name,
        "train": {
            "data": {"dataset": "/ds", "batch_size": 32, "image_size": 16},
            "model": {"arch": "small_cnn"},
            "epochs": 2,
            "tracking": {"experiment": experiment},
        },
        "space": {"optimizer.lr": {"loguniform": [1e-4, 1e-1]}},
        "pruner": {"name": "none"},
        "trials": 2,
    }


def test_the_parent_run_is_made_once_per_study_even_across_a_crash(
    settings: Settings, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    spec = validate_tune_spec(tune_doc(), "tune.yaml", Path("/"))
    study = create_or_load(spec, url)
    parent = study_parent_run(study, settings)
    client = MlflowClient(tracking_uri=settings.tracking_uri)
    run = client.get_run(parent)
    assert client.get_experiment(run.info.experiment_id).name == "tune-tests"
    assert run.info.run_name == "lr-study"
    assert run.data.tags["visionloop.study"] == "lr-study" and run.data.tags["visionloop.kind"] == "study"
    assert run.data.params["space.optimizer.lr.loguniform"] == "[0.0001, 0.1]"
    assert run.data.params["objective.metric"] == "val/accuracy"
    assert load("lr-study", url).user_attrs[PARENT_RUN_ATTR] == parent
    # A restarted tuner (a new process, the study loaded again, the URI alone): the same run.
    assert study_parent_run(create_or_load(spec, url), settings.tracking_uri) == parent
    # A tuner killed after making the run but before storing its id: found by the study's uid.
    engine = create_engine(url)
    with engine.begin() as conn:
        gone = conn.execute(text("DELETE FROM study_user_attributes WHERE key = :k"), {"k": PARENT_RUN_ATTR})
        assert gone.rowcount == 1
    engine.dispose()
    assert PARENT_RUN_ATTR not in load("lr-study", url).user_attrs
    assert study_parent_run(load("lr-study", url), settings) == parent
    assert len(client.search_runs([run.info.experiment_id], "tags.`visionloop.kind` = 'study'")) == 1
    # Another study gets a run of its own.
    other = create_or_load(validate_tune_spec(tune_doc("other"), "tune.yaml", Path("/")), url)
    assert study_parent_run(other, settings) != parent


def test_open_run_nests_under_the_parent_and_the_trainers_tags_win(settings: Settings) -> None:
    client = MlflowClient(tracking_uri=settings.tracking_uri)
    parent = open_run(settings, uid="study-parent", experiment="e", environment=False)
    parent.close()
    tracker = open_run(
        settings,
        uid="trial-0",
        experiment="e",
        environment=False,
        parent_run_id=parent.run_id,
        spec_tags={"visionloop.trial": "0", "visionloop.arch": "from-spec", "owner": "ana"},
        tags={"visionloop.arch": "small_cnn"},
    )
    tracker.close()
    run = client.get_run(tracker.run_id)
    assert run.data.tags[PARENT_TAG] == parent.run_id
    assert run.data.tags["visionloop.trial"] == "0" and run.data.tags["owner"] == "ana"
    assert run.data.tags["visionloop.arch"] == "small_cnn"
    children = client.search_runs([run.info.experiment_id], f"tags.`{PARENT_TAG}` = '{parent.run_id}'")
    assert [r.info.run_id for r in children] == [tracker.run_id]
    # Resumed (a preempted trial), it stays nested under the same parent.
    again = open_run(settings, uid="trial-0", experiment="e", environment=False, parent_run_id=parent.run_id)
    again.close()
    assert again.resumed and client.get_run(again.run_id).data.tags[PARENT_TAG] == parent.run_id
    assert PARENT_TAG not in client.get_run(parent.run_id).data.tags


def test_a_real_training_run_from_a_nested_spec_is_the_parents_child(
    settings: Settings, tmp_path: Path, digits_dataset: Path
) -> None:
    from visionloop.train.api import train

    url = f"sqlite:///{tmp_path / 'state.db'}"
    study = create_or_load(validate_tune_spec(tune_doc(experiment="tests"), "tune.yaml", Path("/")), url)
    parent = study_parent_run(study, settings)
    trial = study.ask({"optimizer.lr": FloatDistribution(1e-4, 1e-1, log=True)})
    doc = nest(spec_doc(digits_dataset, steps=2, epochs=None), parent, study.study_name, trial.number)
    result = train(validate_train_spec(doc), tmp_path / "run", settings=settings)
    assert result.exit_code == 0 and result.run_id is not None
    client = MlflowClient(tracking_uri=settings.tracking_uri)
    run = client.get_run(result.run_id)
    assert run.data.tags[PARENT_TAG] == parent
    assert run.data.tags["visionloop.study"] == "lr-study" and run.data.tags["visionloop.trial"] == "0"
    assert run.info.run_name == "lr-study-t0"
    assert client.get_run(parent).info.experiment_id == run.info.experiment_id
    # Without a control plane, `tune best` finds the trial's run directory through those tags.
    study.tell(trial, 0.9)
    best, version = register_best(study, "nested-best", None, settings, no_jobs_reason="no control plane")
    assert (best.number, best.run_dir, best.mlflow_run_id) == (0, str(tmp_path / "run"), result.run_id)
    assert version.run_id == result.run_id and version.lineage()["run_dir"] == str(tmp_path / "run")
