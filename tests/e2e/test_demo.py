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

    # ... and past training: registered as the champion, exported to int8 through the gate,
    # benchmarked, served, and asked about a digit with tritonclient.
    from visionloop.bench.result import BenchResult
    from visionloop.export import ExportReport
    from visionloop.registry import get_version
    from visionloop.registry.store import DATASET_VERSION_TAG

    model = get_version("digits@champion")
    assert model.version == 1 and model.card().arch == "small_cnn"
    assert model.tags[DATASET_VERSION_TAG] == manifest["version"]
    for precision in ("fp32", "int8"):
        onnx = model.export_path("onnx", precision)
        assert onnx is not None and onnx.is_file(), precision
        report = ExportReport.model_validate_json((onnx.parent / "export.json").read_text())
        assert report.passed and report.drop_points <= report.threshold_points == 1.0
        assert report.reference_accuracy == pytest.approx(float(acc.group(1)) / 100, abs=0.006)
    bench_dir = Path(re.search(r"^\s+benchmark\s+(\S+)$", p.stdout, re.M).group(1))  # type: ignore[union-attr]
    result = BenchResult.model_validate_json((bench_dir / "bench.json").read_text())
    ran = {(c.format, c.precision) for c in result.configs if c.status == "ok"}
    assert ran == {("pytorch", "fp32"), ("onnx", "fp32"), ("onnx", "int8")}
    answer = re.search(r"served answer\s+(\d) for a (\d) \(p=([\d.]+)\), via tritonclient", p.stdout)
    assert answer is not None, p.stdout
    assert answer.group(1) == answer.group(2) == "7"
    assert "server stopped" in p.stdout
