"""The export record names its task's metric: a classifier's report reads as before (accuracy,
top-1 agreement, logit diff), a detector's says mAP, matched boxes and output diff; a report
written before these fields existed still reads, as a classifier's."""

from __future__ import annotations

from pathlib import Path

from visionloop.bench.target import _reason
from visionloop.export.api import _failure_message
from visionloop.registry.export_record import ExportReport, read_export_report, write_export_report_text


def _report(**kw: object) -> ExportReport:
    base: dict[str, object] = {
        "model": "m/1",
        "format": "onnx",
        "precision": "fp16",
        "path": "/x/model.onnx",
        "sha256": None,
        "size_bytes": 10,
        "opset": 17,
        "exporter": "torchscript",
        "samples": 40,
        "max_abs_diff": 0.5,
        "top1_agreement": 0.9,
        "max_abs_diff_threshold": 0.1,
        "top1_agreement_threshold": 0.98,
        "parity_passed": False,
        "accuracy": 0.40,
        "reference_accuracy": 0.45,
        "drop_points": 5.0,
        "threshold_points": 1.0,
        "gate_passed": False,
        "dataset_path": "/d",
        "dataset_version": None,
        "split": "val",
        "passed": False,
        "reason": "parity with eager PyTorch is off; mAP dropped more than allowed",
        "created_at": "2026-01-01T00:00:00+00:00",
        "duration_s": 1.0,
    }
    base.update(kw)
    return ExportReport.model_validate(base)


def test_a_detectors_report_names_map_and_matched_boxes(tmp_path: Path) -> None:
    r = _report(metric="mAP", agreement_label="matched boxes (IoU ≥ 0.99)", output_label="output")
    assert r.summary() == (
        "m/1 onnx-fp16 FAILED: mAP 40.00% vs 45.00% fp32 PyTorch (drop 5.00 points, allowed 1); "
        "max |output diff| 0.5, matched boxes (IoU ≥ 0.99) 90.00% on 40 val images"
    )
    message = _failure_message(r, tmp_path)
    assert "  mAP 40.00% against 45.00% for fp32 PyTorch on 40 val images" in message
    assert "max |output diff| 0.5 (limit 0.1), matched boxes (IoU ≥ 0.99) 90.00% (limit 98.00%)" in message
    assert _reason(r, "fp16", "hint") == "onnx fp16 export failed its mAP gate (mAP drop 5.00 points > 1.00)"


def test_a_classifiers_report_reads_as_before_and_old_files_still_load(tmp_path: Path) -> None:
    r = _report()
    assert (r.metric, r.agreement_label, r.output_label) == ("accuracy", "top-1 agreement", "logit")
    assert "accuracy 40.00% vs 45.00%" in r.summary()
    assert "max |logit diff| 0.5, top-1 agreement 90.00%" in r.summary()
    assert (
        _reason(r, "int8", "h")
        == "onnx int8 export failed its accuracy gate (accuracy drop 5.00 points > 1.00)"
    )
    # A report written before `metric` existed.
    old = write_export_report_text(r).replace('  "metric": "accuracy",\n', "")
    assert '"metric"' not in old
    (tmp_path / "export.json").write_text(old)
    back = read_export_report(tmp_path / "export.json")
    assert back is not None and back.metric == "accuracy" and back == r
