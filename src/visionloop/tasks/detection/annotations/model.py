"""The common form every detection reader returns, and the reasons it gives for what it left out.

Coordinates are floats in absolute pixels of the *upright* image (after its EXIF orientation
is applied, as ingest stores it), corners `(x1, y1, x2, y2)` with `0 <= x1 < x2 <= width` and
`0 <= y1 < y2 <= height`: continuous coordinates, pixel edges, so a box covering the whole
image is `(0, 0, width, height)`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from visionloop.data.manifest import SplitName
from visionloop.data.metadata import Metadata

Box = tuple[float, float, float, float]


class IssueReason(StrEnum):
    """Why an annotation, an image or a file was left out or repaired; written as `reason` in
    rejected.jsonl."""

    # A box, repaired and kept:
    BOX_CLIPPED = "box_clipped"
    # A box, left out:
    BOX_ZERO_AREA = "box_zero_area"
    BOX_INVERTED = "box_inverted"
    BOX_NOT_FINITE = "box_not_finite"
    BOX_OUTSIDE_IMAGE = "box_outside_image"
    BOX_ROTATED = "box_rotated"
    DUPLICATE_BOX = "duplicate_box"
    UNKNOWN_CLASS = "unknown_class"
    MALFORMED_ANNOTATION = "malformed_annotation"
    # An image (and every box on it), left out:
    MISSING_IMAGE = "missing_image"
    DUPLICATE_IMAGE = "duplicate_image"
    AMBIGUOUS_IMAGE = "ambiguous_image"
    UNREADABLE_IMAGE = "unreadable_image"
    IMAGE_SIZE_MISMATCH = "image_size_mismatch"
    PATH_OUTSIDE_SOURCE = "path_outside_source"
    LINK_OUTSIDE_SOURCE = "link_outside_source"  # as classification ingest's sources.LINK_OUTSIDE
    # A whole annotation file of a many-file format (a YOLO txt, a VOC xml), left out:
    UNREADABLE_ANNOTATION_FILE = "unreadable_annotation_file"
    UNSAFE_XML = "unsafe_xml"


@dataclass(frozen=True, slots=True)
class Issue:
    """One thing the reader rejected (`kept=False`) or repaired (`kept=True`)."""

    reason: IssueReason
    message: str  # names the file, the line or annotation id, the problem and what to do
    file: str | None = None  # the annotation file, relative to the source root where possible
    line: int | None = None  # 1-based, for line formats (YOLO)
    annotation: str | None = None  # the annotation's id in its file (COCO id, VOC object index, ...)
    image: str | None = None  # the image it belongs to, relative to the source root
    kept: bool = False

    def to_row(self) -> dict[str, object]:
        """A row of rejected.jsonl (`path` as classification ingest writes it)."""
        row: dict[str, object] = {
            "path": self.image or self.file or "",
            "reason": self.reason.value,
            "message": self.message,
            "kept": self.kept,
        }
        if self.file is not None:
            row["file"] = self.file
        if self.line is not None:
            row["line"] = self.line
        if self.annotation is not None:
            row["annotation"] = self.annotation
        return row


@dataclass(slots=True)
class DetectionSample:
    """One image and its boxes. `width`/`height` are of the upright image; `boxes[i]` has class
    `labels[i]` (an index into `DetectionSource.classes`) and `difficult[i]` (VOC's difficult
    flag, COCO's iscrowd: stored with the box by ingest; training leaves such boxes out of its
    targets and evaluation ignores them)."""

    image: Path  # absolute path of the file to read
    rel: str  # its path relative to the source root, posix
    width: int
    height: int
    boxes: list[Box] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    difficult: list[bool] = field(default_factory=list)
    split: SplitName | None = None
    # What the source says about the image besides its boxes (COCO: the image entry's own
    # fields, such as camera or site), cleaned by `data.metadata`; ingest stores it as the
    # record's metadata.
    metadata: Metadata = field(default_factory=dict)

    @property
    def background(self) -> bool:
        return not self.boxes


@dataclass(frozen=True, slots=True)
class DetectionCounts:
    images: int
    background_images: int
    instances: dict[str, int]  # per class name, every class listed (0 included)
    difficult: int
    clipped_boxes: int
    issues: dict[str, int]  # per reason


@dataclass(slots=True)
class DetectionSource:
    """What a reader found: classes, the images it keeps (sorted by `rel`), and the issues."""

    format: str
    root: Path
    classes: list[str]
    samples: list[DetectionSample]
    issues: list[Issue] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # The metadata columns the samples' `metadata` use, in order (none: no metadata).
    metadata_columns: list[str] = field(default_factory=list)

    def counts(self) -> DetectionCounts:
        per_class = Counter(label for s in self.samples for label in s.labels)
        reasons = Counter(i.reason.value for i in self.issues)
        return DetectionCounts(
            images=len(self.samples),
            background_images=sum(1 for s in self.samples if s.background),
            instances={name: per_class.get(i, 0) for i, name in enumerate(self.classes)},
            difficult=sum(sum(s.difficult) for s in self.samples),
            clipped_boxes=reasons.get(IssueReason.BOX_CLIPPED.value, 0),
            issues=dict(sorted(reasons.items())),
        )
