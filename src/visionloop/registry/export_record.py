"""The export record: the one typed report that export writes (`exports/<format>-<precision>/
export.json`) and the registry, bench, serve and the CLI read.

It lives here, below `export/` in the package order, because the registry decides from it
whether an export may be served (`passing_export`); `visionloop.export` re-exports it.
A file that is missing, unreadable or not a valid record reads as None: never served.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from visionloop.core.fsutil import open_regular

# A report is about 1 kB.
MAX_REPORT_BYTES = 1 * 2**20
Precision = Literal["fp32", "fp16", "int8"]
Format = Literal["onnx"]


class ExportReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(description="NAME/VERSION")
    format: Format
    precision: Precision
    path: str
    sha256: str | None
    size_bytes: int | None
    opset: int
    exporter: str
    # parity with eager PyTorch (fp32) on the evaluation images; `top1_agreement` is the task's
    # agreement (`GateMeasurement.agreement`): the same top-1 class for classification, the
    # same boxes (one to one, IoU >= 0.99) for detection; `agreement_label` says which
    samples: int
    max_abs_diff: float
    top1_agreement: float
    max_abs_diff_threshold: float | None
    top1_agreement_threshold: float
    parity_passed: bool
    # the gate, on the task's gate metric (`GateMeasurement.metric`, named by `metric`): top-1
    # accuracy for classification, mAP for detection; the field names stay for old readers
    accuracy: float
    reference_accuracy: float
    drop_points: float = Field(description="(reference - exported accuracy) x 100")
    threshold_points: float
    gate_passed: bool
    # int8 only
    calibration_images: int | None = None
    calibration_source: str | None = None
    dataset_path: str
    dataset_version: str | None
    split: str
    passed: bool
    reason: str | None = None
    created_at: str
    duration_s: float
    # Defaults: what every report written before detection measured.
    metric: str = Field("accuracy", description="what accuracy and reference_accuracy hold: accuracy, mAP")
    agreement_label: str = Field("top-1 agreement", description="what top1_agreement counts")
    output_label: str = Field("logit", description="what max_abs_diff is the difference of")
    # The `embedding` output (export.embedding): its PCA dimensions and the share of the
    # features' variance they keep; None for an export without one.
    embedding_dim: int | None = None
    embedding_variance: float | None = None

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
        # open_regular and a cap: a FIFO as export.json used to hang `models show`, the server
        # and bench, all of which ask whether an export passed.
        with open_regular(path) as f:
            data = f.read(MAX_REPORT_BYTES + 1)
        if len(data) > MAX_REPORT_BYTES:
            return None
        return ExportReport.model_validate_json(data)
    except (OSError, ValidationError):
        return None


def write_export_report_text(report: ExportReport) -> str:
    """The record as written to disk (indented JSON and a final newline)."""
    return report.model_dump_json(indent=2) + "\n"
