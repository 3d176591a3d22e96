"""What an export found: parity with eager PyTorch, the accuracy gate, the artifact's identity.

The report is written to `exports/<format>-<precision>/export.json` whether the export passed or
not: a failed export is explained, never served (`ModelVersionInfo.export_path` returns None).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from visionloop.core.errors import VisionloopError
from visionloop.registry.export_record import ExportReport, Format, Precision

__all__ = [
    "DEFAULT_PARITY",
    "PRECISIONS",
    "ExportError",
    "ExportGateError",
    "ExportReport",
    "Format",
    "ParityThresholds",
    "Precision",
]

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


class ExportError(VisionloopError):
    """An export could not be made (conversion failed, no validation data)."""


class ExportGateError(ExportError):
    """The export was made but failed its parity check or accuracy gate; its report is kept."""

    def __init__(self, message: str, report: ExportReport) -> None:
        super().__init__(message)
        self.report = report
