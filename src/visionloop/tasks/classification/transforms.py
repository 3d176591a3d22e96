"""Classification preprocessing on uint8 tensors, with per-sample seeded randomness.

Why not torchvision's random transforms: they draw from the process-global RNG, so the
augmentation a sample gets would depend on which DataLoader worker handled it and on what
ran before. Here every random choice comes from a `random.Random` seeded by
(seed, epoch, sample id): the same sample in the same epoch is augmented identically whether
the run is fresh, resumed mid-epoch, single-process or DDP. That is what makes resumption
bitwise exact.

Images stay uint8 until they reach the device; normalisation happens there
(`visionloop.data.normalize`), which keeps worker→main-process traffic 4x smaller than floats.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from visionloop.data import imageops as F
from visionloop.data.imageops import decode_rgb
from visionloop.specs import AugmentSpec

__all__ = ["EvalTransform", "TrainTransform", "decode_rgb", "random_resized_crop_params", "sample_seed"]


def sample_seed(seed: int, epoch: int, sample_id: int) -> int:
    """A 64-bit seed for one sample in one epoch (splitmix64 over the three inputs)."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + sample_id * 0x94D049BB133111EB) & (
        2**64 - 1
    )
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & (2**64 - 1)
    return x ^ (x >> 31)


def random_resized_crop_params(
    rng: random.Random, height: int, width: int, scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params, drawing from `rng` instead of the global RNG."""
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        h, w = height, round(height * ratio[1])
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


@dataclass(frozen=True)
class TrainTransform:
    size: int
    augment: AugmentSpec
    seed: int

    def __call__(self, img: torch.Tensor, epoch: int, sample_id: int) -> torch.Tensor:
        rng = random.Random(sample_seed(self.seed, epoch, sample_id))
        a = self.augment
        _, h, w = img.shape
        if a.random_resized_crop:
            top, left, ch, cw = random_resized_crop_params(rng, h, w, a.scale, a.ratio)
            img = F.resized_crop(img, top, left, ch, cw, [self.size, self.size])
        else:
            img = F.resize(img, [self.size, self.size])
        if a.hflip and rng.random() < a.hflip:
            img = F.horizontal_flip(img)
        if a.color_jitter:
            j = a.color_jitter
            # Draw all three factors, always, so the stream of draws never depends on the image.
            b, c, s = (rng.uniform(1 - j, 1 + j) for _ in range(3))
            img = F.adjust_saturation(F.adjust_contrast(F.adjust_brightness(img, b), c), s)
        return img


@dataclass(frozen=True)
class EvalTransform:
    """Resize the short side to size/crop_pct, then centre-crop `size` (timm's eval recipe)."""

    size: int
    crop_pct: float = 1.0

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        short = math.floor(self.size / self.crop_pct)
        img = F.resize(img, short)
        out: torch.Tensor = F.center_crop(img, [self.size, self.size])
        return out
