"""What a task gives export, and the benchmarks that score exports, besides the module itself:
the typed seams of `Task.export_comparison`, `Task.output_scorer` and `Task.embedding_layer`.

- `ExportComparison`: streams eager and exported outputs over the evaluation images and ends
  with a `GateMeasurement` (the gate metric of each, agreement, largest raw difference), the
  one measurement the export gate and the export record are made from;
- `OutputScorer`: the gate metric over raw host outputs, per benchmarked format;
- `EmbeddingLayer`: where the export reads the per-image embedding it adds as an output.

Like `tasks.base`, this module imports neither torch nor numpy at run time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch
    from torch import nn


@dataclass(frozen=True)
class GateMeasurement:
    """An exported model against eager fp32 PyTorch on the same evaluation images.

    `score` and `reference_score` are the task's gate metric as a fraction (top-1 accuracy for
    classification, mAP for detection); the gate compares them in points (x 100).
    `agreement` is the fraction of images whose post-processed answer is the same (top-1 class,
    matched boxes); `max_abs_diff` the largest raw-output difference."""

    metric: str
    samples: int
    score: float
    reference_score: float
    agreement: float
    max_abs_diff: float

    @property
    def drop_points(self) -> float:
        return (self.reference_score - self.score) * 100.0


class ExportComparison(ABC):
    """Streams (eager outputs, exported outputs, targets) batch by batch; `result()` at the end.
    Outputs are sequences of tensors in `Task.output_names` order."""

    @abstractmethod
    def update(
        self, reference: Sequence[torch.Tensor], exported: Sequence[torch.Tensor], targets: Any
    ) -> None: ...

    @abstractmethod
    def result(self) -> GateMeasurement: ...


class OutputScorer(ABC):
    """The gate metric over host arrays (what a benchmark's runner returns), batch by batch."""

    @abstractmethod
    def update(self, outputs: Sequence[npt.NDArray[Any]], targets: Any) -> None: ...

    @abstractmethod
    def compute(self) -> float: ...


@dataclass(frozen=True)
class EmbeddingLayer:
    """Where a model's per-image embedding is read (`Task.embedding_layer`): the input or the
    output of `module`, a submodule of the exported module. A 4-D tensor there is averaged
    over its spatial dimensions; a dict, list or tuple gives its last tensor."""

    module: nn.Module
    read: Literal["input", "output"] = "input"
