"""What `visionloop data add` needs to know of a detection record: the classes its boxes name,
the same boxes under the parent's class numbering, and the version's box statistics.

Boxes are decoded from the record's bytes (a few floats per box); the image never is. The
float32 rows decode and re-encode exactly, so a remapped record differs only in its classes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from visionloop.data.manifest import DatasetManifest, SplitName
from visionloop.data.shards import Record, make_record, record_field
from visionloop.tasks.detection.boxes import decode_boxes, encode_boxes
from visionloop.tasks.detection.stats import DetectionAccumulator, DetectionStats


def record_classes(record: Record) -> tuple[int, ...]:
    """The classes of the record's boxes, each once, in order (none: a background image)."""
    _, labels, _ = decode_boxes(record_field(record, "boxes"))
    return tuple(sorted({int(v) for v in labels}))


def remap_classes(record: Record, mapping: Sequence[int]) -> Record:
    boxes, labels, ignore = decode_boxes(record_field(record, "boxes"))
    table = np.asarray(mapping, dtype=np.int64)
    encoded = encode_boxes(boxes, table[labels] if len(labels) else labels, ignore if ignore.any() else None)
    # `label` holds the number of boxes, which a remap does not change.
    return make_record(record["image"], int(record["label"]), record["index"], boxes=encoded)


def _stats(manifest: DatasetManifest) -> DetectionStats | None:
    return None if manifest.task_stats is None else DetectionStats.model_validate(manifest.task_stats)


def version_stats(
    classes: Sequence[str],
    records: Sequence[tuple[SplitName, Record]],
    parent: DatasetManifest,
    incoming: DatasetManifest,
) -> dict[str, Any]:
    """Boxes per class and size, background images and ignored boxes, counted over the
    version's records. What the records do not hold is carried from the two manifests:
    boxes dropped at either ingest, and boxes clipped to the image edge (per split; a
    relabelled image keeps its old clipped count there)."""
    acc = DetectionAccumulator(list(classes))
    for split, record in records:
        boxes, labels, ignore = decode_boxes(record_field(record, "boxes"))
        acc.add(split, boxes.astype(np.float64), labels, difficult=int(ignore.sum()))
    before, new = _stats(parent), _stats(incoming)
    dropped = 0
    for earlier in (before, new):
        if earlier is None:
            continue
        dropped += earlier.dropped_boxes
        for split, info in earlier.splits.items():
            acc.clipped[split] += info.clipped_boxes
    return acc.stats(dropped_boxes=dropped).model_dump(mode="json")
