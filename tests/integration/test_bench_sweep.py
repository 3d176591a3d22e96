"""A real sweep on a real trained, registered model: eager PyTorch and ONNX Runtime on CPU,
the table, the JSON file and the plot; CUDA rows and unusable exports become rows that say why.

The fp32 ONNX export is the real exporter's (`_modelkit.onnx_model`); the int8 one that
failed its gate, and a corrupt one, are made here with torch.onnx.export and laid out as the
registry expects (exports/onnx-<precision>/model.onnx + export.json).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from rich.console import Console

from _modelkit import ModelKit, onnx_model, registered_model  # noqa: F401  (session fixtures)
from visionloop.bench import (
    BenchResult,
    result_table,
    run_sweep,
    sweep_settings,
    target_from_dir,
    target_from_version,
    write_result,
)
from visionloop.bench.evalset import load_eval_set
from visionloop.registry.export_record import ExportReport
from visionloop.registry.layout import ONNX_FILE, export_dir

BATCHES = (1, 4)
# The legacy (TorchScript) exporter takes dynamic_axes without onnxscript's graph rewriting;
# its deprecation notice is not what these tests are about.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def export_onnx(version_dir: Path, precision: str = "fp32", *, passed: bool = True) -> Path:
    """An fp32 ONNX graph with a dynamic batch axis, with an export.json like the exporter's."""
    from visionloop.models.card import ModelCard

    card = ModelCard.load(version_dir)
    model = card.create_model(version_dir / "final.safetensors").eval()
    out = export_dir(version_dir, "onnx", precision)
    out.mkdir(parents=True, exist_ok=True)
    path = out / ONNX_FILE
    torch.onnx.export(
        model,
        (torch.zeros(2, *card.input_size),),
        str(path),
        input_names=["input"],
        output_names=["logits"],
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        dynamo=False,
    )
    drop = 0.0 if passed else 5.0
    report = ExportReport(
        model=f"{version_dir.name}/1",
        format="onnx",
        precision=precision,
        path=str(path),
        sha256=hashlib.sha256(path.read_bytes()).hexdigest(),  # bench loads only the bytes it names
        size_bytes=path.stat().st_size,
        opset=17,
        exporter="torchscript",
        samples=1,
        max_abs_diff=0.0,
        top1_agreement=1.0,
        max_abs_diff_threshold=None,
        top1_agreement_threshold=0.9,
        parity_passed=True,
        accuracy=1.0 - drop / 100,
        reference_accuracy=1.0,
        drop_points=drop,
        threshold_points=1.0,
        gate_passed=passed,
        dataset_path="",
        dataset_version=None,
        split="val",
        passed=passed,
        created_at="2026-01-01T00:00:00+00:00",
        duration_s=0.0,
    )
    (out / "export.json").write_text(report.model_dump_json())
    return path


@pytest.fixture(scope="module")
def swept(
    onnx_model: ModelKit,  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[ModelKit, BenchResult]:
    kit = onnx_model.copy_home(tmp_path_factory.mktemp("bench") / "home")
    vdir = kit.info().dir
    assert kit.info().export_path("onnx", "fp32") is not None  # the exporter's, gate passed
    export_onnx(vdir, "int8", passed=False)  # exists, but failed its accuracy gate
    settings = sweep_settings(
        formats="pytorch,onnx",
        precisions="fp32,fp16,int8",
        devices="cpu,cuda",
        batch_sizes=BATCHES,
        iterations=5,
        warmup=1,
    )
    return kit, run_sweep(target_from_version(kit.info()), settings)


def _row(result: BenchResult, fmt: str, precision: str, device: str = "cpu"):  # type: ignore[no-untyped-def]
    (row,) = [c for c in result.configs if (c.format, c.precision, c.device) == (fmt, precision, device)]
    return row


def test_every_configuration_is_a_row_in_a_fixed_order(swept: tuple[ModelKit, BenchResult]) -> None:
    _, result = swept
    assert [(c.device, c.format, c.precision) for c in result.configs] == [
        (d, f, p) for d in ("cpu", "cuda") for f in ("pytorch", "onnx") for p in ("fp32", "fp16", "int8")
    ]
    assert result.model == "digits/1" and (result.name, result.version) == ("digits", 1)
    assert result.arch == "small_cnn" and result.input_size == (3, 16, 16)


def test_measured_rows_have_consistent_latency_numbers(swept: tuple[ModelKit, BenchResult]) -> None:
    _, result = swept
    for fmt in ("pytorch", "onnx"):
        row = _row(result, fmt, "fp32")
        assert row.status == "ok", row.status_text
        assert [p.batch_size for p in row.points] == list(BATCHES)
        for p in row.points:
            assert p.iterations == 5
            assert 0 < p.p50_ms <= p.p90_ms <= p.p99_ms <= p.max_ms
            # throughput = batch * calls / total time, and total time = calls * mean
            assert p.throughput_ips == pytest.approx(p.batch_size * 1000.0 / p.mean_ms, rel=1e-6)
            # The model's weights are resident above the RSS taken before it loaded; onnx runs
            # after pytorch freed its memory, which must not hide onnx's own (it read ~0 B when
            # glibc kept the freed pages and onnx reused them).
            assert p.peak_memory_bytes is not None and p.peak_memory_bytes >= (row.size_bytes or 0)
        assert row.memory_kind == "rss"
        assert row.size_bytes == Path(row.model_path or "").stat().st_size
    assert _row(result, "onnx", "fp32").provider == "CPUExecutionProvider"
    assert _row(result, "pytorch", "fp32").provider == "torch-cpu"


def test_accuracy_is_the_validation_accuracy_for_every_runtime(swept: tuple[ModelKit, BenchResult]) -> None:
    kit, result = swept
    card = kit.info().card()
    evalset = load_eval_set(card, kit.dataset, max_images=None)
    model = card.create_model(kit.info().weights).eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(evalset.images)).numpy()
    expected = float((logits.argmax(1) == evalset.labels).mean())
    assert result.eval_images == len(evalset.labels) > 0
    assert "[val]" in (result.eval_source or "")
    torch_row, onnx_row = _row(result, "pytorch", "fp32"), _row(result, "onnx", "fp32")
    assert torch_row.accuracy == pytest.approx(expected)
    assert torch_row.eval_images == len(evalset.labels)
    # the trainer's own last evaluation of the same split: same images, same preprocessing
    assert torch_row.accuracy == pytest.approx(card.metrics["accuracy"])  # type: ignore[index]
    # ONNX Runtime may flip a near-tie between two classes, nothing more
    assert abs((onnx_row.accuracy or 0) - expected) <= 1 / len(evalset.labels)


def test_rows_that_cannot_run_say_why(swept: tuple[ModelKit, BenchResult]) -> None:
    _, result = swept
    fp16 = _row(result, "onnx", "fp16")
    assert fp16.status_text == (
        "skipped: no onnx fp16 export; make one with `visionloop export digits/1 --precision fp16`"
    )
    gated = _row(result, "onnx", "int8")
    assert (
        gated.status_text
        == "skipped: onnx int8 export failed its accuracy gate (accuracy drop 5.00 points > 1.00)"
    )
    assert _row(result, "pytorch", "int8").status == "skipped"
    assert "ONNX Runtime quantized export" in (_row(result, "pytorch", "int8").reason or "")
    for row in (fp16, gated):
        assert row.points == [] and row.accuracy is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the rows of a machine without a GPU")
def test_cuda_rows_are_skipped_without_a_gpu(swept: tuple[ModelKit, BenchResult]) -> None:
    _, result = swept
    cuda = [c for c in result.configs if c.device == "cuda"]
    assert len(cuda) == 6
    for row in cuda:
        assert row.status == "skipped"
        assert row.reason == "no CUDA GPU on this machine (torch.cuda.is_available() is False)"


@pytest.mark.gpu
def test_cuda_rows_run_on_a_gpu(swept: tuple[ModelKit, BenchResult]) -> None:
    _, result = swept
    torch_row = _row(result, "pytorch", "fp32", "cuda")
    assert torch_row.status == "ok", torch_row.status_text
    assert torch_row.memory_kind == "cuda" and torch_row.provider == "torch-cuda"
    assert [p.batch_size for p in torch_row.points] == list(BATCHES)
    assert torch_row.accuracy == pytest.approx(_row(result, "pytorch", "fp32").accuracy, abs=0.01)
    half = _row(result, "pytorch", "fp16", "cuda")
    assert half.status == "ok", half.status_text
    onnx_row = _row(result, "onnx", "fp32", "cuda")
    # onnxruntime without the CUDA provider is a skip that says so, never a silent CPU run
    if onnx_row.status == "skipped":
        assert "CUDAExecutionProvider" in (onnx_row.reason or "")
    else:
        assert onnx_row.status == "ok" and onnx_row.provider == "CUDAExecutionProvider"


def test_table_json_and_plot(swept: tuple[ModelKit, BenchResult], tmp_path: Path) -> None:
    _, result = swept
    console = Console(record=True, width=260)
    console.print(result_table(result))
    text = console.export_text()
    header = next(line for line in text.splitlines() if "format" in line)
    for column in (
        "format",
        "precision",
        "device",
        "status",
        "size",
        "top-1",  # the accuracy column is named by the task's metric label (mAP for a detector)
        "batch",
        "p50",
        "p90",
        "p99",
    ):
        assert column in header
    assert "images/s" in header
    assert result.metric == "top-1"
    assert "skipped: no onnx fp16 export" in text
    ok_lines = [line for line in text.splitlines() if "│ ok " in line]
    assert len(ok_lines) == 2  # pytorch fp32 and onnx fp32, on their first batch size's line

    written = write_result(result, tmp_path / "out", budget_ms=50.0)
    again = BenchResult.model_validate_json(written["result"].read_text())
    assert again == result
    with Image.open(written["plot"]) as png:
        assert png.format == "PNG" and png.size == (800, 500)
        pixels = np.asarray(png.convert("L"))
    assert pixels.std() > 10  # lines and labels drawn, not a blank canvas


def test_a_corrupt_export_is_a_failed_row_and_the_sweep_goes_on(
    registered_model: ModelKit,  # noqa: F811
    tmp_path: Path,
) -> None:
    kit = registered_model.copy_home(tmp_path / "home")
    vdir = kit.info().dir
    path = export_onnx(vdir, "fp32")
    path.write_bytes(
        b"not an onnx graph".ljust(path.stat().st_size, b"\0")
    )  # same size: the gate still holds
    # ... and the dataset it was trained on has since been deleted
    target = target_from_dir(vdir, dataset=tmp_path / "deleted-dataset")
    settings = sweep_settings(formats="onnx,pytorch", precisions="fp32", batch_sizes="2", iterations=2)
    result = run_sweep(target, settings)
    onnx_row, torch_row = result.configs
    assert onnx_row.status == "failed"
    assert (onnx_row.reason or "").startswith("could not load: ")
    assert "is not the file the export gate passed (sha256" in (onnx_row.reason or "")
    assert torch_row.status == "ok" and [p.batch_size for p in torch_row.points] == [2]
    assert torch_row.accuracy is None and result.eval_images == 0
    assert result.eval_source == (
        f"none: the training dataset {tmp_path / 'deleted-dataset'} is gone; give one with --dataset DIR"
    )
