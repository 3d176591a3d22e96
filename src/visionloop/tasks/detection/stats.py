"""What a detection dataset holds beyond the image counts: per split, boxes by class and by
COCO size bucket. Ingest accumulates it (`DetectionAccumulator`) and stores it in the manifest's
`task_stats`; `DetectionTask.dataset_stats` reads it back as `DetectionStats`."""

from __future__ import annotations

from collections import Counter
from typing import cast

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field

from visionloop.data.manifest import SPLITS, SplitName

SPLIT_NAMES = cast(tuple[SplitName, ...], SPLITS)
# COCO's object size buckets, by box area in stored-image pixels: small < 32², medium < 96².
SMALL_AREA = 32**2
MEDIUM_AREA = 96**2


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BoxSizes(_Strict):
    """Boxes counted by COCO's area buckets, in pixels of the stored image (after --max-side)."""

    small: int = Field(0, description="area < 32²")
    medium: int = Field(0, description="32² <= area < 96²")
    large: int = Field(0, description="area >= 96²")


class DetectionSplitStats(_Strict):
    images: int
    background_images: int = Field(description="images stored with no box")
    instances: dict[str, int] = Field(description="boxes per class name, every class listed")
    box_sizes: BoxSizes
    clipped_boxes: int = Field(0, description="boxes clipped to the image edges (kept)")
    difficult_boxes: int = Field(
        0,
        description="boxes the source flags difficult (VOC) or crowd (COCO): stored with the flag, "
        "left out of training targets and ignored by evaluation",
    )


class DetectionStats(_Strict):
    """The manifest's `task_stats` of a detection dataset."""

    splits: dict[SplitName, DetectionSplitStats]
    clipped_boxes: int = Field(0, description="boxes clipped to the image edges and kept, all splits")
    dropped_boxes: int = Field(
        0, description="boxes left out (outside the image, no area, unknown class, ...), see rejected.jsonl"
    )


class DetectionAccumulator:
    """Per split: images, background images, boxes per class and by COCO size bucket."""

    def __init__(self, classes: list[str]) -> None:
        self.classes = classes
        self.images: dict[SplitName, int] = dict.fromkeys(SPLIT_NAMES, 0)
        self.background: dict[SplitName, int] = dict.fromkeys(SPLIT_NAMES, 0)
        self.instances: dict[SplitName, Counter[int]] = {s: Counter() for s in SPLIT_NAMES}
        self.sizes: dict[SplitName, list[int]] = {s: [0, 0, 0] for s in SPLIT_NAMES}
        self.clipped: dict[SplitName, int] = dict.fromkeys(SPLIT_NAMES, 0)
        self.difficult: dict[SplitName, int] = dict.fromkeys(SPLIT_NAMES, 0)

    def add(
        self,
        split: SplitName,
        boxes: npt.NDArray[np.float64],
        labels: npt.NDArray[np.int64],
        *,
        clipped: int = 0,
        difficult: int = 0,
    ) -> None:
        """One stored image's boxes, (N, 4) xyxy in stored-image pixels, and class indices."""
        self.images[split] += 1
        if len(labels) == 0:
            self.background[split] += 1
        self.instances[split].update(int(v) for v in labels)
        area = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
        small = int((area < SMALL_AREA).sum())
        medium = int(((area >= SMALL_AREA) & (area < MEDIUM_AREA)).sum())
        bucket = self.sizes[split]
        bucket[0] += small
        bucket[1] += medium
        bucket[2] += len(area) - small - medium
        self.clipped[split] += clipped
        self.difficult[split] += difficult

    def stats(self, dropped_boxes: int, unplaced_clipped: int = 0) -> DetectionStats:
        """`unplaced_clipped`: clipped boxes of stored images the reader did not tie to one image."""
        splits = {
            s: DetectionSplitStats(
                images=self.images[s],
                background_images=self.background[s],
                instances={name: self.instances[s][i] for i, name in enumerate(self.classes)},
                box_sizes=BoxSizes(small=self.sizes[s][0], medium=self.sizes[s][1], large=self.sizes[s][2]),
                clipped_boxes=self.clipped[s],
                difficult_boxes=self.difficult[s],
            )
            for s in SPLIT_NAMES
        }
        return DetectionStats(
            splits=splits,
            clipped_boxes=sum(self.clipped.values()) + unplaced_clipped,
            dropped_boxes=dropped_boxes,
        )
