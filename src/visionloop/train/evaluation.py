"""One evaluation pass of the training loop over the held-out split, on every rank.

Kept apart from the loop's stepping and checkpointing: this is the part that must keep the
ranks' collectives matched (each rank runs the same number of stop checks, whatever its
share of the split) and that scores with the weights a checkpoint will hold.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from visionloop.data.normalize import Normalizer
from visionloop.tasks import EvalResult, Evaluator, Task
from visionloop.train import dist
from visionloop.train.device import Precision
from visionloop.train.report import Reporter
from visionloop.train.signals import StopRequest


def eval_rounds(eval_size: int, batch_size: int, world_size: int) -> int:
    """Eval batches of the busiest rank (rank 0 holds the most under a strided split)."""
    per_rank = -(-eval_size // world_size)
    return -(-per_rank // batch_size)


def score_split(
    *,
    task: Task,
    classes: list[str],
    model: nn.Module,
    batches: Iterable[Any],
    rounds: int,
    normalize: Normalizer,
    channels_last: bool,
    precision: Precision,
    device: torch.device,
    info: dist.DistInfo,
    stop: StopRequest,
    reporter: Reporter,
    loss_fn: Any,
) -> tuple[Evaluator, EvalResult] | None:
    """Score `model` on this rank's eval batches and reduce over ranks: the evaluator (which
    writes the task's artifacts) and its result; None if a stop was requested midway (the
    caller redoes the evaluation on resume). Leaves `model` in eval mode."""
    evaluator = task.evaluator(classes)
    # Every rank scores its share of the split with the weights that are saved: rank 0's
    # (the BatchNorm statistics of the other ranks drift from them within each step).
    dist.broadcast_buffers(model, info)
    model.eval()
    it = iter(batches)
    with torch.no_grad():
        for _ in range(rounds):
            if dist.any_flag([stop.requested], device, info)[0]:
                return None
            batch = next(it, None)
            if batch is None:
                continue
            x, y = batch
            x = normalize(x.to(device, non_blocking=True), channels_last)
            y = task.targets_to(y, device)
            with precision.autocast(device):
                # The batch's summed loss (the evaluator divides by the split's images).
                out, loss_sum = task.eval_forward(model, x, y, loss_fn)
            evaluator.update(_to_float(out), y, loss_sum)
            reporter.eval_batch()
    evaluator.load_state(dist.all_reduce_sum(evaluator.state().to(device), info).cpu())
    return evaluator, evaluator.compute()


def _to_float(outputs: Any) -> Any:
    """Outputs computed under autocast, in float32 for the evaluator (a tensor, or the tensors
    of a tuple, list or dict — a detector returns several)."""
    if isinstance(outputs, torch.Tensor):
        return outputs.float() if outputs.is_floating_point() else outputs
    if isinstance(outputs, dict):
        return {k: _to_float(v) for k, v in outputs.items()}
    if isinstance(outputs, list | tuple):
        return type(outputs)(_to_float(v) for v in outputs)
    return outputs
