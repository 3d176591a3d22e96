"""What `visionloop eval` reports: the clean metrics, the stress grid, calibration, slices.

The stress summary follows ImageNet-C (Hendrycks & Dietterich 2019) with the clean model as
its own reference, since there is no AlexNet to normalise by: for each corruption, the primary
metric at each severity, its mean over the severities, the drop from clean in points, and the
corrupted error as a multiple of the clean error (`relative_error`: 1.0 means the corruption
costs nothing; error is 1 - metric for a metric to maximise, such as accuracy or mAP).
`stress_mean` is the mean over every corruption and severity: the one number the promotion
gate compares between two versions evaluated on the same data.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

REPORT_VERSION = 1


@dataclass(frozen=True)
class StressCell:
    corruption: str
    severity: int
    value: float  # the primary metric, as a fraction
    metrics: dict[str, float]
    ece: float | None = None  # the calibration error under this corruption (classification)


@dataclass(frozen=True)
class CorruptionSummary:
    corruption: str
    severities: tuple[int, ...]
    values: tuple[float, ...]  # per severity, in that order
    mean: float
    drop_points: float  # (clean - mean) x 100 for a metric to maximise; (mean - clean) x 100 else
    relative_error: float | None  # mean corrupted error / clean error; None when clean error is 0


def error_of(value: float, mode: Literal["max", "min"]) -> float:
    """The error a metric stands for: 1 - value for a fraction to maximise, the value itself
    for one to minimise (a loss)."""
    return 1.0 - value if mode == "max" else value


def summarize_stress(
    cells: list[StressCell], clean: float, mode: Literal["max", "min"]
) -> tuple[list[CorruptionSummary], float | None, float | None]:
    """Per corruption (in the order the cells first name them): its values by severity, mean,
    drop and relative error; then the mean over all cells and the mean relative error."""
    order: list[str] = []
    for c in cells:
        if c.corruption not in order:
            order.append(c.corruption)
    clean_error = error_of(clean, mode)
    out: list[CorruptionSummary] = []
    for name in order:
        mine = sorted((c for c in cells if c.corruption == name), key=lambda c: c.severity)
        values = tuple(c.value for c in mine)
        mean = statistics.fmean(values)
        drop = (clean - mean) * 100 if mode == "max" else (mean - clean) * 100
        mean_error = statistics.fmean(error_of(v, mode) for v in values)
        relative = mean_error / clean_error if clean_error > 0 else None
        severities = tuple(c.severity for c in mine)
        out.append(CorruptionSummary(name, severities, values, mean, drop, relative))
    if not out:
        return out, None, None
    stress_mean = statistics.fmean(c.value for c in cells)
    relatives = [s.relative_error for s in out if s.relative_error is not None]
    return out, stress_mean, (statistics.fmean(relatives) if len(relatives) == len(out) else None)


@dataclass
class EvalReport:
    """One `visionloop eval` of one model version on one dataset split."""

    model: str
    task: str
    dataset: str
    dataset_version: str
    split: str
    images: int
    metric: str  # the task's primary metric, e.g. accuracy or mAP
    mode: Literal["max", "min"]
    clean: float
    clean_metrics: dict[str, float]
    summary: str
    same_data_as_training: bool  # the model's own dataset version: its gate can compare versions
    seed: int
    created_at: str
    errors: dict[str, Any] | None = None  # the task's ErrorAnalysis of the clean pass
    calibration: dict[str, Any] | None = None
    calibration_note: str | None = None
    stress: list[StressCell] = field(default_factory=list)
    corruptions: list[CorruptionSummary] = field(default_factory=list)
    stress_mean: float | None = None
    mean_relative_error: float | None = None
    # Per metadata column asked for (--slices): one row per value, worst first:
    # {value (null: no value, shown "(missing)"), images, metric, ci_low, ci_high, resampled}
    # (`eval.slices.Slice`), and how the intervals were drawn.
    slices: dict[str, list[dict[str, Any]]] | None = None
    slice_bootstrap: dict[str, Any] | None = None
    files: list[str] = field(default_factory=list)
    path: str = ""  # where eval.json was written
    mlflow_run_id: str | None = None  # the evaluation's run in the tracking store
    version: int = REPORT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
