"""Test helper: an empty, migrated MLflow store without paying for the migrations each time."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from visionloop.core.settings import Settings
from visionloop.track import store as track_store


def copy_migrated_store(factory: pytest.TempPathFactory, home: Path) -> None:
    """Put an empty, fully migrated MLflow database at `<home>/mlflow.db`.

    Creating one runs ~2 s of schema migrations; the tracker's test modules share one per
    session (under pytest's base temp) and copy it. Creating a store from nothing is tested
    once, in test_track_run.py::test_lifecycle_on_a_fresh_store.
    """
    template = factory.getbasetemp() / "mlflow-template" / "mlflow.db"
    if not template.exists():
        settings = Settings(home=template.parent, tracking_uri=f"sqlite:///{template}")
        track_store.client(settings).search_experiments()
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(template, home / "mlflow.db")
