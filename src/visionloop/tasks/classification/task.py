"""Image classification: one integer label per image."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from visionloop.data.manifest import DatasetManifest
from visionloop.data.sampler import SampleKey
from visionloop.data.shards import Record, ShardReader
from visionloop.models import ModelCard
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
        return self._sample(self.reader[key[0]], key[1])

    def __getitems__(self, keys: list[SampleKey]) -> list[tuple[torch.Tensor, int]]:
        """A whole batch at once (the DataLoader calls this when it exists): records are read
        in shard order, samples come back in the sampler's order."""
        records = self.reader.read_many([position for position, _ in keys])
        return [self._sample(r, epoch) for r, (_, epoch) in zip(records, keys, strict=True)]

    def _sample(self, record: Record, epoch: int) -> tuple[torch.Tensor, int]:
        img = decode_rgb(record["image"])
        if isinstance(self.transform, TrainTransform):
            img = self.transform(img, epoch, record["index"])
        else:
            img = self.transform(img)
        return img, record["label"]


class ClassificationEvaluator(Evaluator):
    def __init__(self, class_names: Sequence[str]) -> None:
        self.class_names = list(class_names)
        self.cm = ConfusionMatrix(len(self.class_names), topk=(5,))
        self.loss_sum = 0.0

    def update(self, outputs: torch.Tensor, targets: torch.Tensor, loss_sum: float) -> None:
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

    def model_card(
        self,
        manifest: DatasetManifest,
        spec: TrainSpec,
        *,
        mean: Sequence[float],
        std: Sequence[float],
        metrics: Mapping[str, float],
        run_uid: str | None,
    ) -> ModelCard:
        size = spec.data.image_size
        return ModelCard.from_manifest(
            manifest,
            arch=spec.model.arch,
            model_kwargs=dict(spec.model.kwargs),
            input_size=(3, size, size),
            mean=tuple(mean),
            std=tuple(std),
            crop_pct=spec.data.crop_pct,
            # EvalTransform resizes bilinearly whatever the architecture's habit; the card must
            # describe what the reported metrics were measured with.
            interpolation="bilinear",
            metrics={k: float(v) for k, v in metrics.items() if "/" not in k},
            run_uid=run_uid,
        )
