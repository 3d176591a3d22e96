"""What the trainer tells the outside world while it runs.

The trainer calls these hooks; the CLI passes a Rich implementation, a library user can pass
their own, and every event is also written to the run's `train.log` through `logging`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class StartInfo:
    run_dir: Path
    run_id: str | None
    resumed_from_step: int | None
    total_steps: int
    steps_per_epoch: int
    epochs: int
    device: str
    precision: str
    world_size: int
    num_params: int
    train_images: int
    val_images: int
    dataset_version: str


@dataclass
class TrainResult:
    """What `train()` returns; `exit_code` is 0 done, 75 preempted (resumable)."""

    exit_code: int
    run_dir: Path
    step: int
    total_steps: int
    run_id: str | None = None
    final_metrics: dict[str, float] = field(default_factory=dict)
    best_metric: float | None = None
    checkpoints: list[Path] = field(default_factory=list)
    final_weights: Path | None = None
    model_card: Path | None = None
    train_seconds: float = 0.0
    images_per_s: float = 0.0
    ui_command: str | None = None
    already_finished: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class Reporter:
    """No-op base: subclass and override what you want to show."""

    def start(self, info: StartInfo) -> None: ...

    def epoch_start(self, epoch: int, first_step: int, last_step: int) -> None: ...

    def step(self, step: int, loss: float | None, lr: float, images_per_s: float | None) -> None: ...

    def eval_start(self, epoch: int, batches: int) -> None: ...

    def eval_batch(self) -> None: ...

    def eval_end(self, epoch: float, step: int, metrics: dict[str, float], summary: str) -> None: ...

    def checkpoint(self, step: int, stall_s: float) -> None: ...

    def message(self, text: str) -> None: ...

    def finish(self, result: TrainResult) -> None: ...
