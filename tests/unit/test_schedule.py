"""Learning-rate schedules are pure functions of the step."""

from __future__ import annotations

import math

import pytest
import torch

from visionloop.specs import OptimizerSpec, ScheduleSpec
from visionloop.train.schedule import build_optimizer, build_scheduler, lr_multiplier


def test_linear_warmup_then_cosine_to_the_floor() -> None:
    f = lr_multiplier(
        ScheduleSpec(name="cosine", warmup_steps=10, min_lr_ratio=0.1), total_steps=110, steps_per_epoch=11
    )
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(110) == pytest.approx(0.1)


def test_warmup_epochs_convert_with_steps_per_epoch() -> None:
    f = lr_multiplier(ScheduleSpec(name="constant", warmup_epochs=2), total_steps=100, steps_per_epoch=5)
    assert [f(s) for s in (0, 4, 9, 10, 50)] == pytest.approx([0.1, 0.5, 1.0, 1.0, 1.0])


def test_step_decay() -> None:
    f = lr_multiplier(
        ScheduleSpec(name="step", step_epochs=2, gamma=0.5), total_steps=100, steps_per_epoch=10
    )
    assert [f(s) for s in (0, 19, 20, 45)] == pytest.approx([1.0, 1.0, 0.5, 0.25])


def test_scheduler_drives_the_optimizer_lr_and_skips_decay_for_norm_params() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    opt = build_optimizer(model, OptimizerSpec(name="sgd", lr=0.5, weight_decay=0.1))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert len(opt.param_groups[0]["params"]) == 1  # only the Linear weight decays
    sched = build_scheduler(
        opt, ScheduleSpec(name="linear", warmup_steps=0), total_steps=4, steps_per_epoch=4
    )
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.5, 0.375, 0.25, 0.125])
