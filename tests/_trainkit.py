"""Helpers for trainer tests: a real ingested digits dataset and small specs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

import _warmcli
from visionloop.cli.demo import write_digits_imagefolder
from visionloop.data.ingest import IngestOptions, ingest


def build_digits_dataset(root: Path, scale: int = 2) -> Path:
    """scikit-learn's digits → ImageFolder (16x16 PNG) → the real ingest → a dataset folder."""
    images = root / "digits-images"
    write_digits_imagefolder(images, scale=scale)
    out = root / "digits-ds"
    ingest(images, out, IngestOptions(val_fraction=0.2, seed=0, workers=2))
    return out


def spec_doc(dataset: Path, **overrides: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "data": {
            "dataset": str(dataset),
            "batch_size": 64,
            "workers": 1,
            "image_size": 16,
            "augment": {"hflip": 0.0, "scale": [0.6, 1.0], "color_jitter": 0.2},
        },
        "model": {"arch": "small_cnn", "kwargs": {"drop_rate": 0.1}},
        "optimizer": {"name": "adamw", "lr": 0.003, "weight_decay": 0.01},
        "schedule": {"name": "cosine", "warmup_steps": 5},
        "epochs": 2,
        "seed": 0,
        "deterministic": True,
        "checkpoint": {"every_steps": 4, "keep_last": 2},
        "tracking": {"experiment": "tests"},
    }
    for dotted, value in overrides.items():
        node = doc
        keys = dotted.split("__")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return doc


def write_spec(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def cli(
    *args: str,
    env: dict[str, str] | None = None,
    cold: bool = False,
    cwd: str | Path | None = None,
    timeout: float | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `python -m visionloop ARGS` the way a user runs it, as a new process.

    The process is forked from a warm interpreter that has imported torch and mlflow already
    (tests/_warmcli.py: the same CLI, argv, environment, stdio and exit status, without 3-8 s
    of imports per call); `cold=True` starts a plain `python -m visionloop`, for tests of
    start-up itself.
    """
    return _warmcli.run(
        list(args),
        env={**os.environ, **(env or {})},
        cwd=cwd,
        timeout=timeout,
        input=input,
        start_cold=cold,
    )


def popen(*args: str, **kw: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "visionloop", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so the test can signal the whole process group, like a scheduler
        **kw,
    )
