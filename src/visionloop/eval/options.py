"""What `visionloop eval` is asked to do, checked before anything heavy is imported: a
mistyped corruption or severity is answered at once, not after torch and MLflow load."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from visionloop.core.errors import SpecError

SPLITS = ("train", "val", "test")
# Bootstrap resamples per slice value, unless asked otherwise.
DEFAULT_RESAMPLES = 200

CORRUPTIONS: tuple[str, ...] = (
    "night",
    "glare",
    "motion_blur",
    "defocus_blur",
    "fog",
    "gaussian_noise",
    "jpeg",
    "pixelate",
    "occlusion",
)
SEVERITIES: tuple[int, ...] = (1, 2, 3, 4, 5)
# A forward pass of more images than this is an out-of-memory crash, not an evaluation.
MAX_BATCH_SIZE = 4096


def _shown(value: object, limit: int = 40) -> str:
    text = repr(value)  # control characters visible; a pasted file is not echoed back whole
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class EvalOptions:
    dataset: Path | None = None  # default: the dataset the version was trained on
    split: str | None = None  # default: val, else test
    stress: bool = False
    corruptions: tuple[str, ...] = CORRUPTIONS
    severities: tuple[int, ...] = SEVERITIES
    seed: int = 0
    max_images: int | None = None
    batch_size: int = 64
    device: str = "auto"  # auto (cuda when available), cpu, cuda
    calibrate: bool = True  # fit and store a temperature (own validation split only)
    track: bool = True  # record the evaluation as an MLflow run linked to the version
    # Metadata columns to report the primary metric per value of (worst first, with a 95%
    # bootstrap interval from `slice_resamples` resamples); the clean pass then runs one image
    # per batch.
    slices: tuple[str, ...] = ()
    slice_resamples: int = DEFAULT_RESAMPLES


def check_options(o: EvalOptions) -> None:
    """SpecError naming the first option that is out of range."""
    unknown = [c for c in o.corruptions if c not in CORRUPTIONS]
    if unknown:
        raise SpecError(f"unknown corruption {_shown(unknown[0])}; use some of: {', '.join(CORRUPTIONS)}.")
    bad = [s for s in o.severities if s not in SEVERITIES]
    if bad:
        raise SpecError(f"severity {bad[0]} is out of range; severities are 1 to 5.")
    if o.stress and (not o.corruptions or not o.severities):
        raise SpecError("--stress needs at least one corruption and one severity.")
    if o.split is not None and o.split not in SPLITS:
        raise SpecError(f"unknown split {_shown(o.split)}; use one of {', '.join(SPLITS)}.")
    if o.max_images is not None and o.max_images < 1:
        raise SpecError(f"--max-images must be at least 1, got {o.max_images}.")
    if not 1 <= o.batch_size <= MAX_BATCH_SIZE:
        raise SpecError(
            f"--batch-size must be from 1 to {MAX_BATCH_SIZE}, got {_shown(o.batch_size)}; e.g. 64."
        )
    if o.seed < 0:
        # Checked here: the corruptions' seeding refused it only after the model had loaded.
        raise SpecError(f"--seed must be a whole number >= 0, got {_shown(o.seed)}; e.g. --seed 0.")
    if o.device not in ("auto", "cpu", "cuda"):
        raise SpecError(f"unknown device {_shown(o.device)}; use auto, cpu or cuda.")
    if any(not c.strip() for c in o.slices):
        raise SpecError("--slices names metadata columns (e.g. --slices camera,time_of_day), not ''.")
    if len(set(o.slices)) != len(o.slices):
        raise SpecError(f"--slices names a column twice: {_shown(', '.join(o.slices))}.")
    if not 10 <= o.slice_resamples <= 10_000:
        raise SpecError(f"--slice-resamples must be between 10 and 10000, got {o.slice_resamples}.")
