"""The contract between the task-agnostic trainer and a task (classification, detection, ...).

A task decides what a sample is (image + target), how it is augmented, the loss, and what
an evaluation measures. The trainer only moves batches, steps the optimizer, checkpoints and
logs. Adding a task adds a subpackage here and one line to `get_task`; the trainer is not
touched.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from visionloop.data.manifest import DatasetManifest
from visionloop.data.shards import ShardReader
from visionloop.models import ModelCard
from visionloop.specs import TrainSpec

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class EvalResult:
    """Scalar metrics (logged as `val/<name>`), a JSON-safe report, and files to attach."""

    metrics: dict[str, float]
    report: dict[str, Any] = field(default_factory=dict)
    summary: str = ""


class Evaluator(ABC):
    """Accumulates one pass over an eval split. Its state is one tensor so that DDP ranks can
    `all_reduce` it and every rank ends with the exact whole-split result."""

    @abstractmethod
    def update(self, outputs: torch.Tensor, targets: torch.Tensor, loss_sum: float) -> None: ...

    @abstractmethod
    def state(self) -> torch.Tensor: ...

    @abstractmethod
    def load_state(self, state: torch.Tensor) -> None: ...

    @abstractmethod
    def compute(self) -> EvalResult: ...

    def write_artifacts(self, result: EvalResult, out_dir: Path) -> list[Path]:
        """Write plots/tables for `result` under out_dir; return what was written."""
        return []


class Task(ABC):
    name: str

    @abstractmethod
    def train_dataset(self, reader: ShardReader, spec: TrainSpec) -> Dataset[Any]: ...

    @abstractmethod
    def eval_dataset(self, reader: ShardReader, spec: TrainSpec) -> Dataset[Any]: ...

    @abstractmethod
    def loss_fn(self, spec: TrainSpec) -> LossFn: ...

    @abstractmethod
    def evaluator(self, class_names: Sequence[str]) -> Evaluator: ...

    @abstractmethod
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
        """What a consumer of the final weights needs: preprocessing, labels, provenance."""


def get_task(name: str) -> Task:
    if name == "classification":
        from visionloop.tasks.classification.task import ClassificationTask

        return ClassificationTask()
    raise ValueError(f"unknown task {name!r}; known: classification")
