"""Shard records → detection samples: (uint8 image (3, S, S), target dict).

A target is `{"boxes": float32 (N, 4) xyxy in the letterboxed input's pixels, "labels":
int64 (N,) 0-based class indices, "iscrowd": bool (N,), "scale": the letterbox scale (input
pixels per stored-image pixel; the boxes divided by it are in the stored image's pixels),
"image_id": the record's dataset-wide index, "orig_size": (height, width) of the stored
image}`.

Ignored boxes (`iscrowd` True: COCO's crowd regions, VOC's difficult objects, stored with
their flag by ingest) follow torchvision's detection references: a training sample leaves
them out before augmentation (a crowd box is not one object to regress to), so its
`iscrowd` is all False; an evaluation sample keeps them, flagged, for the COCO evaluation to
ignore (a detection on one is neither right nor wrong, and it is never missed).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch
from PIL import Image
from torch.utils.data import Dataset

from visionloop.data.loader import decode_rgb
from visionloop.data.sampler import SampleKey
from visionloop.data.shards import Record, ShardReader, record_field
from visionloop.models.card import letterbox_scale
from visionloop.tasks.detection.boxes import decode_boxes
from visionloop.tasks.detection.transforms import DetectionEvalTransform, DetectionTrainTransform

Target = dict[str, Any]
Sample = tuple[torch.Tensor, Target]


def record_objects(record: Record, num_classes: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A record's boxes (N, 4) float32 xyxy in stored-image pixels, labels (N,) int64 and
    ignore flags (N,) bool."""
    data = record_field(record, "boxes")
    boxes, labels, ignore = decode_boxes(data, num_classes, where=f"record {record['index']}")
    return torch.from_numpy(boxes), torch.from_numpy(labels), torch.from_numpy(ignore)


def make_target(
    boxes: torch.Tensor,
    labels: torch.Tensor,
    scale: float,
    image_id: int,
    orig_size: tuple[int, int],
    iscrowd: torch.Tensor | None = None,
) -> Target:
    """A target dict (see the module docstring); `iscrowd` None: no box is ignored."""
    labels = labels.to(torch.int64).reshape(-1)
    crowd = torch.zeros(len(labels), dtype=torch.bool) if iscrowd is None else iscrowd.to(torch.bool)
    return {
        "boxes": boxes.to(torch.float32).reshape(-1, 4),
        "labels": labels,
        "iscrowd": crowd.reshape(-1),
        "scale": float(scale),
        "image_id": int(image_id),
        "orig_size": (int(orig_size[0]), int(orig_size[1])),
    }


def record_target(record: Record, image_size: int, num_classes: int = 2**24) -> Target:
    """A raw record's evaluation target, as the eval dataset makes it without decoding the
    image: boxes in the pixels of the image letterboxed to `image_size`, ignored boxes kept
    and flagged. `num_classes` defaults to the encoding's limit for callers without the
    class list (the rows are still checked whole and finite)."""
    with Image.open(io.BytesIO(record["image"])) as im:
        w, h = im.size
    scale = letterbox_scale(h, w, (image_size, image_size))
    boxes, labels, ignore = record_objects(record, num_classes)
    scaled = (boxes * scale).clamp(0.0, float(image_size))
    return make_target(scaled, labels, scale, record["index"], (h, w), ignore)


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
        boxes, labels, ignore = record_objects(record, self.num_classes)
        orig = (int(image.shape[-2]), int(image.shape[-1]))
        if isinstance(self.transform, DetectionTrainTransform):
            keep = ~ignore
            out, boxes, labels, scale = self.transform(
                image, boxes[keep], labels[keep], epoch, record["index"]
            )
            return out, make_target(boxes, labels, scale, record["index"], orig)
        # The eval transform only letterboxes: every box stays, in order, with its flag.
        out, boxes, labels, scale = self.transform(image, boxes, labels)
        return out, make_target(boxes, labels, scale, record["index"], orig, ignore)
