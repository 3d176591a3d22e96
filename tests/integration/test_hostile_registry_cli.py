"""`visionloop models` against hand-edited registry files and hostile arguments: the command
says what is wrong, without a traceback, and loses nothing."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from _fakerun import fake_run
from _mlflowkit import copy_migrated_store
from _trainkit import cli
from visionloop import registry
from visionloop.core.settings import Settings
from visionloop.registry import store as rstore


@pytest.fixture
def home(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Path:
    """A home with model `m` v1 registered from a hand-written run folder (no training)."""
    home = tmp_path / "home"
    copy_migrated_store(tmp_path_factory, home)
    run = fake_run(tmp_path)
    registry.register(run, name="m", settings=_settings(home))
    return home


def _settings(home: Path) -> Settings:
    return Settings(home=home, tracking_uri=f"sqlite:///{home / 'mlflow.db'}")


def _env(home: Path) -> dict[str, str]:
    return {"VISIONLOOP_HOME": str(home), "VISIONLOOP_TRACKING_URI": _settings(home).tracking_uri}


def test_show_survives_hand_edited_eval_reports_and_tags(home: Path) -> None:
    vdir = home / "models" / "m" / "v1"
    (vdir / "evals" / "e1").mkdir(parents=True)
    report = {
        "created_at": "t",
        "metric": "accuracy",
        "clean": 10**400,
        "calibration": {"ece": 0.1, "ece_after": "x"},
    }
    (vdir / "evals" / "e1" / "eval.json").write_text(json.dumps(report))
    (vdir / "evals" / "e2").mkdir()
    os.mkfifo(vdir / "evals" / "e2" / "eval.json")  # skipped, never waited on
    (vdir / "lineage.json").write_bytes(b"\xff\xfe")  # read as no lineage
    rstore.client(_settings(home)).set_model_version_tag("m", "1", "visionloop.metric.accuracy", "lots")
    r = cli("models", "show", "m/1", env=_env(home), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "0.1000 → -" in r.stdout  # the string ece_after shown as '-', the rest of the row kept
    assert "accuracy -" in r.stdout  # the 400-digit clean score (the tag "lots": "-" in the table)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("models", "show", "m/²"), "'m/²': the version after '/' must be a positive whole number"),
        (("models", "show", "m/" + "9" * 5000), "the version after '/' must be a positive whole number"),
        (
            ("models", "alias", "m", "99999999999", "champion"),
            "a version is a whole number from 1 to 2147483647",
        ),
        (("models", "alias", "m", "1", "champion\n"), "alias 'champion\\n' is not usable"),
        (("models", "register", "nowhere", "--name", "m\n"), "is not usable"),
    ],
)
def test_hostile_arguments_get_one_line_errors(home: Path, args: tuple[str, ...], needle: str) -> None:
    r = cli(*args, env=_env(home), timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert needle in r.stderr
    assert [v.version for v in registry.list_versions("m", _settings(home))] == [1]
    assert registry.aliases("m", _settings(home)) == {}


def test_alias_with_a_damaged_history_changes_nothing(home: Path) -> None:
    history = home / "models" / "m" / "alias_history.json"
    history.write_bytes(b"\xff\xfe[")
    r = cli("models", "alias", "m", "1", "champion", env=_env(home), timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "alias_history.json (the alias history) is unreadable" in r.stderr
    assert registry.aliases("m", _settings(home)) == {}
    assert history.read_bytes() == b"\xff\xfe["
