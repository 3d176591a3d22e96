"""The real model of a train spec and real batches of its dataset, for measuring a training job
on this machine before it is sized for another.

Everything goes through the task contract: the model is `task.build_model` (as the trainer
builds it), a batch is the task's own training samples collated by `task.collate`, and the
training forward is `task.train_loss` (a detector computes its losses from the targets). Real
samples rather than synthetic ones: the targets' shape is the task's business (a detector's
box lists), and no stage may branch on the task.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from visionloop.core.errors import DataError
from visionloop.data.manifest import DatasetManifest, read_manifest, shard_dir_of
from visionloop.data.shards import ShardReader
from visionloop.specs import TrainSpec
from visionloop.tasks import LossFn, Task, get_task

AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainingProbe:
    """A spec's model (train mode) and a way to draw batches of its training samples."""

    spec: TrainSpec
    task: Task
    manifest: DatasetManifest
    model: nn.Module
    loss_fn: LossFn
    train_images: int
    _dataset: Any

    @property
    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    @property
    def trainable_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)

    def batch(self, n: int, device: torch.device) -> tuple[torch.Tensor, Any]:
        """`n` training samples (cycling over the split when it is smaller), collated by the
        task, images scaled to [0, 1] floats on `device` (their values do not change memory or
        FLOPs; the trainer's normalisation does not either)."""
        size = len(self._dataset)
        images, targets = self.task.collate([self._dataset[(i % size, 0)] for i in range(n)])
        return images.to(device, dtype=torch.float32).div_(255.0), self.task.targets_to(targets, device)

    def loss(self, images: torch.Tensor, targets: Any) -> torch.Tensor:
        return self.task.train_loss(self.model, images, targets, self.loss_fn)


def autocast(precision: str, device: torch.device) -> AbstractContextManager[object]:
    dtype = AUTOCAST_DTYPES[precision]
    return nullcontext() if dtype is None else torch.autocast(device_type=device.type, dtype=dtype)


def open_probe(spec: TrainSpec, device: torch.device | None = None) -> TrainingProbe:
    """Build the spec's model and open its training split, as the trainer would."""
    device = device or torch.device("cpu")
    manifest = read_manifest(spec.data.dataset)
    if spec.task != manifest.task:
        raise DataError(
            f"the spec's task is {spec.task!r} but {spec.data.dataset} holds a {manifest.task!r} "
            f"dataset; set task: {manifest.task} or give a {spec.task} dataset."
        )
    info = manifest.splits.get("train")
    if info is None or info.count == 0:
        raise DataError(f"{spec.data.dataset} has no training images; re-ingest with a train split.")
    task = get_task(manifest.task)
    reader = ShardReader(shard_dir_of(spec.data.dataset, info))
    model = task.build_model(
        spec.model.arch,
        manifest.classes,
        pretrained=spec.model.pretrained,
        kwargs=spec.model.kwargs,
        image_size=spec.data.image_size,
        pretrained_backbone=spec.model.pretrained_backbone,
    )
    model.to(device).train()
    return TrainingProbe(
        spec=spec,
        task=task,
        manifest=manifest,
        model=model,
        loss_fn=task.loss_fn(spec),
        train_images=info.count,
        _dataset=task.train_dataset(reader, spec),
    )
