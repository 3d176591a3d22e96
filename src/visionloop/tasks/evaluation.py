"""What one evaluation pass gives back, and the streaming evaluator that computes it: the typed
seam between a task (`Task.evaluator`) and the stages that evaluate (train's validation, DDP's
all-reduce of `Evaluator.state`, `visionloop eval`).

- `Evaluator`: `reset()`, `update()` per batch, `compute()` once, with its state as one tensor
  so that DDP ranks can sum it;
- `EvalResult`: scalar metrics, a JSON-safe report and a one-line summary;
- `ErrorAnalysis`: how a model is wrong (`Evaluator.error_analysis`), its worst `ConfusedPair`s
  read off a confusion matrix by `top_confused`, and a task's kinds of error.

Like `tasks.base`, this module imports neither torch nor numpy at run time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class EvalResult:
    """Scalar metrics (logged as `val/<name>`), a JSON-safe report, and a one-line summary."""

    metrics: dict[str, float]
    report: dict[str, Any] = field(default_factory=dict)
    summary: str = ""


@dataclass(frozen=True)
class ConfusedPair:
    """A kind of mistake: `count` items of class `true` taken for `predicted` (`share`: of all
    the items of `true`: images for a classifier, ground-truth boxes for a detector)."""

    true: str
    predicted: str
    count: int
    share: float


@dataclass(frozen=True)
class ErrorAnalysis:
    """How a model is wrong on one pass: the most confused class pairs, worst first, and
    counts per kind of error where a task has kinds (detection: classification, localisation,
    both, duplicate, background, missed, as in TIDE, Bolya et al. 2020)."""

    confused: tuple[ConfusedPair, ...] = ()
    kinds: Mapping[str, int] = field(default_factory=dict)
    definitions: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "confused": [vars(p) for p in self.confused],
            "kinds": dict(self.kinds),
            "definitions": dict(self.definitions),
        }


def top_confused(
    matrix: Sequence[Sequence[int]], class_names: Sequence[str], limit: int
) -> tuple[ConfusedPair, ...]:
    """The `limit` largest off-diagonal cells of `matrix[true][predicted]` (square over
    `class_names`; extra rows or columns, such as a detector's background, are ignored)."""
    n = len(class_names)
    cells = []
    for i in range(n):
        support = sum(int(v) for v in matrix[i][: len(matrix[i])])
        for j in range(n):
            count = int(matrix[i][j])
            if i != j and count > 0:
                cells.append(ConfusedPair(class_names[i], class_names[j], count, count / max(support, 1)))
    cells.sort(key=lambda p: (-p.count, -p.share, p.true, p.predicted))
    return tuple(cells[:limit])


class Evaluator(ABC):
    """Accumulates one pass over an eval split, batch by batch (detectron2's reset / process /
    evaluate): `reset()`, `update()` per batch, `compute()` once at the end.

    Its state is one tensor so that DDP ranks can `all_reduce` (sum) it and every rank ends
    with the exact whole-split result. A metric that needs all predictions (mAP) keeps them and
    encodes them in `state` so that a sum over ranks concatenates them (e.g. zero-padded slots
    per rank)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget everything seen (the constructor calls it)."""

    @abstractmethod
    def update(self, outputs: Any, targets: Any, loss_sum: float) -> None:
        """One batch: the model's outputs, the collated targets, and the batch's summed loss."""

    @abstractmethod
    def state(self) -> torch.Tensor: ...

    @abstractmethod
    def load_state(self, state: torch.Tensor) -> None: ...

    @abstractmethod
    def compute(self) -> EvalResult: ...

    def write_artifacts(self, result: EvalResult, out_dir: Path) -> list[Path]:
        """Write plots/tables for `result` under out_dir; return what was written."""
        return []

    def error_analysis(self, limit: int = 10) -> ErrorAnalysis | None:
        """How the model was wrong over what was seen since `reset` (None: the task has no
        analysis). `limit`: how many confused pairs at most."""
        return None
