"""One evaluation pass of a registered model over a dataset split, clean or corrupted.

The images go the way a served image goes: the shard's stored image decoded, then (for a
stress pass) corrupted as a camera would have corrupted it, before any resizing, then the
model card's eval preprocessing. The task's own evaluator scores the outputs, so every task's
metrics come out of `visionloop eval` without this module knowing what they are. Targets are
the task's `record_targets`, what the export gate and bench score against.

A pass asked to keep every image's result (`keep_images`, for slices) runs one image per batch
(a valid batch for every task's evaluator) and keeps each image's outputs and targets as the
task reduces them (`Task.image_result`), so that any subset of the images can be scored again
without the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from visionloop.data.loader import decode_rgb
from visionloop.data.shards import ShardReader
from visionloop.models.card import ModelCard
from visionloop.tasks import EvalResult, Evaluator, LossFn, Task

# (uint8 HxWxC image, its position in the split) -> the corrupted image, same shape.
Corrupter = Callable[[np.ndarray, int], np.ndarray]


@dataclass(frozen=True)
class ImageResult:
    """One image's outputs and targets (a one-image batch, on the CPU) and its summed loss."""

    outputs: Any
    targets: Any
    loss_sum: float


@dataclass
class PassResult:
    """The evaluator (which draws the task's plots) and its result, and (for a task that has
    them) every image's logits and label, for calibration; with `keep_images`, every image's
    result, in the order of the positions scored."""

    evaluator: Evaluator
    result: EvalResult
    logits: np.ndarray | None
    labels: np.ndarray | None
    images: list[ImageResult] | None = None


def batches(
    task: Task,
    card: ModelCard,
    reader: ShardReader,
    positions: Sequence[int],
    *,
    batch_size: int,
    corrupter: Corrupter | None = None,
) -> Iterator[tuple[torch.Tensor, Any]]:
    """(preprocessed images (B, C, H, W), the task's targets) over `positions`, in order."""
    transform = card.eval_preprocess().to_transform()
    for start in range(0, len(positions), batch_size):
        chunk = list(positions[start : start + batch_size])
        records = reader.read_many(chunk)
        images = []
        for position, record in zip(chunk, records, strict=True):
            image = decode_rgb(record["image"])  # uint8 (3, H, W)
            if corrupter is not None:
                hwc = np.ascontiguousarray(image.permute(1, 2, 0).numpy())
                image = torch.from_numpy(np.ascontiguousarray(corrupter(hwc, position))).permute(2, 0, 1)
            images.append(transform(image))
        yield torch.stack(images), task.record_targets(records, image_size=card.input_size[1])


def score(
    task: Task,
    card: ModelCard,
    model: nn.Module,
    loss_fn: LossFn,
    reader: ShardReader,
    positions: Sequence[int],
    *,
    device: torch.device,
    batch_size: int = 64,
    corrupter: Corrupter | None = None,
    keep_images: bool = False,
) -> PassResult:
    """Score `model` (eval mode) on the images at `positions`, optionally corrupted; with
    `keep_images`, one image per batch, each image's result kept."""
    evaluator = task.evaluator(card.class_names)
    logits: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    kept: list[ImageResult] | None = [] if keep_images else None
    if keep_images:
        batch_size = 1
    model.eval()
    with torch.inference_mode():
        for x, y in batches(task, card, reader, positions, batch_size=batch_size, corrupter=corrupter):
            x = x.to(device)
            y = task.targets_to(y, device)
            out, loss_sum = task.eval_forward(model, x, y, loss_fn)
            evaluator.update(out, y, loss_sum)
            if kept is not None:
                outputs, targets = task.image_result(out, y)
                kept.append(ImageResult(outputs, targets, float(loss_sum)))
            pair = task.calibration_logits(out, y)
            if pair is not None:
                logits.append(pair[0].detach().float().cpu())
                labels.append(pair[1].detach().cpu())
    return PassResult(
        evaluator=evaluator,
        result=evaluator.compute(),
        logits=torch.cat(logits).numpy() if logits else None,
        labels=torch.cat(labels).numpy() if labels else None,
        images=kept,
    )
