"""Listing, finding and describing runs, in-process against one populated SQLite store."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from _mlflowkit import copy_migrated_store
from visionloop.core.errors import NotFoundError
from visionloop.core.settings import Settings
from visionloop.track import open_run
from visionloop.track.query import describe_run, find_run, list_runs


@dataclass(frozen=True)
class Populated:
    settings: Settings
    digits: str
    failed: str
    twins: tuple[str, str]
    run_dir: Path


@pytest.fixture(scope="module")
def populated(tmp_path_factory: pytest.TempPathFactory) -> Populated:
    home = tmp_path_factory.mktemp("query-home")
    copy_migrated_store(tmp_path_factory, home)
    settings = Settings(home=home, tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    run_dir = home / "runs" / "digits-1"
    run_dir.mkdir(parents=True)
    d = open_run(
        settings,
        uid="q-digits",
        experiment="digits",
        run_name="digits-small_cnn",
        run_dir=run_dir,
        tags={"visionloop.dataset_version": "ds-1"},
        environment=False,
    )
    d.log_params({"lr": 0.1})
    for step in range(11):
        d.log_metrics({"train/loss": 10.0 - step}, step=step)
    d.log_metrics({"val/accuracy": 0.8}, step=10)
    d.log_text("a", "spec.yaml")
    d.log_dict({"x": 1}, "eval/step-10/report.json")
    d.close()
    f = open_run(settings, uid="q-failed", experiment="detect", run_name="det", environment=False)
    f.close("FAILED")
    twins = []
    for uid in ("q-twin-1", "q-twin-2"):
        t = open_run(settings, uid=uid, experiment="digits", run_name="twin", environment=False)
        t.close()
        twins.append(t.run_id)
    return Populated(settings, d.run_id, f.run_id, (twins[0], twins[1]), run_dir)


def test_list_is_newest_first_with_summary_values(populated: Populated) -> None:
    runs = list_runs(populated.settings)
    assert [r.run_id for r in runs] == [*reversed(populated.twins), populated.failed, populated.digits]
    digits = runs[-1]
    assert (digits.name, digits.experiment, digits.status) == ("digits-small_cnn", "digits", "FINISHED")
    assert (digits.last_step, digits.val_accuracy, digits.dataset_version) == (10, 0.8, "ds-1")
    assert digits.run_dir == str(populated.run_dir.resolve())
    assert digits.duration_s is not None and digits.duration_s >= 0


def test_list_filters_and_limits(populated: Populated) -> None:
    s = populated.settings
    assert [r.run_id for r in list_runs(s, status="failed")] == [populated.failed]
    assert {r.run_id for r in list_runs(s, experiment="digits")} == {populated.digits, *populated.twins}
    assert list_runs(s, experiment="detect", status="FINISHED") == []
    assert len(list_runs(s, limit=2)) == 2


def test_list_rejects_unknown_experiment_and_status(populated: Populated) -> None:
    with pytest.raises(NotFoundError, match=r"no experiment named 'nope'.*detect, digits"):
        list_runs(populated.settings, experiment="nope")
    with pytest.raises(NotFoundError, match="RUNNING, SCHEDULED, FINISHED, FAILED, KILLED"):
        list_runs(populated.settings, status="done")


@pytest.mark.parametrize(
    "how", ["full id", "prefix", "upper-case prefix", "name", "run dir", "relative run dir"]
)
def test_find_run_by_every_kind_of_reference(
    populated: Populated, how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = {
        "full id": populated.digits,
        "prefix": populated.digits[:6],
        "upper-case prefix": populated.digits[:10].upper(),
        "name": "digits-small_cnn",
        "run dir": str(populated.run_dir),
        "relative run dir": "runs/digits-1",
    }[how]
    monkeypatch.chdir(populated.settings.home)
    assert find_run(populated.settings, ref).info.run_id == populated.digits


def test_ambiguous_name_lists_the_candidates(populated: Populated) -> None:
    with pytest.raises(NotFoundError) as err:
        find_run(populated.settings, "twin")
    assert "matches 2 runs" in str(err.value)
    assert all(run_id[:12] in str(err.value) for run_id in populated.twins)


def test_unknown_or_too_short_references_say_how_to_list_runs(populated: Populated) -> None:
    for ref in ("nothing-like-this", populated.digits[:5]):  # 5 characters is not a prefix
        with pytest.raises(NotFoundError, match="visionloop runs list"):
            find_run(populated.settings, ref)


def test_describe_run_has_params_latest_metrics_and_artifacts(populated: Populated) -> None:
    d = describe_run(populated.settings, populated.digits)
    assert d.params == {"lr": "0.1"}
    latest = {m.key: (m.value, m.step) for m in d.metrics}
    assert latest == {"train/loss": (0.0, 10), "val/accuracy": (0.8, 10)}
    assert [a.path for a in d.artifacts] == ["eval/step-10/report.json", "spec.yaml"]
    assert d.tags["visionloop.uid"] == "q-digits"
    assert d.ui_command == f"mlflow ui --backend-store-uri {populated.settings.tracking_uri} --port 5000"
    j = d.to_json()
    assert j["metrics"]["train/loss"]["step"] == 10 and j["status"] == "FINISHED"


def test_a_store_that_was_never_created_has_no_runs(tmp_path: Path) -> None:
    s = Settings(home=tmp_path, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert list_runs(s) == []
    with pytest.raises(NotFoundError, match="no runs yet"):
        find_run(s, "anything")
    assert not (tmp_path / "mlflow.db").exists()
