"""Test helper: a run folder written by hand (no training) that the registry accepts, and a
settings object over a copied, migrated MLflow store to register it in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _mlflowkit import copy_migrated_store
from visionloop.core.settings import Settings
from visionloop.models.card import ModelCard


def fake_card() -> ModelCard:
    """A two-class small_cnn card at 16 px."""
    return ModelCard(
        arch="small_cnn",
        num_classes=2,
        class_names=["a", "b"],
        input_size=(3, 16, 16),
        mean=(0.5, 0.5, 0.5),
        std=(0.25, 0.25, 0.25),
        crop_pct=1.0,
        metrics={"accuracy": 0.9},
    )


def fake_run(root: Path, name: str = "run") -> Path:
    """`root/name`: a finished run's files (card, weights that are not really weights, run.json,
    specs), enough for `registry.register` and `load_run`."""
    d = root / name
    d.mkdir(parents=True)
    fake_card().save(d / "model_card.json")
    (d / "final.safetensors").write_bytes(b"not really weights")
    (d / "run.json").write_text(json.dumps({"status": "finished", "mlflow_run_id": "abc"}))
    (d / "spec.yaml").write_text("model: {arch: small_cnn}\n")
    (d / "spec.resolved.yaml").write_text("data: {dataset: /data/digits}\n")
    return d


def store_settings(factory: pytest.TempPathFactory, home: Path) -> Settings:
    """Settings for `home`, with an empty migrated MLflow store copied in."""
    copy_migrated_store(factory, home)
    return Settings(home=home, tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
