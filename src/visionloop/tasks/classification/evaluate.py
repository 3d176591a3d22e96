"""Streaming evaluation of a classifier: the confusion matrix, top-k, loss; and the export
gate's comparison of an exported classifier with eager PyTorch."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from visionloop.tasks.classification.metrics import ConfusionMatrix
from visionloop.tasks.evaluation import ErrorAnalysis, EvalResult, Evaluator
from visionloop.tasks.export_seams import ExportComparison, GateMeasurement, OutputScorer

MAX_CLASSES_AS_METRICS = 50  # above this, per-class numbers go to the JSON report only


class ClassificationEvaluator(Evaluator):
    def __init__(self, class_names: Sequence[str]) -> None:
        self.class_names = list(class_names)
        self.reset()

    def reset(self) -> None:
        self.cm = ConfusionMatrix(len(self.class_names), topk=(5,))
        self.loss_sum = 0.0

    def update(self, outputs: Any, targets: Any, loss_sum: float) -> None:
        # Counting stays on the outputs' device: no per-batch host copy of the logits.
        if self.cm.matrix.device != outputs.device:
            self.cm.matrix = self.cm.matrix.to(outputs.device)
            self.cm.topk_counts = self.cm.topk_counts.to(outputs.device)
        self.cm.update(outputs.detach(), targets)
        self.loss_sum += loss_sum

    def state(self) -> torch.Tensor:
        # float64 holds integer counts exactly up to 2**53, and the loss sum, in one tensor
        # that DDP ranks can all_reduce in a single call.
        head = torch.tensor([self.loss_sum], dtype=torch.float64, device=self.cm.matrix.device)
        return torch.cat([head, self.cm.topk_counts.double(), self.cm.matrix.flatten().double()])

    def load_state(self, state: torch.Tensor) -> None:
        state = state.cpu()
        k = self.cm.topk_counts.numel()
        n = len(self.class_names)
        self.loss_sum = float(state[0])
        self.cm.topk_counts = state[1 : 1 + k].round().long().clone()
        self.cm.matrix = state[1 + k :].round().long().view(n, n).clone()

    def compute(self) -> EvalResult:
        report = self.cm.compute(self.class_names)
        metrics = {"loss": self.loss_sum / max(report.total, 1), **report.scalars()}
        if len(self.class_names) <= MAX_CLASSES_AS_METRICS:
            for name, p, r in zip(self.class_names, report.precision, report.recall, strict=True):
                # A "/" inside a class name must not open a new level of the metric hierarchy.
                safe = name.replace("/", "_")
                metrics[f"precision/{safe}"] = p
                metrics[f"recall/{safe}"] = r
        details: dict[str, Any] = report.to_dict()
        details["loss"] = metrics["loss"]
        summary = (
            f"accuracy {report.accuracy:.2%}  loss {metrics['loss']:.4f}  macro-F1 {report.macro_f1:.3f}"
        )
        return EvalResult(metrics=metrics, report=details, summary=summary)

    def error_analysis(self, limit: int = 10) -> ErrorAnalysis:
        from visionloop.tasks.evaluation import top_confused

        return ErrorAnalysis(confused=top_confused(self.cm.matrix.cpu().tolist(), self.class_names, limit))

    def write_artifacts(self, result: EvalResult, out_dir: Path) -> list[Path]:
        from visionloop.tasks.classification.plots import plot_confusion_matrix

        path = out_dir / "confusion_matrix.png"
        plot_confusion_matrix(self.cm.matrix, self.class_names, path, normalize=True)
        return [path]


class ClassificationComparison(ExportComparison):
    """Top-1 accuracy of both models, their top-1 agreement and the largest logit difference."""

    def __init__(self) -> None:
        self.samples = 0
        self.correct = 0
        self.reference_correct = 0
        self.agree = 0
        self.max_abs_diff = 0.0

    def update(
        self, reference: Sequence[torch.Tensor], exported: Sequence[torch.Tensor], targets: Any
    ) -> None:
        ref, got = reference[0].float(), exported[0].float()
        ref_top1, got_top1 = ref.argmax(1), got.argmax(1)
        self.samples += len(targets)
        self.correct += int((got_top1 == targets).sum())
        self.reference_correct += int((ref_top1 == targets).sum())
        self.agree += int((got_top1 == ref_top1).sum())
        self.max_abs_diff = max(self.max_abs_diff, float((got - ref).abs().max()))

    def result(self) -> GateMeasurement:
        n = max(self.samples, 1)
        return GateMeasurement(
            metric="accuracy",
            samples=self.samples,
            score=self.correct / n,
            reference_score=self.reference_correct / n,
            agreement=self.agree / n,
            max_abs_diff=self.max_abs_diff,
        )


class TopOneScorer(OutputScorer):
    """Top-1 accuracy of host logits against integer labels."""

    def __init__(self) -> None:
        self.correct = 0
        self.total = 0

    def update(self, outputs: Sequence[npt.NDArray[Any]], targets: Any) -> None:
        labels = np.asarray(targets)
        self.correct += int((np.argmax(outputs[0], axis=1) == labels).sum())
        self.total += len(labels)

    def compute(self) -> float:
        return self.correct / self.total if self.total else 0.0
