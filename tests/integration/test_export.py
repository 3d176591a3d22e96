"""ONNX export through real ONNX Runtime: parity for several architectures, the dynamic batch
axis, the model card in the metadata, and the accuracy gate on a really trained model (fp16 and
int8 pass; int8 calibrated on constant images is refused and never served)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from _modelkit import ModelKit, onnx_model, registered_model  # noqa: F401  (session fixtures)
from _trainkit import cli
from visionloop.core.errors import DataError
from visionloop.export import (
    CARD_METADATA_KEY,
    ExportError,
    ExportGateError,
    ExportReport,
    convert,
    export_model,
)
from visionloop.export.data import open_model_dataset
from visionloop.models import registry as archs
from visionloop.models.card import ModelCard
from visionloop.registry import store as rstore
from visionloop.registry.files import sha256_file


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize(("arch", "size"), [("small_cnn", 16), ("resnet18", 32), ("mobilenet_v3_small", 32)])
def test_fp32_parity_and_dynamic_batch_per_architecture(arch: str, size: int, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = archs.create_model(arch, 5).eval()
    path = tmp_path / "m.onnx"
    convert.export_fp32(model, (3, size, size), path)
    onnx.checker.check_model(str(path))
    assert onnx.load(str(path)).opset_import[0].version >= 17
    session = _session(path)
    (inp,) = session.get_inputs()
    assert inp.name == "input" and inp.shape[0] == "batch" and inp.shape[1:] == [3, size, size]
    for batch in (1, 7):
        x = torch.randn(batch, 3, size, size)
        got = session.run(["logits"], {"input": x.numpy()})[0]
        with torch.no_grad():
            want = model(x).numpy()
        assert got.shape == (batch, 5)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_fp32_export_of_the_trained_model(onnx_model: ModelKit) -> None:  # noqa: F811
    kit = onnx_model
    info = kit.info()
    path = info.export_path("onnx", "fp32")
    assert path == info.dir / "exports" / "onnx-fp32" / "model.onnx"
    report = json.loads((path.parent / "export.json").read_text())
    assert report["passed"] and report["parity_passed"] and report["gate_passed"]
    assert report["sha256"] == sha256_file(path) and report["size_bytes"] == path.stat().st_size
    assert report["max_abs_diff"] < 1e-3 and report["top1_agreement"] == 1.0
    assert report["accuracy"] == report["reference_accuracy"] and report["drop_points"] == 0.0
    card = info.card()
    manifest = open_model_dataset(info).manifest
    assert report["samples"] == manifest.splits["val"].count  # the whole validation split
    assert report["dataset_version"] == card.dataset_version
    # The reference accuracy is the trainer's own validation accuracy, recomputed.
    assert card.metrics is not None
    assert report["reference_accuracy"] == pytest.approx(card.metrics["accuracy"], abs=1e-6)

    session = _session(path)
    meta = session.get_modelmeta().custom_metadata_map
    assert ModelCard.model_validate_json(meta[CARD_METADATA_KEY]) == card
    assert json.loads(meta["visionloop.class_names"]) == card.class_names
    assert meta["visionloop.model"] == "digits/1" and meta["visionloop.precision"] == "fp32"

    ds = open_model_dataset(info)
    _, reader = ds.eval_split()
    images, _ = next(ds.batches(reader, list(range(7))))
    model = card.create_model(info.weights).eval()
    with torch.no_grad():
        want = model(images).numpy()
    for batch in (1, 7):
        got = session.run(["logits"], {"input": images[:batch].numpy()})[0]
        np.testing.assert_allclose(got, want[:batch], atol=1e-4)

    tags = rstore.client(kit.settings).get_model_version("digits", "1").tags
    assert tags["visionloop.export.onnx-fp32.passed"] == "true"
    assert tags["visionloop.export.onnx-fp32.sha256"] == report["sha256"]


def test_fp16_and_int8_of_the_trained_model_pass_the_gate(onnx_model: ModelKit, tmp_path: Path) -> None:  # noqa: F811
    kit = onnx_model.copy_home(tmp_path / "home")
    fp16 = export_model(kit.ref, precision="fp16", settings=kit.settings)
    int8 = export_model(kit.ref, precision="int8", calibration_size=128, settings=kit.settings)
    info = kit.info()
    for report in (fp16, int8):
        assert report.passed and report.drop_points <= 1.0
        assert report.reference_accuracy > 0.9
        assert report.accuracy >= report.reference_accuracy - 0.01
        path = info.export_path("onnx", report.precision)
        assert path is not None and str(path) == report.path and sha256_file(path) == report.sha256
        session = _session(path)
        # Clients send and receive fp32 whatever the precision inside.
        assert session.get_inputs()[0].type == "tensor(float)"
        assert session.get_outputs()[0].type == "tensor(float)"
        assert session.get_inputs()[0].shape[0] == "batch"
    assert fp16.max_abs_diff < 0.1
    assert int8.calibration_images == 128 and int8.top1_agreement >= 0.9
    ops = {n.op_type for n in onnx.load(int8.path).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert info.export_path("onnx", "fp32") is not None  # earlier exports stay

    # A refused re-export never destroys the export that passed: it stays, served and tagged.
    with pytest.raises(ExportGateError) as caught:
        export_model(
            kit.ref, precision="int8", calibration_images=torch.zeros(64, 3, 16, 16), settings=kit.settings
        )
    assert "earlier int8 export, which passed, is kept and still served" in str(caught.value)
    kept = kit.info().export_path("onnx", "int8")
    assert kept is not None and sha256_file(kept) == int8.sha256
    folder = kept.parent
    refused = json.loads((folder / "export.failed.json").read_text())
    assert refused["passed"] is False and refused["accuracy"] == caught.value.report.accuracy
    assert json.loads((folder / "export.json").read_text())["sha256"] == int8.sha256
    tags = rstore.client(kit.settings).get_model_version("digits", str(kit.version)).tags
    assert tags["visionloop.export.onnx-int8.passed"] == "true"
    # `models show` names both: the kept export that passed, and the refusal beside it.
    info = kit.info()
    assert info.exports()["onnx-int8"].sha256 == int8.sha256
    assert info.exports(refused_reexports=True) == {"onnx-int8": ExportReport.model_validate(refused)}
    r = cli("models", "show", kit.ref, env=kit.env())
    assert r.returncode == 0, r.stderr
    (kept_row,) = [
        line for line in r.stdout.splitlines() if line.strip("│ ").startswith("onnx-int8") and "yes" in line
    ]
    (refused_row,) = [line for line in r.stdout.splitlines() if "re-export refused" in line]
    assert f"{int8.accuracy:.2%}" in kept_row
    assert "onnx-int8" in refused_row and f"{refused['accuracy']:.2%}" in refused_row
    r = cli("models", "show", kit.ref, "--json", env=kit.env())
    assert json.loads(r.stdout)["refused_reexports"]["onnx-int8"]["passed"] is False


def test_int8_with_broken_calibration_is_refused_and_never_served(
    registered_model: ModelKit,  # noqa: F811
    tmp_path: Path,
) -> None:
    kit = registered_model.copy_home(tmp_path / "home")
    constant = torch.zeros(64, 3, 16, 16)  # every activation range collapses to a point
    with pytest.raises(ExportGateError) as caught:
        export_model(kit.ref, precision="int8", calibration_images=constant, settings=kit.settings)
    report = caught.value.report
    assert not report.passed and not report.gate_passed
    assert report.drop_points > 1.0
    message = str(caught.value)
    assert f"accuracy {report.accuracy:.2%} against {report.reference_accuracy:.2%}" in message
    assert re.search(r"a drop of \d+\.\d\d points, more than the 1 allowed", message)
    info = kit.info()
    assert info.export_path("onnx", "int8") is None
    folder = info.dir / "exports" / "onnx-int8"
    assert not (folder / "model.onnx").exists()
    on_disk = json.loads((folder / "export.json").read_text())
    assert on_disk["passed"] is False and on_disk["accuracy"] == report.accuracy
    assert on_disk["calibration_source"] == "images given by the caller"
    tags = rstore.client(kit.settings).get_model_version("digits", "1").tags
    assert tags["visionloop.export.onnx-int8.passed"] == "false"


def test_bad_requests_are_refused_with_the_fix(registered_model: ModelKit, tmp_path: Path) -> None:  # noqa: F811
    kit = registered_model
    with pytest.raises(ExportError, match=r"unknown precision 'int4'; use one of fp32, fp16, int8"):
        export_model(kit.ref, precision="int4", settings=kit.settings)  # type: ignore[arg-type]
    with pytest.raises(ExportError, match=r"must be >= 0 points"):
        export_model(kit.ref, threshold_points=-1, settings=kit.settings)
    # Another version of the dataset: its images would not measure the same model.
    other = tmp_path / "other-ds"
    shutil.copytree(kit.dataset, other)
    manifest = json.loads((other / "dataset.json").read_text())
    manifest["version"] = "0" * 64
    (other / "dataset.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=r"dataset version 000000000000, but digits/1 was trained on"):
        export_model(kit.ref, dataset=other, settings=kit.settings)
    assert kit.info().exports() == {}  # nothing written for refused requests
