"""`export_model`: a registered version → ONNX (fp32, fp16 or int8), checked against eager
PyTorch and gated on the task's metric on the validation split (top-1 accuracy for
classification, mAP for detection: `GateMeasurement.metric`), stored with the version in the
registry."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from visionloop.core.fsutil import atomic_write_bytes, atomic_write_text
from visionloop.core.settings import Settings, load_settings
from visionloop.data.shards import ShardReader
from visionloop.export import convert
from visionloop.export.data import ModelDataset, open_model_dataset
from visionloop.export.embedding import (
    DEFAULT_COMPONENTS,
    MAX_FIT_IMAGES,
    Projection,
    WithEmbedding,
    collect_features,
    fit_projection,
)
from visionloop.export.report import (
    DEFAULT_PARITY,
    PRECISIONS,
    ExportError,
    ExportGateError,
    ExportReport,
    Format,
    Precision,
)
from visionloop.registry import ModelRef, ModelVersionInfo, get_version, record_export
from visionloop.registry.export_record import passing_export, write_export_report_text
from visionloop.registry.files import model_lock
from visionloop.registry.history import now_iso
from visionloop.registry.layout import EXPORT_REPORT_FILE, FAILED_EXPORT_REPORT_FILE, ONNX_FILE, export_dir
from visionloop.tasks import GateMeasurement
from visionloop.tasks.drift_outputs import EMBEDDING_OUTPUT

CARD_METADATA_KEY = "visionloop.model_card"
DEFAULT_CALIBRATION_SIZE = 256


def export_model(
    ref: str | ModelRef | ModelVersionInfo,
    *,
    fmt: Format = "onnx",
    precision: Precision = "fp32",
    threshold_points: float = 1.0,
    max_abs_diff: float | None = None,
    min_top1_agreement: float | None = None,
    calibration_size: int = DEFAULT_CALIBRATION_SIZE,
    calibration_images: torch.Tensor | None = None,
    dataset: Path | None = None,
    max_samples: int | None = None,
    exporter: convert.Exporter = "torchscript",
    embedding: bool = True,
    settings: Settings | None = None,
) -> ExportReport:
    """Export `ref` and gate it. Returns the report of a passed export; raises ExportGateError
    (after writing the failed report) when parity or accuracy is off.

    Parity: the largest raw-output difference from eager PyTorch and the task's agreement
    (the same top-1 class; the same boxes, one to one at IoU >= 0.99) on the validation
    images, thresholds per precision (`report.DEFAULT_PARITY`) unless given. Gate: the task's
    metric on the validation split (top-1 accuracy, mAP) may fall at most `threshold_points`
    (percentage points) below eager fp32 PyTorch's.
    int8 is calibrated on `calibration_size` training images, or on `calibration_images`
    (preprocessed, (N, C, H, W)) when given.
    With `embedding` (the default) and a task that has an embedding layer, the file has one
    more output, `embedding`: each image's penultimate-layer features reduced by a PCA fitted
    on the validation images (`export.embedding`), for drift monitoring and label selection.
    """
    started = time.monotonic()
    settings = settings or load_settings()
    if fmt != "onnx":
        raise ExportError(f"unknown export format {fmt!r}; the format supported is onnx.")
    if precision not in PRECISIONS:
        raise ExportError(f"unknown precision {precision!r}; use one of {', '.join(PRECISIONS)}.")
    # Checked up front, not only when the report is written: the report refuses what is not
    # finite or out of range (ExportReport), and would fail after the whole measurement.
    if not (math.isfinite(threshold_points) and threshold_points >= 0):
        raise ExportError(
            f"the allowed metric drop (--max-drop) must be >= 0 points, got {threshold_points}."
        )
    if max_abs_diff is not None and not (math.isfinite(max_abs_diff) and max_abs_diff >= 0):
        raise ExportError(f"--max-abs-diff must be a number >= 0, got {max_abs_diff}.")
    if min_top1_agreement is not None and not 0.0 <= min_top1_agreement <= 1.0:
        raise ExportError(f"--min-agreement must be a fraction between 0 and 1, got {min_top1_agreement}.")
    if calibration_size < 1:
        raise ExportError(f"--calibration-size must be at least 1, got {calibration_size}.")
    info = ref if isinstance(ref, ModelVersionInfo) else get_version(ref, settings)
    card = info.card()
    ds = open_model_dataset(info, dataset)
    split, reader = ds.eval_split()
    positions = list(range(len(reader) if max_samples is None else min(max_samples, len(reader))))
    task = ds.task
    # verified_weights_bytes: the weights must be the ones registered, or the export would carry
    # this version's name and weights_sha256 metadata for other weights; the model is built from
    # the bytes that were checked, not from the file opened again.
    model = task.export_module(task.load_model(card, info.verified_weights_bytes())).eval()
    # The task's parity limits for this precision (DEFAULT_PARITY holds a classifier's).
    default_diff, default_agree = task.parity_limits.get(
        precision, (DEFAULT_PARITY[precision].max_abs_diff, DEFAULT_PARITY[precision].min_top1_agreement)
    )
    diff_limit = max_abs_diff if max_abs_diff is not None else default_diff
    agree_limit = min_top1_agreement if min_top1_agreement is not None else default_agree
    out_dir = export_dir(info.dir, fmt, precision)

    projection = _embedding_projection(model, ds, reader, positions) if embedding else None
    exported: torch.nn.Module = model
    names = tuple(task.output_names)
    if projection is not None:
        layer = task.embedding_layer(model)
        assert layer is not None
        exported = WithEmbedding(model, layer, projection)
        names = (*names, EMBEDDING_OUTPUT)

    with tempfile.TemporaryDirectory(prefix="visionloop-export-") as tmp:
        work = Path(tmp)
        convert.export_fp32(
            exported, card.input_size, work / "fp32.onnx", exporter=exporter, output_names=names
        )
        built = work / "fp32.onnx"
        calibration_source: str | None = None
        n_calibration: int | None = None
        if precision == "fp16":
            built = work / "fp16.onnx"
            convert.to_fp16(work / "fp32.onnx", built)
        elif precision == "int8":
            if calibration_images is None:
                calibration_images = ds.calibration_images(calibration_size)
                calibration_source = f"{len(calibration_images)} training images of {ds.path}"
            else:
                calibration_source = "images given by the caller"
            n_calibration = len(calibration_images)
            built = work / "int8.onnx"
            convert.to_int8(work / "fp32.onnx", built, calibration_images, work)
        metadata = _metadata(info, precision, names)
        data = convert.set_metadata(built, metadata, doc=f"{info.ref} ({precision})")

        m = _measure(model, data, ds, reader, positions)
        parity_ok = m.agreement >= agree_limit and (diff_limit is None or m.max_abs_diff <= diff_limit)
        drop = m.drop_points
        gate_ok = drop <= threshold_points
        # A refused int8 export says what to export instead, which depends on this model.
        instead = (
            _instead_of_int8(
                info.ref, export_dir(info.dir, fmt, "fp16"), work / "fp32.onnx", work / "fp16-trial.onnx"
            )
            if precision == "int8" and not (parity_ok and gate_ok)
            else None
        )
    report = ExportReport(
        model=info.ref,
        format=fmt,
        precision=precision,
        path=str(out_dir / ONNX_FILE),
        sha256=hashlib.sha256(data).hexdigest(),
        size_bytes=len(data),
        opset=convert.OPSET if exporter == "torchscript" else max(convert.OPSET, 18),
        exporter=exporter,
        samples=m.samples,
        max_abs_diff=_finite_diff(m.max_abs_diff),
        top1_agreement=m.agreement,
        max_abs_diff_threshold=diff_limit,
        top1_agreement_threshold=agree_limit,
        parity_passed=parity_ok,
        accuracy=m.score,
        reference_accuracy=m.reference_score,
        drop_points=drop,
        threshold_points=threshold_points,
        gate_passed=gate_ok,
        calibration_images=n_calibration,
        calibration_source=calibration_source,
        dataset_path=str(ds.path),
        dataset_version=ds.manifest.version,
        split=split,
        passed=parity_ok and gate_ok,
        reason=None if parity_ok and gate_ok else _reason(parity_ok, gate_ok, m.metric),
        created_at=now_iso(),
        duration_s=round(time.monotonic() - started, 3),
        metric=m.metric,
        agreement_label=task.agreement_label,
        # One output called logits (a classifier), else the outputs at large (boxes, scores, ...).
        output_label="logit" if tuple(task.output_names) == ("logits",) else "output",
        embedding_dim=None if projection is None else projection.dim,
        embedding_variance=None if projection is None else round(projection.explained, 4),
    )
    kept = _store(out_dir, data, report)
    if kept:
        # A refused re-export: the earlier passing export stays, served and tagged as it was.
        raise ExportGateError(_failure_message(report, out_dir, kept=True, instead=instead), report)
    record_export(
        info,
        f"{fmt}-{precision}",
        {
            "precision": precision,
            "passed": str(report.passed).lower(),
            "accuracy": f"{report.accuracy:.6g}",
            "metric": report.metric,
            "drop_points": f"{report.drop_points:.4g}",
            "sha256": report.sha256 or "",
        },
        settings,
    )
    if not report.passed:
        raise ExportGateError(_failure_message(report, out_dir, instead=instead), report)
    return report


def _embedding_projection(
    model: torch.nn.Module, ds: ModelDataset, reader: ShardReader, positions: list[int]
) -> Projection | None:
    """The PCA of the task's embedding layer on the validation images, or None for a task (or
    an architecture) without one."""
    layer = ds.task.embedding_layer(model)
    if layer is None:
        return None
    fit = positions[:MAX_FIT_IMAGES]
    feats = collect_features(model, layer, (images for images, _ in ds.batches(reader, fit)))
    return fit_projection(feats, DEFAULT_COMPONENTS)


def _metadata(info: ModelVersionInfo, precision: str, output_names: Sequence[str]) -> dict[str, str]:
    card = info.card()
    return {
        CARD_METADATA_KEY: card.model_dump_json(),
        "visionloop.model": info.ref,
        "visionloop.precision": precision,
        "visionloop.input": convert.INPUT_NAME,
        "visionloop.output": ",".join(output_names),
        "visionloop.class_names": json.dumps(card.class_names),
        "visionloop.weights_sha256": info.tags.get("visionloop.weights_sha256", ""),
    }


def _measure(
    model: torch.nn.Module, onnx_bytes: bytes, ds: ModelDataset, reader: ShardReader, positions: list[int]
) -> GateMeasurement:
    """Run the same validation batches through eager PyTorch (fp32, the reference) and the
    exported model in ONNX Runtime; the task compares them."""
    import onnxruntime as ort

    session = ort.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    task = ds.task
    comparison = task.export_comparison()
    names = list(task.output_names)
    with torch.no_grad():
        for images, targets in ds.batches(reader, positions):
            reference = model(images)
            reference = list(reference) if isinstance(reference, tuple | list) else [reference]
            got = session.run(names, {convert.INPUT_NAME: images.numpy()})
            comparison.update(reference, [torch.from_numpy(g) for g in got], targets)
    m = comparison.result()
    if m.samples == 0:
        raise ExportError(f"{ds.path}: the validation split is empty; nothing to check the export on.")
    return m


def _finite_diff(diff: float) -> float:
    """The parity difference as the report records it: finite (a report refuses inf and NaN,
    which JSON cannot hold). A detector's difference is infinite when a box has no box of its
    class to pair with (`row_difference`); that is recorded as the largest float, which reads
    as 1.8e+308 and fails any limit, as inf did. The parity verdict is taken on `diff` itself."""
    return diff if math.isfinite(diff) else sys.float_info.max


def _reason(parity_ok: bool, gate_ok: bool, metric: str = "accuracy") -> str:
    reasons = []
    if not parity_ok:
        reasons.append("parity with eager PyTorch is off")
    if not gate_ok:
        reasons.append(f"{metric} dropped more than allowed")
    return "; ".join(reasons)


def _store(out_dir: Path, data: bytes, report: ExportReport) -> bool:
    """The model file, then its report (a reader trusts the model only through a passed report
    whose size matches, and runs only bytes whose sha256 matches: `read_passing_export`). A
    failed export keeps only its report, so it can never be served — except that a refused
    re-export never destroys an earlier export that passed: that one stays, and the refusal
    goes to FAILED_EXPORT_REPORT_FILE beside it. Returns whether an earlier passing export was
    kept that way."""
    out_dir.mkdir(parents=True, exist_ok=True)
    text = write_export_report_text(report)
    with model_lock(out_dir):
        if not report.passed and passing_export(out_dir) is not None:
            atomic_write_text(out_dir / FAILED_EXPORT_REPORT_FILE, text)
            return True
        if report.passed:
            atomic_write_bytes(out_dir / ONNX_FILE, data)
        else:
            with contextlib.suppress(FileNotFoundError):
                (out_dir / ONNX_FILE).unlink()
        atomic_write_text(out_dir / EXPORT_REPORT_FILE, text)
        with contextlib.suppress(FileNotFoundError):
            (out_dir / FAILED_EXPORT_REPORT_FILE).unlink()  # superseded by this attempt
        return False


def _instead_of_int8(ref: str, fp16_dir: Path, fp32: Path, trial: Path) -> str:
    """What to export when `ref`'s int8 export is refused: its fp16 export (in `fp16_dir`) if
    one passed; else fp16 if its graph converts (tried on `fp32`, written to `trial`); else fp32."""
    passed = passing_export(fp16_dir)
    if passed is not None:
        return f"serve the fp16 export, which passed ({passed})"
    try:
        convert.to_fp16(fp32, trial)
    except convert.Fp16ConversionError as e:
        return f"export fp32 instead (`visionloop export {ref}`): fp16 is not possible, {e.reason}"
    return f"export fp16 instead (`visionloop export {ref} --precision fp16`), whose graph converts"


def _failure_message(
    r: ExportReport, out_dir: Path, *, kept: bool = False, instead: str | None = None
) -> str:
    """The refusal, for a person. `instead` (int8): what to export instead, from `_instead_of_int8`."""
    lines = [f"{r.model} {r.format}-{r.precision} export refused: {r.reason}."]
    if kept:
        lines.append(
            f"  The earlier {r.precision} export, which passed, is kept and still served "
            f"({out_dir / ONNX_FILE})."
        )
    within = "more than" if not r.gate_passed else "within"
    lines.append(
        f"  {r.metric} {r.accuracy:.2%} against {r.reference_accuracy:.2%} for fp32 PyTorch on "
        f"{r.samples} {r.split} images: a drop of {r.drop_points:.2f} points, "
        f"{within} the {r.threshold_points:g} allowed (--max-drop)."
    )
    if not r.parity_passed:
        limit = "not checked" if r.max_abs_diff_threshold is None else f"limit {r.max_abs_diff_threshold:g}"
        lines.append(
            f"  max |{r.output_label} diff| {r.max_abs_diff:.4g} ({limit}), {r.agreement_label} "
            f"{r.top1_agreement:.2%} "
            f"(limit {r.top1_agreement_threshold:.2%})."
        )
    hint = {
        "int8": "calibrate on more images (--calibration-size), or "
        + (instead or "export fp16 or fp32 instead"),
        "fp16": "export fp32 instead, or allow more (--max-drop)",
        "fp32": "the exporter changed the model's behaviour; try --exporter dynamo",
    }[r.precision]
    report_file = FAILED_EXPORT_REPORT_FILE if kept else EXPORT_REPORT_FILE
    lines.append(f"  Report: {out_dir / report_file}. What to do: {hint}.")
    return "\n".join(lines)
