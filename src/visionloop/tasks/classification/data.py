"""Shard records → classification samples: (uint8 image (3, S, S), integer label)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from visionloop.data.sampler import SampleKey
from visionloop.data.shards import Record, ShardReader
from visionloop.tasks.classification.transforms import EvalTransform, TrainTransform, decode_rgb


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
