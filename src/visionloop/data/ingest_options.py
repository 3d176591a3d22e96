"""What an ingest is asked to do (`IngestOptions`) and what it reports back (`IngestReport`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from visionloop.core.errors import DataError
from visionloop.data.manifest import DUPLICATES_NAME, REJECTED_NAME, DatasetManifest, ImagePolicy

ProgressFn = Callable[[str, int, int], None]
"""`progress(stage, done, total)`, called from the calling thread; stage is "hash" or "decode"."""

_POLICY_DEFAULTS = ImagePolicy()


def default_workers() -> int:
    """CPUs this process may use (the affinity mask, which containers and taskset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class IngestOptions:
    """Every knob of `ingest`; invalid combinations raise `DataError` at construction.

    The split fractions and seed apply only when the source gives no split. The image
    limits reject a file (never crash the run); `max_side` shrinks, never enlarges.
    """

    val_fraction: float = 0.1
    test_fraction: float = 0.0
    seed: int = 0  # of the split and of the shard write order
    max_side: int | None = None  # longest side after ingest; None keeps the size
    min_side: int = _POLICY_DEFAULTS.min_side
    max_pixels: int = _POLICY_DEFAULTS.max_pixels  # checked on the header, before decoding
    max_aspect: float = _POLICY_DEFAULTS.max_aspect  # long side / short side
    workers: int = field(default_factory=default_workers)  # decode processes
    overwrite: bool = False  # replace an existing dataset at `out`
    keep_duplicates: bool = False  # keep byte-identical files (always reported)
    alpha_background: tuple[int, int, int] = _POLICY_DEFAULTS.alpha_background
    lossy_quality: int = _POLICY_DEFAULTS.lossy_quality  # JPEG quality for re-encoded lossy sources
    # Follow symbolic links that lead outside the source (by default they are skipped and
    # listed in rejected.jsonl as `link_outside_source`).
    follow_links: bool = False
    # A source format a task reads (`Task.source_formats`, e.g. "coco"): that task ingests the
    # source in that format. None: the task that recognises the source's layout does (an
    # ImageFolder or CSV, classification, when none does). Checked by `ingest`.
    format: str | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.format is not None and not self.format.strip():
            problems.append("format must be a source format name such as coco, or left out")
        if not (0.0 <= self.val_fraction < 1.0 and 0.0 <= self.test_fraction < 1.0):
            problems.append("val_fraction and test_fraction must each be in [0, 1), e.g. 0.1")
        elif self.val_fraction + self.test_fraction >= 1.0:
            problems.append("val_fraction + test_fraction must be below 1 to leave images for training")
        if self.max_side is not None and self.max_side < 1:
            problems.append(f"max_side must be a positive number of pixels, e.g. 512 (got {self.max_side})")
        if self.min_side < 1 or self.max_pixels < 1:
            problems.append("min_side and max_pixels must be at least 1")
        if self.max_aspect < 1.0:
            problems.append(f"max_aspect is long side / short side, so at least 1 (got {self.max_aspect})")
        if self.workers < 1:
            problems.append(f"workers must be at least 1 (got {self.workers})")
        if not 1 <= self.lossy_quality <= 100:
            problems.append(f"lossy_quality is a JPEG quality, 1..100 (got {self.lossy_quality})")
        if len(self.alpha_background) != 3 or not all(0 <= c <= 255 for c in self.alpha_background):
            problems.append(
                "alpha_background must be 3 values in 0..255, e.g. (255, 255, 255) "
                f"(got {self.alpha_background})"
            )
        if problems:
            raise DataError("invalid ingest options: " + "; ".join(problems) + ".")

    def image_policy(self) -> ImagePolicy:
        return ImagePolicy(
            max_side=self.max_side,
            alpha_background=self.alpha_background,
            lossy_quality=self.lossy_quality,
            min_side=self.min_side,
            max_pixels=self.max_pixels,
            max_aspect=self.max_aspect,
        )


@dataclass(frozen=True)
class IngestReport:
    """What one ingest did; the manifest holds the dataset itself."""

    out: Path
    manifest: DatasetManifest
    skipped: int  # files without an image extension
    rejected_by_reason: dict[str, int]
    duplicates: int
    conflicting_duplicates: int  # duplicates whose labels differ
    duplicates_kept: bool
    stored_as: dict[str, int]  # "original" / "png" / "jpeg" -> count
    warnings: list[str]
    seconds: float
    # Rows of rejected.jsonl that were repaired and kept (a task's ingest may repair items).
    repaired_by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def kept(self) -> int:
        return sum(s.count for s in self.manifest.splits.values())

    @property
    def rejected_file(self) -> Path:
        return self.out / REJECTED_NAME

    @property
    def duplicates_file(self) -> Path:
        return self.out / DUPLICATES_NAME
