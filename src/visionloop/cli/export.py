"""`visionloop export MODEL`: ONNX export with a parity check and a gate on the task's metric
(top-1 accuracy for a classifier, mAP for a detector)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, cast

import typer

from visionloop.cli.console import err, out

if TYPE_CHECKING:
    from visionloop.export.convert import Exporter


def export(
    model: str = typer.Argument(
        ..., help="NAME (the champion, else the newest), NAME@ALIAS or NAME/VERSION."
    ),
    fmt: str = typer.Option("onnx", "--format", "-f", help="Export format: onnx."),
    precision: str = typer.Option("fp32", "--precision", "-p", help="fp32, fp16 or int8."),
    max_drop: float = typer.Option(
        1.0,
        "--max-drop",
        help="Refuse the export if the validation metric (top-1 accuracy, mAP) falls more than this many "
        "points.",
    ),
    max_abs_diff: float | None = typer.Option(
        None,
        "--max-abs-diff",
        help="Largest allowed |output difference| (logits; boxes, scores) from PyTorch (default per "
        "precision).",
    ),
    min_agreement: float | None = typer.Option(
        None,
        "--min-agreement",
        help="Smallest allowed agreement with PyTorch (same top-1 class; matched boxes), 0-1 (default "
        "per precision).",
    ),
    calibration_size: int = typer.Option(
        256, "--calibration-size", help="int8: training images to calibrate on."
    ),
    dataset: Path | None = typer.Option(
        None, "--dataset", help="The model's dataset, if it moved since training (must be the same version)."
    ),
    exporter: str = typer.Option("torchscript", "--exporter", help="torchscript (default) or dynamo."),
    embedding: bool = typer.Option(
        True,
        "--embedding/--no-embedding",
        help="Add the `embedding` output (penultimate layer, 16 PCA components fitted on the "
        "validation images), which `visionloop monitor` tests for drift.",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the export report as JSON."),
) -> None:
    """Export a registered model to ONNX (fp32, fp16 or int8) behind a parity check and a metric gate.

    The export is compared with eager PyTorch on the model's validation images and stored with
    the model version. One that fails the check keeps its report (export.json), is never
    served, and the command exits 1 printing both scores (accuracy, or mAP).
    """
    from visionloop.export import PRECISIONS, ExportError, export_model

    if fmt != "onnx":
        raise ExportError(f"--format {fmt!r} is not supported; use --format onnx.")
    if precision not in PRECISIONS:
        raise ExportError(f"--precision {precision!r} is not supported; use one of {', '.join(PRECISIONS)}.")
    if exporter not in ("torchscript", "dynamo"):
        raise ExportError(f"--exporter {exporter!r} is not supported; use torchscript or dynamo.")
    if not as_json:
        err.print(f"exporting {model} to {fmt}-{precision} and checking it on the validation images ...")
    report = export_model(
        model,
        fmt="onnx",
        precision=precision,
        threshold_points=max_drop,
        max_abs_diff=max_abs_diff,
        min_top1_agreement=min_agreement,
        calibration_size=calibration_size,
        dataset=dataset,
        exporter=cast("Exporter", exporter),
        embedding=embedding,
    )
    if as_json:
        typer.echo(json.dumps(report.model_dump(mode="json"), indent=2))
        return
    out.print(report.summary())
    from visionloop.bench.table import human_bytes  # the units bench and `models show` print

    out.print(f"  file     {report.path} ({human_bytes(report.size_bytes)}, sha256 {report.sha256})")
    if report.embedding_dim is not None:
        kept = (
            "" if report.embedding_variance is None else f", {report.embedding_variance:.0%} of the variance"
        )
        out.print(f"  embedding output: {report.embedding_dim} PCA components of the penultimate layer{kept}")
