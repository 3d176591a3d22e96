"""Optimizer and learning-rate schedule from the spec.

The LR is a pure function of the optimizer step (warm-up, then the chosen decay), wrapped in
`LambdaLR` so the scheduler's checkpoint state is just its step counter.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from visionloop.specs import OptimizerSpec, ScheduleSpec


def build_optimizer(model: nn.Module, spec: OptimizerSpec) -> torch.optim.Optimizer:
    # No weight decay on biases and normalisation parameters (the usual recipe; decaying a
    # BatchNorm scale towards zero only fights the normalisation).
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (no_decay if p.ndim <= 1 else decay).append(p)
    groups: Iterable[dict[str, object]] = [
        {"params": decay, "weight_decay": spec.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if spec.name == "sgd":
        return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum, nesterov=spec.nesterov)
    if spec.name == "adam":
        return torch.optim.Adam(groups, lr=spec.lr, betas=spec.betas)
    return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas)


def lr_multiplier(spec: ScheduleSpec, total_steps: int, steps_per_epoch: int) -> Callable[[int], float]:
    """step → multiplier of the base LR. `step` counts optimizer steps already taken."""
    warmup = spec.warmup_steps or round(spec.warmup_epochs * steps_per_epoch)
    warmup = min(warmup, max(total_steps - 1, 0))
    floor = spec.min_lr_ratio
    decay_steps = max(total_steps - warmup, 1)
    step_every = max(round(spec.step_epochs * steps_per_epoch), 1)

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        t = min((step - warmup) / decay_steps, 1.0)
        if spec.name == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
        if spec.name == "linear":
            return floor + (1 - floor) * (1 - t)
        if spec.name == "step":
            return max(spec.gamma ** ((step - warmup) // step_every), floor)
        return 1.0

    return f


def build_scheduler(
    optimizer: torch.optim.Optimizer, spec: ScheduleSpec, total_steps: int, steps_per_epoch: int
) -> LambdaLR:
    return LambdaLR(optimizer, lr_multiplier(spec, total_steps, steps_per_epoch))
