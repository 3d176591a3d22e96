"""What ingest learns about the stored images: counts, sizes, pixel statistics, the version.

Accumulated one image at a time as results stream in, in exact integers (pixel sums fit no
float over a million images), so nothing needs the whole dataset in memory at once.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from array import array
from collections import Counter
from collections.abc import Iterable
from typing import cast

from visionloop.data.imageio import Normalised
from visionloop.data.manifest import (
    FORMAT_VERSION,
    SHARDS_DIR,
    SPLITS,
    ChannelStats,
    ImagePolicy,
    SizeStats,
    SplitInfo,
    SplitName,
)

# The manifest's SPLITS, typed as split names.
SPLIT_NAMES = cast(tuple[SplitName, ...], SPLITS)


def dataset_version(policy: ImagePolicy, classes: list[str], images: Iterable[tuple[str, str, str]]) -> str:
    """The dataset's version: sha256 (hex) over the manifest format version, the image policy,
    the class list and the sorted `(split, class name, sha256 of the source file)` of every
    stored image. File names and record indices do not enter it, so renaming files keeps the
    version, while any changed pixel, label, split or policy gives a new one."""
    h = hashlib.sha256()
    head = {
        "format_version": FORMAT_VERSION,
        "image_policy": policy.model_dump(mode="json"),
        "classes": classes,
    }
    h.update(json.dumps(head, sort_keys=True, separators=(",", ":")).encode())
    for entry in sorted(images):
        h.update(b"\n" + json.dumps(list(entry), separators=(",", ":"), ensure_ascii=False).encode())
    return h.hexdigest()


def labelled_version(
    task: str, policy: ImagePolicy, classes: list[str], images: Iterable[tuple[str, str, bytes]]
) -> str:
    """The version of a dataset whose labels are bytes a task encodes (an extra record field):
    as `dataset_version`, with the task's name, over the sorted `(split, sha256 of the source
    file, sha256 of the stored label bytes)` of every stored image. The label bytes are what
    the shard holds, so any changed label gives a new version; file names still do not enter
    it."""
    h = hashlib.sha256()
    head = {
        "format_version": FORMAT_VERSION,
        "task": task,
        "image_policy": policy.model_dump(mode="json"),
        "classes": classes,
    }
    h.update(json.dumps(head, sort_keys=True, separators=(",", ":")).encode())
    entries = sorted((split, sha, hashlib.sha256(labels).hexdigest()) for split, sha, labels in images)
    for entry in entries:
        h.update(b"\n" + json.dumps(list(entry), separators=(",", ":")).encode())
    return h.hexdigest()


class _PixelSums:
    def __init__(self) -> None:
        self.pixels = 0
        self.sum = [0, 0, 0]
        self.sq_sum = [0, 0, 0]

    def add(self, image: Normalised) -> None:
        self.pixels += image.pixels
        for c in range(3):
            self.sum[c] += image.pixel_sum[c]
            self.sq_sum[c] += image.pixel_sq_sum[c]

    def stats(self) -> ChannelStats:
        n = self.pixels
        # Population variance in exact integers, n*sum(x^2) - sum(x)^2, then scaled to [0, 1].
        mean = [self.sum[c] / (n * 255) for c in range(3)]
        std = [math.sqrt(max(0, n * self.sq_sum[c] - self.sum[c] ** 2)) / (n * 255) for c in range(3)]
        return ChannelStats(
            mean=(round(mean[0], 6), round(mean[1], 6), round(mean[2], 6)),
            std=(round(std[0], 6), round(std[1], 6), round(std[2], 6)),
        )


class StatsAccumulator:
    """Counts per split and class, stored sizes, and pixel sums of the train split."""

    def __init__(self, classes: list[str]) -> None:
        self.classes = classes
        # Images per split and class (images containing the class, when one image holds several).
        self.per_class: dict[SplitName, Counter[int]] = {s: Counter() for s in SPLIT_NAMES}
        self.images: dict[SplitName, int] = dict.fromkeys(SPLIT_NAMES, 0)
        self.bytes: dict[SplitName, int] = dict.fromkeys(SPLIT_NAMES, 0)
        self.stored_as: Counter[str] = Counter()
        # Two compact int arrays, not a list of tuples: ~8 bytes per image instead of ~120.
        self.widths = array("I")
        self.heights = array("I")
        self.train_pixels = _PixelSums()
        self.all_pixels = _PixelSums()

    def add(self, split: SplitName, label: int, image: Normalised) -> None:
        self.add_image(split, (label,), image)

    def add_image(self, split: SplitName, present: Iterable[int], image: Normalised) -> None:
        """One stored image, counted once for each class in `present` (none: background)."""
        self.images[split] += 1
        for label in present:
            self.per_class[split][label] += 1
        self.stored_as[image.stored_as] += 1
        self.widths.append(image.width)
        self.heights.append(image.height)
        self.all_pixels.add(image)
        if split == "train":
            self.train_pixels.add(image)

    def set_bytes(self, split: SplitName, n: int) -> None:
        self.bytes[split] = n

    def count(self, split: SplitName) -> int:
        return self.images[split]

    @property
    def total(self) -> int:
        return len(self.widths)

    def split_infos(self) -> dict[SplitName, SplitInfo]:
        return {
            s: SplitInfo(
                count=self.count(s),
                per_class={name: self.per_class[s][i] for i, name in enumerate(self.classes)},
                shard_dir=f"{SHARDS_DIR}/{s}",
                bytes=self.bytes[s],
            )
            for s in SPLIT_NAMES
        }

    def channel_stats(self) -> ChannelStats:
        """Over the train split, the normalisation a model trained on it should use; over every
        stored image when there is no train split (an evaluation-only dataset)."""
        return (self.train_pixels if self.train_pixels.pixels else self.all_pixels).stats()

    def size_stats(self) -> SizeStats:
        """Per dimension: the smallest width and the smallest height, and so on (they may come
        from different images). Median is the lower median, so it is a real size."""
        w, h = self.widths, self.heights
        return SizeStats(
            min=(min(w), min(h)),
            median=(int(statistics.median_low(w)), int(statistics.median_low(h))),
            max=(max(w), max(h)),
        )
