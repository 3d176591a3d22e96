"""Detection preprocessing on uint8 tensors: image and boxes transformed together, with
per-sample seeded randomness, and every image letterboxed to S x S at the end.

Randomness: torchvision's v2 transforms (IoU crop, zoom-out, photometric distortion) draw
from the process-global torch RNG. Each sample therefore runs them inside
`torch.random.fork_rng` with the global RNG seeded from (seed, epoch, sample id) — the same
`sample_seed` the classification transforms use — and our own choices (the random resized
crop's window, the flip) draw from a `random.Random` with that seed. The global RNG is
restored afterwards, so a sample is augmented identically whether the run is fresh, resumed
mid-epoch, single-process or DDP, and loading in the main process (workers: 0) never shifts
the trainer's own random stream (dropout, initialisation). That is what keeps resumption
bitwise exact.

Letterbox: the image is scaled so that its longer side is S (`letterbox_scale`), placed at
the top left and padded bottom/right with `LETTERBOX_FILL` — the model card's `Letterbox`,
the very transform the server applies — and its boxes are multiplied by that scale.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from visionloop.models.card import LETTERBOX_FILL, Letterbox, letterbox_scale
from visionloop.specs import AugmentSpec
from visionloop.tasks.classification.transforms import random_resized_crop_params, sample_seed

__all__ = ["DetectionEvalTransform", "DetectionTrainTransform", "letterbox_boxes"]

# The zoom-out canvas (SSD's "expand"): up to this many times the image's side.
ZOOM_OUT_SIDE = (1.0, 3.0)


def letterbox_boxes(
    image: torch.Tensor, boxes: torch.Tensor, size: int
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """uint8 (3, H, W) and (N, 4) xyxy boxes in its pixels → the letterboxed (3, S, S) image,
    the boxes in its pixels (multiplied by the scale, clipped to the canvas) and the scale."""
    h, w = int(image.shape[-2]), int(image.shape[-1])
    scale = letterbox_scale(h, w, (size, size))
    out = Letterbox((size, size), v2.InterpolationMode.BILINEAR)(image)
    scaled = (boxes.to(torch.float32).reshape(-1, 4) * scale).clamp(0.0, float(size))
    return out, scaled, float(scale)


def _as_sample(image: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor) -> tuple[Any, dict[str, Any]]:
    h, w = int(image.shape[-2]), int(image.shape[-1])
    bb = tv_tensors.BoundingBoxes(boxes.reshape(-1, 4), format="XYXY", canvas_size=(h, w))
    return tv_tensors.Image(image), {"boxes": bb, "labels": labels}


@dataclass(frozen=True)
class DetectionTrainTransform:
    """Photometric distortion (`color_jitter` > 0), zoom-out (`zoom_out`: its probability),
    then IoU crop (`iou_crop`) or a random resized crop (`random_resized_crop`, with `scale`
    and `ratio`), horizontal flip (`hflip`: its probability), letterbox to `size`, and boxes
    clamped to the image and dropped when under a pixel wide or high."""

    size: int
    augment: AugmentSpec
    seed: int

    def __call__(
        self, image: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor, epoch: int, sample_id: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """uint8 (3, H, W), boxes (N, 4) xyxy float32 in its pixels, labels (N,) int64 →
        (uint8 (3, S, S), boxes (M, 4) in its pixels, labels (M,), letterbox scale)."""
        a = self.augment
        s = sample_seed(self.seed, epoch, sample_id)
        rng = random.Random(s)
        img, target = _as_sample(image, boxes, labels)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(s & (2**63 - 1))
            if a.color_jitter:
                j = a.color_jitter
                distort = v2.RandomPhotometricDistort(
                    brightness=(1 - j, 1 + j), contrast=(1 - j, 1 + j), saturation=(1 - j, 1 + j), p=0.5
                )
                img, target = distort(img, target)
            if a.zoom_out:
                zoom = v2.RandomZoomOut(
                    fill={tv_tensors.Image: LETTERBOX_FILL, "others": 0},
                    side_range=ZOOM_OUT_SIDE,
                    p=a.zoom_out,
                )
                img, target = zoom(img, target)
            # IoU crop needs boxes to measure overlaps with: a background image skips it.
            if a.iou_crop and len(target["boxes"]):
                img, target = v2.RandomIoUCrop()(img, target)
            elif a.random_resized_crop:
                h, w = int(img.shape[-2]), int(img.shape[-1])
                top, left, ch, cw = random_resized_crop_params(rng, h, w, a.scale, a.ratio)
                img = F.crop(img, top, left, ch, cw)
                target["boxes"] = F.crop(target["boxes"], top, left, ch, cw)
        if a.hflip and rng.random() < a.hflip:
            img = F.horizontal_flip(img)
            target["boxes"] = F.horizontal_flip(target["boxes"])
        # Clamped to the (cropped) image before letterboxing, so no box reaches into the padding.
        h, w = int(img.shape[-2]), int(img.shape[-1])
        clipped = F.clamp_bounding_boxes(target["boxes"]).as_subclass(torch.Tensor)
        out, scaled, scale = letterbox_boxes(img.as_subclass(torch.Tensor), clipped, self.size)
        bb = tv_tensors.BoundingBoxes(scaled, format="XYXY", canvas_size=(self.size, self.size))
        final = v2.SanitizeBoundingBoxes(min_size=1.0)({"boxes": bb, "labels": target["labels"]})
        return (
            out,
            final["boxes"].as_subclass(torch.Tensor).to(torch.float32),
            final["labels"].to(torch.int64),
            scale,
        )


@dataclass(frozen=True)
class DetectionEvalTransform:
    """Letterbox only: what the exported model and the server see."""

    size: int

    def __call__(
        self, image: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        out, scaled, scale = letterbox_boxes(image, boxes, self.size)
        return out, scaled, labels.to(torch.int64), scale
