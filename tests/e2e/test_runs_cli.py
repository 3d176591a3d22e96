"""`visionloop runs list|show` run as a user runs them, against a store populated for real.

Each command is a separate `python -m visionloop` process (~2 s of mlflow import each), so the
commands of this module run concurrently once, and the tests check their results.
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import _warmcli
from _mlflowkit import copy_migrated_store
from visionloop.core.settings import Settings
from visionloop.track import open_run
from visionloop.track.environment import git_tags


@dataclass(frozen=True)
class Result:
    code: int
    out: str
    err: str


@dataclass(frozen=True)
class Store:
    home: Path
    finished_id: str
    failed_id: str
    run_dir: Path
    commit: str
    results: dict[str, Result]


def git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True)
    return done.stdout.strip()


def cli(home: Path, *args: str) -> Result:
    env = {**os.environ, "VISIONLOOP_HOME": str(home)}
    for var in ("VISIONLOOP_TRACKING_URI", "MLFLOW_TRACKING_URI", "COLUMNS", "VISIONLOOP_TRACEBACK"):
        env.pop(var, None)
    done = _warmcli.run(list(args), env=env, timeout=120)
    return Result(done.returncode, done.stdout, done.stderr)


# Filters, ambiguity and the other lookups are covered in-process by
# tests/integration/test_track_query.py; here, the commands a user types first.
COMMANDS: dict[str, tuple[str, ...]] = {
    "list": ("runs", "list"),
    "list_json": ("runs", "list", "--json"),
    "show_json": ("runs", "show", "<finished-prefix>", "--json"),
    "show_dir": ("runs", "show", "<run-dir>"),
    "show_unknown": ("runs", "show", "no-such-run"),
}


@pytest.fixture(scope="module")
def populated(tmp_path_factory: pytest.TempPathFactory) -> Store:
    home = tmp_path_factory.mktemp("cli-home")
    copy_migrated_store(tmp_path_factory, home)
    settings = Settings(home=home, tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    repo = home / "code"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@x")
    git(repo, "config", "user.name", "t")
    (repo / "train.py").write_text("")
    git(repo, "add", "train.py")
    git(repo, "commit", "-qm", "c")
    run_dir = home / "runs" / "digits-1"
    run_dir.mkdir(parents=True)

    t = open_run(
        settings,
        uid="u-finished",
        experiment="digits",
        run_name="digits-small_cnn",
        run_dir=run_dir,
        # Only the git tags: the full environment tags import torch, seconds this module can save.
        tags={"visionloop.dataset_version": "ds-7f3a", **git_tags(repo)},
        environment=False,
    )
    t.log_params({"optimizer": {"lr": 0.05}, "epochs": 3})
    for step in range(31):
        t.log_metrics({"train/loss": 1.0 / (step + 1)}, step=step)
    t.log_metrics({"val/accuracy": 0.9125, "val/recall/cat/dog?": 0.5}, step=30)
    (home / "weights.bin").write_bytes(b"\0" * 100)
    t.log_artifact(home / "weights.bin", artifact_path="model")
    t.close("FINISHED")

    f = open_run(settings, uid="u-failed", experiment="detect", run_name="det", environment=False)
    f.log_metrics({"train/loss": 2.0}, step=5)
    f.close("FAILED")

    substitutions = {"<finished-prefix>": t.run_id[:8], "<run-dir>": str(run_dir)}
    commands = {name: tuple(substitutions.get(a, a) for a in args) for name, args in COMMANDS.items()}
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(cli, home, *args) for name, args in commands.items()}
        results = {name: fut.result() for name, fut in futures.items()}
    return Store(home, t.run_id, f.run_id, run_dir, git(repo, "rev-parse", "HEAD"), results)


def test_list_shows_the_runs_newest_first(populated: Store) -> None:
    r = populated.results["list"]
    assert r.code == 0, r.err
    assert r.err == ""  # no MLflow log chatter, no warnings
    line = next(ln for ln in r.out.splitlines() if populated.finished_id[:8] in ln)
    for cell in ("digits-small_cnn", "digits", "FINISHED", "30", "0.9125", "ds-7f3a", str(populated.run_dir)):
        assert cell in line, (cell, line)
    assert r.out.index(populated.failed_id[:8]) < r.out.index(populated.finished_id[:8])  # newest first


def test_list_json_holds_the_values(populated: Store) -> None:
    r = populated.results["list_json"]
    assert r.code == 0, r.err
    runs = {row["run_id"]: row for row in json.loads(r.out)}
    assert set(runs) == {populated.finished_id, populated.failed_id}
    assert runs[populated.failed_id]["status"] == "FAILED"
    row = runs[populated.finished_id]
    assert row["name"] == "digits-small_cnn"
    assert row["experiment"] == "digits"
    assert row["status"] == "FINISHED"
    assert row["last_step"] == 30
    assert row["val_accuracy"] == 0.9125
    assert row["dataset_version"] == "ds-7f3a"
    assert row["run_dir"] == str(populated.run_dir)
    assert row["duration_s"] >= 0


def test_show_by_prefix_as_json(populated: Store) -> None:
    r = populated.results["show_json"]
    assert r.code == 0, r.err
    assert r.err == ""
    d = json.loads(r.out)
    assert d["run_id"] == populated.finished_id
    assert d["params"] == {"optimizer.lr": "0.05", "epochs": "3"}
    assert d["metrics"]["train/loss"] == {
        "value": 1.0 / 31,
        "step": 30,
        "timestamp": d["metrics"]["train/loss"]["timestamp"],
    }
    assert d["metrics"]["val/recall/cat/dog_"]["value"] == 0.5
    assert d["git_commit"] == populated.commit
    assert d["tags"]["visionloop.dataset_version"] == "ds-7f3a"
    assert d["artifacts"] == [{"path": "model/weights.bin", "size": 100}]
    assert d["ui_command"].startswith("mlflow ui --backend-store-uri sqlite:///")


def test_show_by_run_directory(populated: Store) -> None:
    r = populated.results["show_dir"]
    assert r.code == 0, r.err
    for text in (
        populated.finished_id,
        "FINISHED",
        "ds-7f3a",
        populated.commit,
        "optimizer.lr",
        "val/accuracy",
        "model/weights.bin",
        "mlflow ui --backend-store-uri",
    ):
        assert text in r.out, text


def test_unknown_run_is_a_clear_error(populated: Store) -> None:
    r = populated.results["show_unknown"]
    assert r.code != 0
    assert "no run matches 'no-such-run'" in r.err
    assert "visionloop runs list" in r.err
    assert "Traceback" not in r.err and r.out == ""


def test_empty_store_says_how_to_start(tmp_path: Path) -> None:
    r = cli(tmp_path / "fresh-home", "runs", "list")
    assert r.code == 0, r.err
    assert "No runs yet" in r.out and "visionloop train" in r.out
    assert not (tmp_path / "fresh-home" / "mlflow.db").exists()  # listing does not create a store
