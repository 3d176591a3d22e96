"""Images for parity, the accuracy gate and int8 calibration, from the model's own dataset.

The dataset is the one the version was trained on (its lineage records the path; the card
records the version, which must still match), preprocessed with the card's eval recipe —
exactly what a served image meets.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from visionloop.core.errors import DataError
from visionloop.data.loader import decode_rgb
from visionloop.data.manifest import DatasetManifest, eval_split, read_manifest, shard_dir_of
from visionloop.data.shards import ShardReader
from visionloop.models.card import ModelCard
from visionloop.registry import ModelVersionInfo
from visionloop.tasks import Task, get_task


@dataclass(frozen=True)
class ModelDataset:
    path: Path
    manifest: DatasetManifest
    card: ModelCard

    def reader(self, split: str) -> ShardReader | None:
        info = self.manifest.splits.get(split)  # type: ignore[call-overload]
        if info is None or info.count == 0:
            return None
        return ShardReader(shard_dir_of(self.path, info))

    @property
    def task(self) -> Task:
        return get_task(self.card.task)

    def eval_split(self) -> tuple[str, ShardReader]:
        split = eval_split(self.manifest)
        reader = self.reader(split) if split is not None else None
        if split is not None and reader is not None:
            return split, reader
        raise DataError(
            f"{self.path} has no val or test images to check an export on. Re-ingest it with a "
            "validation split (`visionloop data ingest SOURCE --out DIR --val-fraction 0.1`)."
        )

    def batches(
        self, reader: ShardReader, positions: list[int], batch_size: int = 64
    ) -> Iterator[tuple[torch.Tensor, Any]]:
        """(images (B, C, H, W) float32 preprocessed, the task's targets) in `positions` order."""
        transform = self.card.eval_preprocess().to_transform()
        targets_of = functools.partial(self.task.record_targets, image_size=self.card.input_size[1])
        for start in range(0, len(positions), batch_size):
            records = reader.read_many(positions[start : start + batch_size])
            images = torch.stack([transform(decode_rgb(r["image"])) for r in records])
            yield images, targets_of(records)

    def calibration_images(self, count: int, seed: int = 0) -> torch.Tensor:
        """`count` training images (a seeded random sample), preprocessed for the model."""
        reader = self.reader("train")
        if reader is None:
            raise DataError(f"{self.path} has no training images to calibrate int8 on.")
        positions = sorted(random.Random(seed).sample(range(len(reader)), min(count, len(reader))))
        return torch.cat([x for x, _ in self.batches(reader, positions)])


def open_model_dataset(info: ModelVersionInfo, dataset: Path | None = None) -> ModelDataset:
    """The dataset `info` was trained on (or `dataset`, which must be the same version)."""
    card = info.card()
    recorded = info.lineage().get("dataset_path")
    # Only a string is a path: a hand-edited lineage.json holding a number or a list here made
    # Path() raise TypeError past the CLI.
    recorded = recorded if isinstance(recorded, str) else None
    path = Path(dataset) if dataset is not None else Path(recorded) if recorded else None
    if path is None:
        raise DataError(
            f"{info.ref} does not record where its dataset is; pass it with --dataset DIR "
            f"(dataset version {card.dataset_version})."
        )
    manifest = read_manifest(path)
    if card.dataset_version is not None and manifest.version != card.dataset_version:
        raise DataError(
            f"{path} is dataset version {manifest.version[:12]}, but {info.ref} was trained on "
            f"{card.dataset_version[:12]}: its validation images would not measure the same thing. "
            "Pass the original dataset with --dataset DIR."
        )
    if manifest.task != card.task:
        raise DataError(f"{path} is a {manifest.task} dataset, {info.ref} a {card.task} model.")
    if list(manifest.classes) != list(card.class_names):
        raise DataError(f"{path} has classes {manifest.classes}, the model {card.class_names}.")
    return ModelDataset(path=path, manifest=manifest, card=card)
