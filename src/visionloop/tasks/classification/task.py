"""Image classification: one integer label per image."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from visionloop.data.sampler import SampleKey
from visionloop.data.shards import ShardReader
from visionloop.specs import TrainSpec
from visionloop.tasks.base import EvalResult, Evaluator, LossFn, Task
from visionloop.tasks.classification.metrics import ConfusionMatrix
from visionloop.tasks.classification.transforms import EvalTransform, TrainTransform, decode_rgb

MAX_CLASSES_AS_METRICS = 50  # above this, per-class numbers go to the JSON report only


class ShardClassificationDataset(Dataset[tuple[torch.Tensor, int]]):
    """Indexed by (record position, epoch); returns (uint8 image (3, S, S), label)."""

    def __init__(self, reader: ShardReader, transform: TrainTransform | EvalTransform) -> None:
        self.reader = reader
        self.transform = transform

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, key: SampleKey) -> tuple[torch.Tensor, int]:
        position, epoch = key
        record = self.reader[position]
        img = decode_rgb(record["image"])
        if isinstance(self.transform, TrainTransform):
            img = self.transform(img, epoch, record["index"])
        else:
            img = self.transform(img)
        return img, record["label"]


class ClassificationEvaluator(Evaluator):
    def __init__(self, class_names: Sequence[str]) -> None:
        self.class_names = list(class_names)
        self.cm = ConfusionMatrix(len(self.class_names))
        self.top5 = 0
        self.loss_sum = 0.0

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, loss_sum: float) -> None:
        outputs, targets = outputs.detach().float().cpu(), targets.cpu()
        self.cm.update(outputs, targets)
        k = min(5, outputs.shape[1])
        self.top5 += int((outputs.topk(k, dim=1).indices == targets[:, None]).any(dim=1).sum())
        self.loss_sum += loss_sum

    def state(self) -> torch.Tensor:
        # float64 holds integer counts exactly up to 2**53 and the loss sum in one tensor.
        head = torch.tensor([self.loss_sum, float(self.top5)], dtype=torch.float64)
        return torch.cat([head, self.cm.matrix.flatten().double()])

    def load_state(self, state: torch.Tensor) -> None:
        self.loss_sum = float(state[0])
        self.top5 = int(state[1])
        n = len(self.class_names)
        self.cm.matrix = state[2:].round().long().view(n, n).clone()

    def compute(self) -> EvalResult:
        report = self.cm.compute(self.class_names)
        total = int(self.cm.matrix.sum())
        metrics = {
            "loss": self.loss_sum / max(total, 1),
            "accuracy": report.accuracy,
            "macro_precision": report.macro_precision,
            "macro_recall": report.macro_recall,
            "macro_f1": report.macro_f1,
        }
        if len(self.class_names) > 5:
            metrics["top5_accuracy"] = self.top5 / max(total, 1)
        if len(self.class_names) <= MAX_CLASSES_AS_METRICS:
            for name, p, r in zip(self.class_names, report.precision, report.recall, strict=True):
                metrics[f"precision/{name}"] = p
                metrics[f"recall/{name}"] = r
        details: dict[str, Any] = report.to_dict()
        details["loss"] = metrics["loss"]
        details["samples"] = total
        summary = f"accuracy {report.accuracy:.2%}  loss {metrics['loss']:.4f}  macro-F1 {report.macro_f1:.3f}"
        return EvalResult(metrics=metrics, report=details, summary=summary)

    def write_artifacts(self, result: EvalResult, out_dir: Path) -> list[Path]:
        from visionloop.tasks.classification.plots import plot_confusion_matrix

        path = out_dir / "confusion_matrix.png"
        plot_confusion_matrix(self.cm.matrix, self.class_names, path, normalize=True)
        return [path]


class ClassificationTask(Task):
    name = "classification"

    def train_dataset(self, reader: ShardReader, spec: TrainSpec) -> Dataset[Any]:
        t = TrainTransform(size=spec.data.image_size, augment=spec.data.augment, seed=spec.seed)
        return ShardClassificationDataset(reader, t)

    def eval_dataset(self, reader: ShardReader, spec: TrainSpec) -> Dataset[Any]:
        return ShardClassificationDataset(reader, EvalTransform(spec.data.image_size, spec.data.crop_pct))

    def loss_fn(self, spec: TrainSpec) -> LossFn:
        return nn.CrossEntropyLoss(label_smoothing=spec.loss.label_smoothing)

    def evaluator(self, class_names: Sequence[str]) -> Evaluator:
        return ClassificationEvaluator(class_names)
