"""What an export found: parity with eager PyTorch, the accuracy gate, the artifact's identity.

The report is written to `exports/<format>-<precision>/export.json` whether the export passed or
not: a failed export is explained, never served (`ModelVersionInfo.export_path` returns None).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from visionloop.core.errors import VisionloopError

Precision = Literal["fp32", "fp16", "int8"]
Format = Literal["onnx"]
PRECISIONS: tuple[Precision, ...] = ("fp32", "fp16", "int8")


class ParityThresholds(BaseModel):
    """How close the exported model's logits must stay to eager PyTorch's.

    fp32 should agree to rounding; fp16 keeps ~3 significant digits of each logit; int8
    logits move by a good fraction of a unit, so only top-1 agreement is checked by default
    (the accuracy gate is what decides whether int8 is good enough).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_abs_diff: float | None = Field(description="largest allowed |logit - reference|; None: not checked")
    min_top1_agreement: float = Field(ge=0.0, le=1.0)


DEFAULT_PARITY: dict[str, ParityThresholds] = {
    "fp32": ParityThresholds(max_abs_diff=1e-3, min_top1_agreement=0.99),
    "fp16": ParityThresholds(max_abs_diff=0.1, min_top1_agreement=0.98),
    "int8": ParityThresholds(max_abs_diff=None, min_top1_agreement=0.90),
}


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
    # parity with eager PyTorch (fp32) on the validation images
    samples: int
    max_abs_diff: float
    top1_agreement: float
    max_abs_diff_threshold: float | None
    top1_agreement_threshold: float
    parity_passed: bool
    # accuracy gate
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

    def summary(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        return (
            f"{self.model} {self.format}-{self.precision} {verdict}: accuracy {self.accuracy:.2%} vs "
            f"{self.reference_accuracy:.2%} fp32 PyTorch (drop {self.drop_points:.2f} points, allowed "
            f"{self.threshold_points:g}); max |logit diff| {self.max_abs_diff:.3g}, top-1 agreement "
            f"{self.top1_agreement:.2%} on {self.samples} {self.split} images"
        )


class ExportError(VisionloopError):
    """An export could not be made (conversion failed, no validation data)."""


class ExportGateError(ExportError):
    """The export was made but failed its parity check or accuracy gate; its report is kept."""

    def __init__(self, message: str, report: ExportReport) -> None:
        super().__init__(message)
        self.report = report
