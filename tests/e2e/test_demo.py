"""`visionloop demo`, the README's first command, run as a user runs it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from _trainkit import cli


@pytest.mark.slow
def test_demo_ingests_trains_to_95_percent_and_records_everything(vl_home: Path) -> None:
    p = cli("demo", timeout=600, cold=True)  # the README's first command, started cold
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


@pytest.mark.slow
def test_detection_demo_runs_every_step_and_says_when_it_misses_its_target(vl_home: Path) -> None:
    # A few hundred images and one epoch: the whole walkthrough (draw, ingest, train, register,
    # export through the mAP gate, bench, serve, /detect) in CI time, far below the demo's own
    # budget; so it must reach the end and then refuse to call itself a success.
    p = cli(
        "demo",
        "--task",
        "detection",
        "--images",
        "128",
        "--epochs",
        "1",
        "--workers",
        "0",
        timeout=600,
        cold=True,
    )
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    for step in range(1, 8):
        assert f"{step}/7" in p.stderr, (step, p.stderr[-3000:])
    assert p.returncode == 1, p.stdout + p.stderr
    assert "the demo missed its mAP50 target" in " ".join(p.stderr.split())
    assert re.search(r"wrote 128 training and 300 validation images", p.stdout), p.stdout

    manifest = json.loads((vl_home / "datasets" / "digit-scenes" / "dataset.json").read_text())
    assert manifest["task"] == "detection"
    assert (manifest["splits"]["train"]["count"], manifest["splits"]["val"]["count"]) == (128, 300)

    from visionloop.export import ExportReport
    from visionloop.registry import get_version

    model = get_version("digit-detector@champion")
    assert model.card().task == "detection" and model.card().arch == "native_detector"
    onnx = model.export_path("onnx", "fp32")
    assert onnx is not None and onnx.is_file()
    report = ExportReport.model_validate_json((onnx.parent / "export.json").read_text())
    assert report.passed
    # The served answer was printed: the image's file, the endpoint and what it holds.
    assert re.search(
        r"POST \S+\.png to /v2/models/digit-detector/detect\?score_threshold=0\.3 → \d+ boxes", p.stdout
    )
    map50 = re.search(r"validation mAP50 ([\d.]+) \(target ≥ 0\.9\)", p.stdout)
    assert map50 is not None and float(map50.group(1)) < 0.9, p.stdout
