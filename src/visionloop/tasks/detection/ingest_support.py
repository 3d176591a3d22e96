"""Pieces of detection ingest that need no pipeline state: recognising a detection source,
scaling one image's boxes onto the stored image, and the reasons rejected.jsonl groups."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import numpy.typing as npt

from visionloop.tasks.detection.annotations import DetectionSample, DetectionSource, IssueReason
from visionloop.tasks.detection.annotations.common import EPS_PX

TOO_MANY_BOXES = "too_many_boxes"  # rejected.jsonl reason: an image over boxes.MAX_BOXES
# Reasons that leave out one box (the others leave out an image or a whole file).
BOX_REASONS = frozenset(
    {
        IssueReason.BOX_ZERO_AREA,
        IssueReason.BOX_INVERTED,
        IssueReason.BOX_NOT_FINITE,
        IssueReason.BOX_OUTSIDE_IMAGE,
        IssueReason.BOX_ROTATED,
        IssueReason.DUPLICATE_BOX,
        IssueReason.UNKNOWN_CLASS,
        IssueReason.MALFORMED_ANNOTATION,
    }
)
IMAGE_REASONS = frozenset(
    {
        IssueReason.MISSING_IMAGE,
        IssueReason.DUPLICATE_IMAGE,
        IssueReason.AMBIGUOUS_IMAGE,
        IssueReason.UNREADABLE_IMAGE,
        IssueReason.IMAGE_SIZE_MISMATCH,
        IssueReason.PATH_OUTSIDE_SOURCE,
        IssueReason.LINK_OUTSIDE_SOURCE,
    }
)


def is_detection_source(path: Path) -> bool:
    """True when `path` has the layout of a detection source (or of several: reading it then
    asks for --format). An ImageFolder or CSV has none of these markers."""
    from visionloop.tasks.detection.annotations import detect

    path = Path(path)
    if path.is_file():
        return path.suffix.lower() in (".json", ".yaml", ".yml")
    if not path.is_dir():
        return False
    return bool(
        detect._yaml_in(path) is not None
        or (path / "Annotations").is_dir()
        or detect._coco_pairs(path)
        or detect._label_studio_json(path) is not None
    )


def scale_boxes(
    sample: DetectionSample, width: int, height: int
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64], list[int], int]:
    """The sample's boxes on the stored `width x height` image: scaled per axis by exactly the
    factor the image was resized by, clipped to its edges. Returns (boxes, labels, positions
    of the source boxes that kept an area, how many were clipped by more than float noise)."""
    if not sample.boxes:
        return np.zeros((0, 4)), np.zeros(0, dtype=np.int64), [], 0
    sx, sy = width / sample.width, height / sample.height
    raw = np.asarray(sample.boxes, dtype=np.float64).reshape(-1, 4) * np.array([sx, sy, sx, sy])
    limit = np.array([width, height, width, height], dtype=np.float64)
    clipped = np.clip(raw, 0.0, limit)
    moved = int((np.abs(clipped - raw).max(axis=1) > EPS_PX).sum())
    # What the shard will hold is float32: the box must keep an area there too.
    f32 = clipped.astype(np.float32)
    keep = (
        (clipped[:, 2] - clipped[:, 0] >= EPS_PX)
        & (clipped[:, 3] - clipped[:, 1] >= EPS_PX)
        & (f32[:, 2] > f32[:, 0])
        & (f32[:, 3] > f32[:, 1])
    )
    kept = [int(i) for i in np.flatnonzero(keep)]
    labels = np.asarray(sample.labels, dtype=np.int64)
    return clipped[keep], labels[keep], kept, moved


def clipped_per_image(src: DetectionSource) -> Counter[str]:
    """Boxes the reader clipped, per sample `rel` (an issue names its image as the sample does)."""
    rels = {s.rel for s in src.samples}
    return Counter(
        issue.image
        for issue in src.issues
        if issue.reason == IssueReason.BOX_CLIPPED and issue.image is not None and issue.image in rels
    )
