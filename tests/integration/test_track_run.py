"""RunTracker against a real MLflow SQLite store in the test's temporary home."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from _mlflowkit import copy_migrated_store
from visionloop.core.errors import TrackingError
from visionloop.core.settings import Settings, load_settings
from visionloop.track import RunTracker, open_run


@pytest.fixture
def settings(vl_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    copy_migrated_store(tmp_path_factory, vl_home)
    return load_settings()


def history(client: MlflowClient, run_id: str, key: str) -> dict[int, float]:
    points = client.get_metric_history(run_id, key)
    steps = [m.step for m in points]
    assert len(steps) == len(set(steps)), f"{key}: duplicated steps {sorted(steps)}"
    return {m.step: m.value for m in points}


def artifact_paths(client: MlflowClient, run_id: str, path: str | None = None) -> set[str]:
    out: set[str] = set()
    for info in client.list_artifacts(run_id, path):
        out |= artifact_paths(client, run_id, info.path) if info.is_dir else {info.path}
    return out


def test_lifecycle_on_a_fresh_store(
    vl_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # No template here: the store is created by open_run, as on a user's first run, and the
    # process's working directory must not receive an ./mlruns folder.
    monkeypatch.chdir(tmp_path)
    settings = load_settings()
    run_dir = vl_home / "runs" / "digits-1"
    tracker = open_run(
        settings,
        uid="uid-lifecycle",
        experiment="digits",
        run_name="digits-small_cnn",
        run_dir=run_dir,
        tags={"visionloop.dataset_version": "ds-v3"},
    )
    assert isinstance(tracker, RunTracker) and not tracker.resumed
    tracker.log_params({"optimizer": {"name": "sgd", "lr": 0.1}, "epochs": 2, "aug": None})
    for step in range(5):
        tracker.log_metrics({"train/loss": 1.0 / (step + 1), "train/lr": 0.1}, step=step)
    tracker.log_metrics({"val/accuracy": 0.75, "val/recall/cat/dog?": 0.5}, step=4)
    tracker.set_tags({"visionloop.best_step": 4})
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "weights.bin").write_bytes(b"\0" * 64)
    (model / "sub" / "card.json").write_text("{}")
    (tmp_path / "report.txt").write_text("ok")
    tracker.log_artifact(model, artifact_path="model")
    tracker.log_artifact(tmp_path / "report.txt")
    tracker.log_text("epochs: 2\n", "spec.yaml")
    tracker.log_dict({"accuracy": 0.75}, "eval/epoch-1.json")
    summary = tracker.close("FAILED")
    assert (summary.status, summary.ended, summary.metrics_written, summary.metrics_dropped) == (
        "FAILED",
        True,
        12,
        0,
    )

    client = MlflowClient(settings.tracking_uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FAILED" and run.info.end_time is not None
    assert run.info.run_name == "digits-small_cnn"
    assert run.data.params == {"optimizer.name": "sgd", "optimizer.lr": "0.1", "epochs": "2", "aug": "None"}
    assert history(client, tracker.run_id, "train/loss") == {s: 1.0 / (s + 1) for s in range(5)}
    assert run.data.metrics["val/recall/cat/dog_"] == 0.5  # sanitised key
    tags = run.data.tags
    assert tags["visionloop.uid"] == "uid-lifecycle"
    assert tags["visionloop.run_dir"] == str(run_dir.resolve())
    assert tags["visionloop.dataset_version"] == "ds-v3"
    assert tags["visionloop.best_step"] == "4"
    assert tags["visionloop.attempts"] == "1"
    assert tags["visionloop.env.mlflow"] == __import__("mlflow").__version__  # environment tags on by default
    assert artifact_paths(client, tracker.run_id) == {
        "model/weights.bin",
        "model/sub/card.json",
        "report.txt",
        "spec.yaml",
        "eval/epoch-1.json",
    }
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.artifact_location == (settings.artifacts_dir / "digits").resolve().as_uri()
    assert run.info.artifact_uri.startswith(exp.artifact_location)
    assert not (tmp_path / "mlruns").exists()
    assert tracker.ui_command() == f"mlflow ui --backend-store-uri {settings.tracking_uri} --port 5000"
    # MLflow's INFO lines (creating tables, migrations) must not reach the terminal.
    assert "INFO" not in capfd.readouterr().err


def test_resume_continues_the_same_run_without_duplicate_steps(settings: Settings) -> None:
    first = open_run(settings, uid="uid-resume", experiment="e", environment=False)
    first.log_params({"lr": 0.1, "model": {"name": "cnn"}})
    for step in range(10):
        first.log_metrics({"train/loss": float(step)}, step=step)
    first.log_metrics({"train/loss": 99.0}, step=9)  # a second value for a step: dropped
    assert first.flush(timeout=10)
    first.close("KILLED")

    again = open_run(settings, uid="uid-resume", experiment="e", environment=False)
    assert again.resumed and again.run_id == first.run_id
    again.log_params({"lr": 0.1, "model": {"name": "cnn"}})  # the same spec again: fine
    for step in range(5, 15):  # the trainer replays from its last checkpoint (step 5)
        again.log_metrics({"train/loss": float(step) + 0.5}, step=step)
    summary = again.close()
    assert summary.duplicates_skipped == 5

    client = MlflowClient(settings.tracking_uri)
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["visionloop.attempts"] == "2"
    got = history(client, first.run_id, "train/loss")
    assert got == {**{s: float(s) for s in range(10)}, **{s: s + 0.5 for s in range(10, 15)}}
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_resume_while_marked_running_sets_running_again(settings: Settings) -> None:
    t = open_run(settings, uid="uid-status", environment=False)
    t.close("FAILED")
    t2 = open_run(settings, uid="uid-status", environment=False)
    assert MlflowClient(settings.tracking_uri).get_run(t.run_id).info.status == "RUNNING"
    t2.close()


def test_changing_a_param_is_an_error_that_names_it(settings: Settings) -> None:
    t = open_run(settings, uid="uid-params", environment=False)
    t.log_params({"optimizer": {"lr": 0.1}})
    t.close()
    again = open_run(settings, uid="uid-params", environment=False)
    with pytest.raises(TrackingError) as err:
        again.log_params({"optimizer": {"lr": 0.2}, "new": 1})
    message = str(err.value)
    assert "'optimizer.lr'" in message and "'0.1'" in message and "'0.2'" in message
    assert "new run directory" in message
    # Nothing of the rejected call was stored.
    assert MlflowClient(settings.tracking_uri).get_run(t.run_id).data.params == {"optimizer.lr": "0.1"}
    again.close()


def test_a_deleted_run_is_not_silently_replaced(settings: Settings) -> None:
    t = open_run(settings, uid="uid-deleted", environment=False)
    t.close()
    MlflowClient(settings.tracking_uri).delete_run(t.run_id)
    with pytest.raises(TrackingError, match="mlflow runs restore --run-id"):
        open_run(settings, uid="uid-deleted", environment=False)


def test_store_failures_cost_metrics_not_the_run(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    t = open_run(settings, uid="uid-outage", environment=False, flush_interval_s=0.05)
    client = MlflowClient(settings.tracking_uri)
    t.log_metrics({"train/loss": 0.0}, step=0)
    assert t.flush(timeout=10)
    client.delete_run(t.run_id)  # the store now refuses every write to this run
    for step in range(1, 4):
        t.log_metrics({"train/loss": float(step)}, step=step)  # never raises
    assert t.flush(timeout=10)
    client.restore_run(t.run_id)
    t.log_metrics({"train/loss": 4.0}, step=4)
    summary = t.close()
    assert summary.metrics_dropped == 3 and summary.ended
    assert "dropped 3 metrics" in caplog.text
    run = client.get_run(t.run_id)
    assert sorted(history(client, t.run_id, "train/loss")) == [0, 4]
    assert run.data.tags["visionloop.metrics_dropped"] == "3"
    assert run.info.status == "FINISHED"


def test_system_metrics_land_at_distinct_increasing_training_steps(settings: Settings) -> None:
    t = open_run(settings, uid="uid-system", environment=False)
    step = 0
    t.start_system_metrics(step_fn=lambda: step, every_s=0.05)
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        step += 1
        t.log_metrics({"train/loss": 1.0}, step=step)
        time.sleep(0.01)
    t.close()
    client = MlflowClient(settings.tracking_uri)
    for key in ("system/cpu_percent", "system/process_rss_mib", "system/memory_used_percent"):
        steps = sorted(history(client, t.run_id, key))
        assert len(steps) >= 3, key
        assert all(0 < s <= step for s in steps)


def test_closed_tracker_refuses_more_logging(settings: Settings) -> None:
    t = open_run(settings, uid="uid-closed", environment=False)
    first = t.close()
    assert t.close() is first  # closing twice is harmless
    with pytest.raises(TrackingError, match="closed"):
        t.log_metrics({"x": 1.0}, step=1)
    # Closed by the with: an open tracker's writer thread would outlive the test.
    with (
        open_run(settings, uid="uid-closed", environment=False) as again,
        pytest.raises(TrackingError, match="metrics must be numbers"),
    ):
        again.log_metrics({"x": "high"}, step=2)  # type: ignore[dict-item]


def test_an_unusable_store_is_a_tracking_error_that_names_it(tmp_path: Path) -> None:
    uri = "sqlite:////proc/visionloop-no-such-dir/mlflow.db"  # not creatable, even by root
    with pytest.raises(TrackingError, match=r"tracking store sqlite:////proc/.*VISIONLOOP_TRACKING_URI"):
        open_run(Settings(home=tmp_path, tracking_uri=uri), uid="u1", environment=False)


def test_a_bad_uid_is_rejected_before_touching_the_store(settings: Settings) -> None:
    with pytest.raises(TrackingError, match="uid"):
        open_run(settings, uid="has'quote", environment=False)


def test_tracker_works_as_context_manager(settings: Settings) -> None:
    with pytest.raises(ValueError), open_run(settings, uid="uid-ctx", environment=False) as t:
        raise ValueError("boom")
    assert MlflowClient(settings.tracking_uri).get_run(t.run_id).info.status == "FAILED"


def test_git_commit_of_the_code_dir_is_tagged(settings: Settings, tmp_path: Path) -> None:
    repo = tmp_path / "code"
    repo.mkdir()
    for args in (["init", "-q"], ["config", "user.email", "t@x"], ["config", "user.name", "t"]):
        subprocess.run(["git", "-C", str(repo), *args], check=True)
    (repo / "a.py").write_text("")
    subprocess.run(["git", "-C", str(repo), "add", "a.py"], check=True)
    subprocess.run(["git", "-C", str(repo), "commit", "-qm", "c"], check=True)
    head = subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    t = open_run(settings, uid="uid-git", code_dir=repo)
    t.close()
    tags = MlflowClient(settings.tracking_uri).get_run(t.run_id).data.tags
    assert tags["visionloop.git.commit"] == head
    assert tags["mlflow.source.git.commit"] == head
