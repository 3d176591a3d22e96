"""What is served, benchmarked and evaluated is what was gated and registered: an export's file
replaced by another of the same size (another model, a tampered graph) is refused where its
bytes are loaded (the server's loader, bench's ONNX Runtime runner), with the file and the sha256
mismatch named; ONNX Runtime is handed the checked bytes, never the path. `eval` refuses weights
changed after registration. An export report holding NaN, infinity or an out-of-range number
reads as no report (never served); the reports the exporter writes still read.

No training: the run folder is written by hand, and the ONNX models are two-node graphs."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _fakerun import fake_run, store_settings
from _hangkit import in_thread
from visionloop import registry
from visionloop.bench.result import sweep_settings
from visionloop.bench.sweep import _make_runner, bench_config
from visionloop.bench.target import target_from_version
from visionloop.core.errors import DataError
from visionloop.core.settings import Settings
from visionloop.eval.api import evaluate_model
from visionloop.registry.api import passing_export
from visionloop.registry.export_record import (
    ExportReport,
    UnservableExportError,
    read_export_report,
    read_passing_export,
    write_export_report_text,
)
from visionloop.registry.layout import ModelRef, export_dir
from visionloop.serve.source import RegistrySource


@pytest.fixture
def settings(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Settings:
    return store_settings(tmp_path_factory, tmp_path / "home")


def _onnx(weight: float) -> bytes:
    """input (batch, 4) @ W (4, 2) -> logits (batch, 2), W filled with `weight`: graphs that
    differ in `weight` only serialise to the same number of bytes."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.full((4, 2), weight, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "w"], ["logits"])],
        "g",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _report(**kw: Any) -> dict[str, Any]:
    """A report as the exporter writes it (the fields of a real int8 report of the digits model)."""
    base: dict[str, Any] = {
        "model": "m/1",
        "format": "onnx",
        "precision": "fp32",
        "path": "/x/model.onnx",
        "sha256": "d0c2a2560149093bd17dd259373ef73ae4c1086f24bcc3807871c11192234f76",
        "size_bytes": 189973,
        "opset": 17,
        "exporter": "torchscript",
        "samples": 359,
        "max_abs_diff": 0.1889181137084961,
        "top1_agreement": 1.0,
        "max_abs_diff_threshold": None,
        "top1_agreement_threshold": 0.9,
        "parity_passed": True,
        "accuracy": 0.9749303621169917,
        "reference_accuracy": 0.9749303621169917,
        "drop_points": 0.0,
        "threshold_points": 1.0,
        "gate_passed": True,
        "calibration_images": 256,
        "calibration_source": "256 training images of /d",
        "dataset_path": "/d",
        "dataset_version": "79b9fc1c831cb1d6e685472d42bde38c0cb756346732f9a96ccca97d64ec2d34",
        "split": "val",
        "passed": True,
        "reason": None,
        "created_at": "2026-11-30T06:10:19+00:00",
        "duration_s": 0.439,
        "metric": "accuracy",
        "agreement_label": "top-1 agreement",
        "output_label": "logit",
        "embedding_dim": 16,
        "embedding_variance": 0.9777,
    }
    base.update(kw)
    return base


def _export(info: registry.ModelVersionInfo, data: bytes) -> Path:
    """`data` stored as the version's passing fp32 export, with the report the exporter writes."""
    out = export_dir(info.dir, "onnx", "fp32")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.onnx"
    path.write_bytes(data)
    report = ExportReport.model_validate(
        _report(
            model=info.ref,
            path=str(path),
            sha256=hashlib.sha256(data).hexdigest(),
            size_bytes=len(data),
            calibration_images=None,
            calibration_source=None,
        )
    )
    (out / "export.json").write_text(write_export_report_text(report))
    return path


# --------------------------------------------------------------------------- serve and bench


def test_a_same_size_replaced_export_is_refused_by_the_server_and_bench(
    settings: Settings, tmp_path: Path
) -> None:
    info = registry.register(fake_run(tmp_path), name="m", settings=settings)
    original, other = _onnx(1.0), _onnx(2.0)
    assert len(original) == len(other) and original != other
    path = _export(info, original)
    x = np.ones((3, 4), dtype=np.float32)

    resolved = RegistrySource(settings).resolve(ModelRef("m", version=1))
    assert resolved.path == path
    model = resolved.load()
    assert model.run({"input": x})["logits"].tolist() == [[4.0, 4.0]] * 3
    bench = sweep_settings(formats="onnx", precisions="fp32", batch_sizes="2", iterations=1, warmup=0)
    row = bench_config(target_from_version(info), "onnx", "fp32", "cpu", bench, x, None)
    assert row.status == "ok", row.reason

    path.write_bytes(other)  # another model of the same size: the listing's size check passes
    assert passing_export(path.parent) == path
    with pytest.raises(UnservableExportError) as e:
        RegistrySource(settings).resolve(ModelRef("m", version=1)).load()
    message = str(e.value)
    assert message.startswith(f"{path} is not the file the export gate passed (sha256 ")
    assert f", the export gate passed {hashlib.sha256(original).hexdigest()[:16]}...)" in message
    assert message.endswith("Re-export it with `visionloop export m/1 --precision fp32`.")
    row = bench_config(target_from_version(info), "onnx", "fp32", "cpu", bench, x, None)
    assert row.status == "failed"
    assert row.reason is not None
    assert f"{path} is not the file the export gate passed (sha256 " in row.reason

    path.write_bytes(original)  # put back: served again
    assert RegistrySource(settings).resolve(ModelRef("m", version=1)).load().run({"input": x})


@pytest.mark.parametrize("loader", ["serve", "bench"])
def test_the_session_is_built_from_the_checked_bytes_not_the_path(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loader: str
) -> None:
    # The file swapped after the check, before ONNX Runtime reads it: a session made from the
    # path would run the other model.
    import onnxruntime as ort

    info = registry.register(fake_run(tmp_path), name="m", settings=settings)
    path = _export(info, _onnx(1.0))
    real = ort.InferenceSession

    def swap_then_load(source: Any, *args: Any, **kw: Any) -> Any:
        path.write_bytes(_onnx(2.0))
        return real(source, *args, **kw)

    monkeypatch.setattr(ort, "InferenceSession", swap_then_load)
    x = np.ones((1, 4), dtype=np.float32)
    if loader == "serve":
        out = RegistrySource(settings).resolve(ModelRef("m", version=1)).load().run({"input": x})["logits"]
    else:
        runner, _ = _make_runner(target_from_version(info), "onnx", "fp32", "cpu", sweep_settings())
        out = runner.predict(x)[0]
    assert out.tolist() == [[4.0, 4.0]]  # the model the gate passed, not the swapped one


def test_an_export_that_cannot_be_checked_is_refused_with_what_to_do(
    settings: Settings, tmp_path: Path
) -> None:
    info = registry.register(fake_run(tmp_path), name="m", settings=settings)
    path = _export(info, _onnx(1.0))
    folder = path.parent
    again = "Re-export it with `visionloop export m/1 --precision fp32`."

    report = json.loads((folder / "export.json").read_text())
    (folder / "export.json").write_text(json.dumps({**report, "sha256": None}))
    with pytest.raises(UnservableExportError, match=r"export.json records no sha256 for .*model.onnx"):
        read_passing_export(folder, ref="m/1")
    (folder / "export.json").write_text(json.dumps(report))

    path.write_bytes(_onnx(1.0)[:-1])
    with pytest.raises(UnservableExportError) as e:
        read_passing_export(folder, ref="m/1")
    assert str(e.value) == (
        f"{path} is not the file the export gate passed ({report['size_bytes'] - 1} bytes, the export gate "
        f"passed {report['size_bytes']}): it was changed or replaced after export. {again}"
    )
    path.unlink()
    with pytest.raises(UnservableExportError, match=r"model.onnx is missing\. Re-export it with"):
        read_passing_export(folder, ref="m/1")
    os.mkfifo(path)
    got = in_thread(lambda: read_passing_export(folder, ref="m/1"))
    assert isinstance(got, UnservableExportError) and "is a FIFO (named pipe)" in str(got), got
    assert str(got).endswith(again)


# --------------------------------------------------------------------------- eval


def test_eval_refuses_weights_replaced_after_registration(settings: Settings, tmp_path: Path) -> None:
    info = registry.register(fake_run(tmp_path), name="m", settings=settings)
    info.weights.write_bytes(b"other weights")
    with pytest.raises(registry.RegistryError, match=r"final.safetensors is not the file registered as m/1"):
        evaluate_model(info, settings=settings)
    info.weights.write_bytes(b"not really weights")
    # The registered weights pass the check; eval goes on to look for the dataset, which this
    # test has none of.
    with pytest.raises(DataError, match=r"/data/digits does not exist"):
        evaluate_model(info, settings=settings)


# --------------------------------------------------------------------------- the report


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("accuracy", "NaN"),
        ("accuracy", "Infinity"),
        ("accuracy", "-1"),
        ("accuracy", "1.5"),
        ("reference_accuracy", "NaN"),
        ("top1_agreement", "-Infinity"),
        ("max_abs_diff", "NaN"),
        ("max_abs_diff", "-0.5"),
        ("max_abs_diff", "Infinity"),  # within its range (>= 0), but not finite
        ("threshold_points", "Infinity"),
        ("drop_points", "Infinity"),
        ("threshold_points", "NaN"),
        ("duration_s", "-1"),
        ("size_bytes", "-1"),
        ("samples", "-3"),
        ("sha256", '"not a digest"'),
        ("embedding_variance", "NaN"),
    ],
)
def test_a_report_with_a_non_finite_or_impossible_number_reads_as_none(
    tmp_path: Path, field: str, value: str
) -> None:
    text = json.dumps(_report(**{field: "__value__"}), indent=2).replace('"__value__"', value)
    (tmp_path / "export.json").write_text(text)
    assert read_export_report(tmp_path / "export.json") is None


def test_reports_the_exporter_writes_still_read(tmp_path: Path) -> None:
    # A classifier's int8 report (calibration, no parity limit on the difference); a
    # detector's fp32 one (mAP 0 on an untrained model); an infinite detector difference, as
    # the exporter records it (`_finite_diff`).
    from visionloop.export.api import _finite_diff

    detector = _report(
        precision="fp32",
        metric="mAP",
        agreement_label="matched boxes (IoU ≥ 0.99)",
        output_label="output",
        accuracy=0.0,
        reference_accuracy=0.0,
        max_abs_diff=0.0,
        max_abs_diff_threshold=0.001,
        calibration_images=None,
        calibration_source=None,
    )
    unbounded = _report(precision="fp16", max_abs_diff=_finite_diff(float("inf")))
    for doc in (_report(), detector, unbounded):
        written = write_export_report_text(ExportReport.model_validate(doc))
        (tmp_path / "export.json").write_text(written)
        back = read_export_report(tmp_path / "export.json")
        assert back is not None and back.model_dump() == doc
