"""Classification metrics from one confusion matrix (rows: true class, columns: predicted).

Every loss-free metric — accuracy, per-class precision/recall/F1, macro averages — is a
function of the matrix, so the only state an evaluation pass keeps is integer counts. Counts
add exactly, which is what makes DDP evaluation exact: `all_reduce(SUM)` the counts of every
rank and each rank computes the whole-split numbers. Top-k accuracy is not a function of the
matrix, so the top-k hit counts ride alongside it in a second small tensor.

Definitions follow scikit-learn with `zero_division=0`: a ratio with a zero denominator is
0.0, never NaN and never a warning; macro averages run over the classes that occur in the
targets or the predictions (sklearn's default label set).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from visionloop.core.errors import DataError

DEFAULT_TOPK: tuple[int, ...] = (5,)


def _div(num: float, den: float) -> float:
    return num / den if den else 0.0


@dataclass(frozen=True)
class ClassificationReport:
    """Metrics of one evaluation pass. Lists are per class, in class-index order."""

    class_names: list[str]
    matrix: list[list[int]]
    total: int
    accuracy: float
    precision: list[float]
    recall: list[float]
    f1: list[float]
    support: list[int]
    macro_precision: float
    macro_recall: float
    macro_f1: float
    # {k: accuracy}; present only when every counted sample came with top-k information.
    topk_accuracy: dict[int, float] = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def scalars(self) -> dict[str, float]:
        """Whole-split numbers, named for logging (`top5_accuracy` when available)."""
        out = {
            "accuracy": self.accuracy,
            "macro_precision": self.macro_precision,
            "macro_recall": self.macro_recall,
            "macro_f1": self.macro_f1,
        }
        out.update({f"top{k}_accuracy": v for k, v in sorted(self.topk_accuracy.items())})
        return out

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: plain ints, floats, strings and lists (top-k keys become strings)."""
        return {
            "total": self.total,
            **self.scalars(),
            "per_class": [
                {"name": n, "precision": p, "recall": r, "f1": f, "support": s}
                for n, p, r, f, s in zip(
                    self.class_names, self.precision, self.recall, self.f1, self.support, strict=True
                )
            ],
            "class_names": list(self.class_names),
            "confusion_matrix": [list(row) for row in self.matrix],
        }


class ConfusionMatrix:
    """Accumulates `matrix[true, pred]` counts (int64) and top-k hit counts.

    `update` takes logits/probabilities (N, C) or predicted indices (N,). With logits it also
    counts, for each k in `topk`, how many targets fall in the k highest scores; with indices
    it cannot, and top-k accuracy is then left out of the report rather than guessed.

    For DDP, reduce both tensors in place (`all_reduce()` does it), or `add_` another
    instance. Both tensors live on `device`, so updates on GPU never copy to the host.
    """

    def __init__(
        self,
        num_classes: int,
        *,
        topk: Sequence[int] = DEFAULT_TOPK,
        device: torch.device | str | None = None,
    ) -> None:
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        if any(k < 1 for k in topk):
            raise ValueError(f"top-k values must be >= 1, got {list(topk)}")
        self.num_classes = num_classes
        self.topk = tuple(sorted(set(topk)))
        self.matrix = torch.zeros(num_classes, num_classes, dtype=torch.int64, device=device)
        # [hits for each k in topk..., samples that came with scores]: one tensor, one all_reduce.
        self.topk_counts = torch.zeros(len(self.topk) + 1, dtype=torch.int64, device=device)

    # ----------------------------------------------------------------- accumulate

    @torch.no_grad()
    def update(self, logits_or_preds: torch.Tensor, targets: torch.Tensor) -> None:
        """Count one batch. `targets` are class indices (N,)."""
        c = self.num_classes
        dev = self.matrix.device
        targets = targets.reshape(-1).to(device=dev, dtype=torch.int64)
        x = logits_or_preds.detach().to(dev)
        if x.ndim == 2 and x.shape[1] == c:
            preds = x.argmax(dim=1)
            self._update_topk(x, targets)
        elif x.ndim == 1 and not x.is_floating_point():
            preds = x.to(torch.int64)
        else:
            raise ValueError(
                f"expected logits (N, {c}) or predicted class indices (N,), got shape {tuple(x.shape)} "
                f"and dtype {x.dtype}"
            )
        if preds.shape != targets.shape:
            raise ValueError(f"{preds.shape[0]} predictions but {targets.shape[0]} targets")
        # A GPU→host sync, once per batch: an out-of-range index would otherwise be counted
        # in the wrong cell without any error, which is worse than the sync.
        if targets.numel() and bool(((targets < 0) | (targets >= c) | (preds < 0) | (preds >= c)).any()):
            bad = sorted(set(targets[(targets < 0) | (targets >= c)].tolist()))[:5]
            raise DataError(
                f"class index outside [0, {c}) (targets {bad}, or predictions): the model's num_classes "
                f"({c}) does not match the dataset's labels. Rebuild the model for the dataset's classes."
            )
        # bincount over flattened (true, pred) cells: deterministic on CPU and on CUDA.
        self.matrix += torch.bincount(targets * c + preds, minlength=c * c).view(c, c)

    def _update_topk(self, scores: torch.Tensor, targets: torch.Tensor) -> None:
        kmax = min(max(self.topk), self.num_classes)
        top = scores.topk(kmax, dim=1).indices  # (N, kmax), best first
        hit_rank = (top == targets[:, None]).int()
        # hits_at[j] = 1 when the target is within the top j+1 scores.
        hits_at = hit_rank.cumsum(dim=1).clamp_(max=1)
        for i, k in enumerate(self.topk):
            self.topk_counts[i] += hits_at[:, min(k, kmax) - 1].sum()
        self.topk_counts[-1] += targets.numel()

    def add_(self, other: ConfusionMatrix) -> ConfusionMatrix:
        """Add another matrix's counts into this one (same classes and top-k); return self."""
        if other.num_classes != self.num_classes or other.topk != self.topk:
            raise ValueError(
                f"cannot merge a {other.num_classes}-class matrix with top-k {other.topk} into a "
                f"{self.num_classes}-class one with top-k {self.topk}"
            )
        self.matrix += other.matrix.to(self.matrix.device)
        self.topk_counts += other.topk_counts.to(self.topk_counts.device)
        return self

    def merge(self, other: ConfusionMatrix) -> ConfusionMatrix:
        """A new matrix holding the counts of both."""
        out = ConfusionMatrix(self.num_classes, topk=self.topk, device=self.matrix.device)
        return out.add_(self).add_(other)

    def all_reduce(self, group: Any = None) -> None:
        """Sum counts over all ranks in place (no-op without an initialised process group)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(self.matrix, op=dist.ReduceOp.SUM, group=group)
            dist.all_reduce(self.topk_counts, op=dist.ReduceOp.SUM, group=group)

    def reset(self) -> None:
        self.matrix.zero_()
        self.topk_counts.zero_()

    # ----------------------------------------------------------------- report

    def compute(self, class_names: Sequence[str] | None = None) -> ClassificationReport:
        """Metrics from the counts so far (one host copy of the matrix; no grad, no warnings)."""
        names = (
            [str(n) for n in class_names]
            if class_names is not None
            else [str(i) for i in range(self.num_classes)]
        )
        if len(names) != self.num_classes:
            raise ValueError(f"{len(names)} class names for a {self.num_classes}-class matrix")
        m = self.matrix.detach().cpu()
        tp = m.diagonal().tolist()
        support = m.sum(dim=1).tolist()  # true count per class (row sums)
        predicted = m.sum(dim=0).tolist()  # predicted count per class (column sums)
        total = int(sum(support))

        precision = [_div(t, p) for t, p in zip(tp, predicted, strict=True)]
        recall = [_div(t, s) for t, s in zip(tp, support, strict=True)]
        # F1 from counts, as sklearn does: 2tp / (2tp + fp + fn) = 2tp / (support + predicted).
        f1 = [_div(2 * t, s + p) for t, s, p in zip(tp, support, predicted, strict=True)]
        present = [i for i in range(self.num_classes) if support[i] or predicted[i]]

        def macro(values: list[float]) -> float:
            return _div(sum(values[i] for i in present), len(present))

        topk_accuracy: dict[int, float] = {}
        counts = self.topk_counts.detach().cpu().tolist()
        # Only when every counted sample had scores: a partial top-k would be silently wrong.
        if total and counts[-1] == total:
            topk_accuracy = {k: counts[i] / total for i, k in enumerate(self.topk)}

        return ClassificationReport(
            class_names=names,
            matrix=m.tolist(),
            total=total,
            accuracy=_div(sum(tp), total),
            precision=precision,
            recall=recall,
            f1=f1,
            support=[int(s) for s in support],
            macro_precision=macro(precision),
            macro_recall=macro(recall),
            macro_f1=macro(f1),
            topk_accuracy=topk_accuracy,
        )
