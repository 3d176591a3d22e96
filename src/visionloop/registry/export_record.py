"""The export record: the one typed report that export writes (`exports/<format>-<precision>/
export.json`) and the registry, bench, serve and the CLI read.

It lives here, below `export/` in the package order, because the registry decides from it
whether an export may be served (`passing_export`); `visionloop.export` re-exports it.
A file that is missing, unreadable or not a valid record reads as None: never served.

`read_passing_export` is how a passing export's model is read to be run (serve, bench): its
bytes once, checked against the sha256 the report recorded, handed to ONNX Runtime as bytes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from visionloop.core.errors import VisionloopError
from visionloop.core.fsutil import NotRegularFileError, TooLargeError, read_capped
from visionloop.registry.layout import EXPORT_REPORT_FILE, ONNX_FILE

# A report is about 1 kB.
MAX_REPORT_BYTES = 1 * 2**20
Precision = Literal["fp32", "fp16", "int8"]
Format = Literal["onnx"]


# Non-finite floats are refused (`allow_inf_nan=False`), and each number is held to its range:
# a report is read to decide whether to serve a file, and `accuracy: NaN` beside `passed: true`
# must read as no report (never served), not as a pass. What export writes always fits: its
# metrics are fractions (top-1 accuracy and agreement, COCO mAP, 0 where undefined), its own
# arguments are checked up front (`export_model`), and a parity difference it could not bound
# is written as the largest float (`export.api._finite_diff`). pydantic would otherwise write
# inf and NaN as null, which reads back as no report at all.
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
NonNegative = Annotated[float, Field(ge=0.0)]
# sha256 hex digest, as hashlib writes it.
SHA256_PATTERN = r"^[0-9a-f]{64}$"


class ExportReport(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str = Field(description="NAME/VERSION")
    format: Format
    precision: Precision
    path: str
    # Always written by the exporter; None only in hand-made reports, which are never served
    # (`read_passing_export` refuses them).
    sha256: Annotated[str, Field(pattern=SHA256_PATTERN)] | None
    size_bytes: Annotated[int, Field(ge=0)] | None
    opset: int = Field(ge=1)
    exporter: str
    # parity with eager PyTorch (fp32) on the evaluation images; `top1_agreement` is the task's
    # agreement (`GateMeasurement.agreement`): the same top-1 class for classification, the
    # same boxes (one to one, IoU >= 0.99) for detection; `agreement_label` says which
    samples: int = Field(ge=0)
    max_abs_diff: NonNegative
    top1_agreement: Fraction
    max_abs_diff_threshold: NonNegative | None
    top1_agreement_threshold: Fraction
    parity_passed: bool
    # the gate, on the task's gate metric (`GateMeasurement.metric`, named by `metric`): top-1
    # accuracy for classification, mAP for detection; the field names stay for old readers
    accuracy: Fraction
    reference_accuracy: Fraction
    drop_points: float = Field(ge=-100.0, le=100.0, description="(reference - exported accuracy) x 100")
    threshold_points: NonNegative
    gate_passed: bool
    # int8 only
    calibration_images: Annotated[int, Field(ge=0)] | None = None
    calibration_source: str | None = None
    dataset_path: str
    dataset_version: str | None
    split: str
    passed: bool
    reason: str | None = None
    created_at: str
    duration_s: NonNegative
    # Defaults: what every report written before detection measured.
    metric: str = Field("accuracy", description="what accuracy and reference_accuracy hold: accuracy, mAP")
    agreement_label: str = Field("top-1 agreement", description="what top1_agreement counts")
    output_label: str = Field("logit", description="what max_abs_diff is the difference of")
    # The `embedding` output (export.embedding): its PCA dimensions and the share of the
    # features' variance they keep; None for an export without one.
    embedding_dim: Annotated[int, Field(ge=1)] | None = None
    embedding_variance: Fraction | None = None

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (
            f"{self.model} {self.format}-{self.precision} {verdict}: {self.metric} {self.accuracy:.2%} vs "
            f"{self.reference_accuracy:.2%} fp32 PyTorch (drop {self.drop_points:.2f} points, allowed "
            f"{self.threshold_points:g}); max |{self.output_label} diff| {self.max_abs_diff:.3g}, "
            f"{self.agreement_label} {self.top1_agreement:.2%} on {self.samples} {self.split} images"
        )


def read_export_report(path: Path) -> ExportReport | None:
    """The record at `path`; None when it is missing, unreadable or not a valid record."""
    try:
        # read_capped: a FIFO as export.json used to hang `models show`, the server and bench,
        # all of which ask whether an export passed.
        data = read_capped(path, MAX_REPORT_BYTES, what="an export report")
        return ExportReport.model_validate_json(data)
    except (OSError, TooLargeError, ValidationError):
        return None


def passing_export(folder: Path) -> Path | None:
    """The model file of the export in `folder` if its report says it passed its gate and the
    file has the size the gate measured; else None.

    Cheap on purpose: `models show`, `models list`, bench's targets (a registered version or
    a bare folder) and the server's resolver ask it for every version and precision, and
    hashing a 45 MB file each time is not acceptable. The size catches a truncated or
    half-copied file; a file replaced by another of the same size is caught where its bytes are
    loaded to run (`read_passing_export`), which is also the only place the check can be made
    without a window between check and use."""
    report = read_export_report(folder / EXPORT_REPORT_FILE)
    if report is None or not report.passed:
        return None
    model = folder / ONNX_FILE
    try:
        size = model.stat().st_size
    except OSError:
        return None
    return model if report.size_bytes == size else None


def write_export_report_text(report: ExportReport) -> str:
    """The record as written to disk (indented JSON and a final newline)."""
    return report.model_dump_json(indent=2) + "\n"


class UnservableExportError(VisionloopError):
    """An export's file may not be run: its report is missing or failed, or the file is not
    the one its gate passed (missing, replaced, unreadable). The message says what to re-export."""


# An ONNX model is one protobuf message, which protobuf caps at 2 GiB; a larger model keeps its
# weights in external data files, which visionloop's exporter never writes. (No ONNX cap existed
# before: ONNX Runtime read the files from their path.)
MAX_ONNX_BYTES = 2 * 2**30


def read_passing_export(folder: Path, *, ref: str | None = None) -> bytes:
    """The bytes of the export in `folder`, read once and checked against the sha256 (and size)
    its passing report recorded: what the server and bench hand to ONNX Runtime, so the session
    runs exactly the bytes the gate measured. Giving ORT the path instead would leave a window
    between this check and ORT's own read in which the file could be swapped.

    Raises UnservableExportError naming the file, what is wrong with it and the re-export to run.
    `ref` (NAME/VERSION) is for the messages; by default the report's own."""
    report_file = folder / EXPORT_REPORT_FILE
    model = folder / ONNX_FILE
    report = read_export_report(report_file)
    name = ref or (report.model if report is not None else "NAME/VERSION")
    precision = report.precision if report is not None else folder.name.partition("-")[2] or "fp32"
    again = f"Re-export it with `visionloop export {name} --precision {precision}`."
    if report is None:
        raise UnservableExportError(f"{report_file} is missing or not a valid export report. {again}")
    if not report.passed:
        raise UnservableExportError(
            f"{model}: its export failed its gate ({report.reason or 'see ' + str(report_file)}) and "
            f"is never served. {again}"
        )
    if report.sha256 is None:
        # Every report the exporter wrote records it (it has since the first export), so this
        # one was made or edited by hand: nothing says which file the gate passed.
        raise UnservableExportError(
            f"{report_file} records no sha256 for {model}, so it cannot be checked. {again}"
        )
    data = _read_onnx(model, again)
    if report.size_bytes is not None and len(data) != report.size_bytes:
        why = f"{len(data)} bytes, the export gate passed {report.size_bytes}"
    else:
        sha = hashlib.sha256(data).hexdigest()
        if sha == report.sha256:
            return data
        # A re-export that landed between our read of the report and of the file (the
        # exporter writes the file, then the report): the bytes may be the new report's.
        newer = read_export_report(report_file)
        if newer is not None and newer != report and newer.passed and newer.sha256 == sha:
            return data
        why = f"sha256 {sha[:16]}..., the export gate passed {report.sha256[:16]}..."
    raise UnservableExportError(
        f"{model} is not the file the export gate passed ({why}): it was changed or replaced "
        f"after export. {again}"
    )


def _read_onnx(model: Path, again: str) -> bytes:
    """The file's bytes, at most MAX_ONNX_BYTES; read_capped: a FIFO, device or folder in its
    place is refused, not waited on or read for ever."""
    try:
        return read_capped(model, MAX_ONNX_BYTES, what="an ONNX model")
    except FileNotFoundError as e:
        raise UnservableExportError(f"{model} is missing. {again}") from e
    except NotRegularFileError as e:
        raise UnservableExportError(f"{e}. {again}") from e  # "<path> is a FIFO (named pipe), not a ..."
    except OSError as e:
        raise UnservableExportError(f"{model} cannot be read: {e.strerror or e}. {again}") from e
    except TooLargeError as e:
        if e.size is None:  # it grew since its size was read
            raise UnservableExportError(f"{model} is over {MAX_ONNX_BYTES // 2**30} GiB. {again}") from e
        raise UnservableExportError(
            f"{model} is {e.size / 2**30:.1f} GiB, more than the {MAX_ONNX_BYTES // 2**30} GiB an "
            f"ONNX file can hold. {again}"
        ) from e
