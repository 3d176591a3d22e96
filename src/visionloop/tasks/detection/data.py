"""Shard records → detection samples: (uint8 image (3, S, S), target dict).

A target is `{"boxes": float32 (N, 4) xyxy in the letterboxed input's pixels, "labels":
int64 (N,) 0-based class indices, "scale": the letterbox scale (input pixels per stored-image
pixel; the boxes divided by it are in the stored image's pixels), "image_id": the record's
dataset-wide index, "orig_size": (height, width) of the stored image}`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from visionloop.data.loader import decode_rgb
from visionloop.data.sampler import SampleKey
from visionloop.data.shards import Record, ShardReader, record_field
from visionloop.tasks.detection.boxes import decode_boxes
from visionloop.tasks.detection.transforms import DetectionEvalTransform, DetectionTrainTransform

Target = dict[str, Any]
Sample = tuple[torch.Tensor, Target]


def record_boxes(record: Record, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A record's boxes (N, 4) float32 xyxy in stored-image pixels and labels (N,) int64."""
    data = record_field(record, "boxes")
    boxes, labels = decode_boxes(data, num_classes, where=f"record {record['index']}")
    return torch.from_numpy(boxes), torch.from_numpy(labels)


def make_target(
    boxes: torch.Tensor, labels: torch.Tensor, scale: float, image_id: int, orig_size: tuple[int, int]
) -> Target:
    return {
        "boxes": boxes.to(torch.float32).reshape(-1, 4),
        "labels": labels.to(torch.int64).reshape(-1),
        "scale": float(scale),
        "image_id": int(image_id),
        "orig_size": (int(orig_size[0]), int(orig_size[1])),
    }


class ShardDetectionDataset(Dataset[Sample]):
    """Indexed by (record position, epoch); returns (uint8 image (3, S, S), target)."""

    def __init__(
        self,
        reader: ShardReader,
        transform: DetectionTrainTransform | DetectionEvalTransform,
        class_names: Sequence[str],
    ) -> None:
        self.reader = reader
        self.transform = transform
        self.num_classes = len(class_names)

    def __len__(self) -> int:
        return len(self.reader)

    def __getitem__(self, key: SampleKey) -> Sample:
        return self._sample(self.reader[key[0]], key[1])

    def __getitems__(self, keys: list[SampleKey]) -> list[Sample]:
        """A whole batch at once: records are read in shard order, samples come back in the
        sampler's order."""
        records = self.reader.read_many([position for position, _ in keys])
        return [self._sample(r, epoch) for r, (_, epoch) in zip(records, keys, strict=True)]

    def _sample(self, record: Record, epoch: int) -> Sample:
        image = decode_rgb(record["image"])
        boxes, labels = record_boxes(record, self.num_classes)
        orig = (int(image.shape[-2]), int(image.shape[-1]))
        if isinstance(self.transform, DetectionTrainTransform):
            out, boxes, labels, scale = self.transform(image, boxes, labels, epoch, record["index"])
        else:
            out, boxes, labels, scale = self.transform(image, boxes, labels)
        return out, make_target(boxes, labels, scale, record["index"], orig)
