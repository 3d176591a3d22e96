"""Build everything a training run needs from the spec, in a fixed order.

The order matters for exactness: on a fresh run the model's initial weights are the first
draws from the freshly seeded RNG; on a resumed run the RNG is restored afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import Dataset

from visionloop.core.errors import DataError, TrainingError
from visionloop.data.manifest import DatasetManifest, eval_split, read_manifest, shard_dir_of
from visionloop.data.sampler import holdout_positions
from visionloop.data.shards import ShardReader
from visionloop.models.registry import IMAGENET_MEAN, IMAGENET_STD
from visionloop.specs import TrainSpec
from visionloop.tasks import LossFn, Task, get_task
from visionloop.train.dist import DistInfo
from visionloop.train.rundir import RunDir
from visionloop.train.schedule import build_optimizer, build_scheduler
from visionloop.train.sharding import shard_model


@dataclass
class Components:
    spec: TrainSpec
    dist: DistInfo
    device: torch.device
    run_dir: RunDir
    manifest: DatasetManifest
    task: Task
    train_reader: ShardReader
    train_dataset: Dataset[Any]
    eval_dataset: Dataset[Any] | None
    eval_split: str | None
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    loss_fn: LossFn
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    total_steps: int
    steps_per_epoch: int
    num_params: int
    spec_sha256: str
    # Train-split positions never trained on (`data.holdout`'s fold), ascending.
    held_out: tuple[int, ...] = ()
    last_eval_dir: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def eval_size(self) -> int:
        return len(self.eval_dataset) if self.eval_dataset is not None else 0  # type: ignore[arg-type]

    @property
    def epochs(self) -> int:
        return math.ceil(self.total_steps / self.steps_per_epoch)


def normalization(spec: TrainSpec, manifest: DatasetManifest) -> tuple[tuple[float, float, float], ...]:
    choice = spec.data.normalize
    if choice == "auto":
        choice = "imagenet" if spec.model.pretrained else "dataset"
    if choice == "imagenet":
        return IMAGENET_MEAN, IMAGENET_STD
    stats = manifest.channel_stats
    # A constant channel (std 0) would divide by zero; treat it as unit variance.
    std = tuple(s if s > 1e-6 else 1.0 for s in stats.std)
    return tuple(stats.mean), std  # type: ignore[return-value]


def open_split(manifest: DatasetManifest, dataset_dir: Path, split: str) -> ShardReader | None:
    info = manifest.splits.get(split)  # type: ignore[call-overload]
    if info is None or info.count == 0:
        return None
    return ShardReader(shard_dir_of(dataset_dir, info))


def check_input_size(
    model: nn.Module, spec: TrainSpec, task: Task, class_names: list[str], device: torch.device
) -> None:
    """One tiny forward before anything else: an image size the architecture cannot take
    (ViT wants exactly 224, Inception at least 75, ...) fails here with advice, not as a
    stack trace after the loaders have started. Eval mode, no grad: no RNG, no BN update."""
    size = spec.data.image_size
    model.eval()
    try:
        with torch.no_grad():
            out = model(torch.zeros(1, 3, size, size, device=device))
    except torch.OutOfMemoryError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise TrainingError(
            f"{spec.model.arch} cannot take {size}x{size} images ({first}). Change data.image_size to "
            f"what the architecture expects (`visionloop archs {spec.model.arch}` shows its default)."
        ) from e
    finally:
        model.train()
    problem = task.check_output(out, class_names)
    if problem is not None:
        raise TrainingError(f"{spec.model.arch} {problem}; check model.kwargs.")


def build(
    spec: TrainSpec, info: DistInfo, device: torch.device, run_dir: RunDir, spec_sha256: str
) -> Components:
    manifest = read_manifest(spec.data.dataset)
    if spec.task != manifest.task:
        raise DataError(
            f"the spec's task is {spec.task!r} but {spec.data.dataset} holds a {manifest.task!r} "
            f"dataset; set task: {manifest.task} or give a {spec.task} dataset."
        )
    task = get_task(manifest.task)
    train_reader = open_split(manifest, spec.data.dataset, "train")
    if train_reader is None:
        raise DataError(f"{spec.data.dataset} has no training images; re-ingest with a train split.")
    split = eval_split(manifest)
    eval_reader = open_split(manifest, spec.data.dataset, split) if split is not None else None

    if spec.data.batch_size % info.world_size:
        fitting = spec.data.batch_size // info.world_size * info.world_size or info.world_size
        raise TrainingError(
            f"data.batch_size {spec.data.batch_size} is the global batch and must divide evenly over "
            f"{info.world_size} processes; use e.g. {fitting}."
        )
    held_out: tuple[int, ...] = ()
    if spec.data.holdout is not None:
        h = spec.data.holdout
        if len(train_reader) < h.folds:
            raise DataError(
                f"data.holdout asks for {h.folds} folds of a train split of {len(train_reader)} images; "
                "use fewer folds."
            )
        held_out = tuple(holdout_positions(len(train_reader), h.folds, h.fold, h.seed))
    trained = len(train_reader) - len(held_out)
    steps_per_epoch = trained // spec.data.batch_size
    if steps_per_epoch == 0:
        left = f" ({len(held_out)} held out)" if held_out else ""
        raise TrainingError(
            f"the train split has {trained} images to train on{left}, fewer than one batch of "
            f"{spec.data.batch_size}; lower data.batch_size."
        )
    total_steps = spec.steps or (spec.epochs or 1) * steps_per_epoch

    model = task.build_model(
        spec.model.arch,
        manifest.classes,
        pretrained=spec.model.pretrained,
        kwargs=spec.model.kwargs,
        image_size=spec.data.image_size,
        pretrained_backbone=spec.model.pretrained_backbone,
    )
    model.to(device)
    check_input_size(model, spec, task, manifest.classes, device)
    if spec.model.channels_last and spec.distributed != "fsdp":
        # FSDP2 (torch 2.14) cannot shard non-contiguous parameters; under fsdp only the input
        # batches are channels-last, and convolutions follow their input's layout.
        model.to(memory_format=torch.channels_last)
    num_params = sum(p.numel() for p in model.parameters())
    sharded = spec.distributed == "fsdp" and info.enabled
    if sharded:
        # Before the optimizer: sharding replaces the parameters it must hold (see sharding.py).
        model = shard_model(model, device)
    optimizer = build_optimizer(model, spec.optimizer)
    scheduler = build_scheduler(optimizer, spec.schedule, total_steps, steps_per_epoch)
    wrapped: nn.Module = model
    if info.enabled and not sharded:
        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if spec.model.compile:
        wrapped = torch.compile(wrapped)  # type: ignore[assignment]
    # A model that normalises its own input gets [0, 1] images (and its card says so).
    mean, std = ((0.0, 0.0, 0.0), (1.0, 1.0, 1.0)) if task.model_normalizes else normalization(spec, manifest)
    return Components(
        spec=spec,
        dist=info,
        device=device,
        run_dir=run_dir,
        manifest=manifest,
        task=task,
        train_reader=train_reader,
        train_dataset=task.train_dataset(train_reader, spec),
        eval_dataset=task.eval_dataset(eval_reader, spec) if eval_reader is not None else None,
        eval_split=split,
        model=wrapped,
        optimizer=optimizer,
        scheduler=scheduler,
        loss_fn=task.loss_fn(spec),
        mean=mean,
        std=std,
        total_steps=total_steps,
        steps_per_epoch=steps_per_epoch,
        num_params=num_params,
        spec_sha256=spec_sha256,
        held_out=held_out,
    )
