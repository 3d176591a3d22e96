"""`visionloop demo`, the README's first command, run as a user runs it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from _trainkit import cli


@pytest.mark.slow
def test_demo_ingests_trains_to_95_percent_and_records_everything(vl_home: Path) -> None:
    p = cli("demo", timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr

    acc = re.search(r"validation accuracy\s+([\d.]+)%", p.stdout)
    assert acc is not None, p.stdout
    assert float(acc.group(1)) >= 95.0

    run_dir = Path(re.search(r"^\s+run\s+(\S+)$", p.stdout, re.M).group(1))  # type: ignore[union-attr]
    assert run_dir.parent == vl_home / "runs"
    assert (run_dir / "final.safetensors").is_file()
    card = json.loads((run_dir / "model_card.json").read_text())
    assert card["arch"] == "small_cnn" and card["class_names"] == [str(d) for d in range(10)]
    assert list((run_dir / "checkpoints").glob("step-*.ckpt"))
    assert "mlflow ui --backend-store-uri sqlite:///" in p.stdout

    manifest = json.loads((vl_home / "datasets" / "digits" / "dataset.json").read_text())
    assert manifest["splits"]["train"]["count"] + manifest["splits"]["val"]["count"] == 1797
    assert card["dataset_version"] == manifest["version"]

    # The run is in the tracking store, with its metrics and artifacts.
    run_id = re.search(r"MLflow run\s+([0-9a-f]{32})", p.stdout).group(1)  # type: ignore[union-attr]
    show = cli("runs", "show", run_id, "--json")
    assert show.returncode == 0, show.stderr
    info = json.loads(show.stdout)
    text = json.dumps(info)
    assert "val/accuracy" in text and "train/loss" in text and "final.safetensors" in text
    assert "confusion_matrix.png" in text
