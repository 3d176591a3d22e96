"""A synthetic object-detection dataset made in the process, with no download: scikit-learn's
bundled 8×8 handwritten digits pasted onto procedurally textured backgrounds.

What makes it a detection problem rather than a pasted-sprite lookup:
- backgrounds mix smooth value noise, linear gradients, stripes of any angle and pixel noise;
- each digit is scaled (`digit_size`, with ±15% aspect jitter), sheared and rotated by up
  to `rotate` degrees, and drawn in a colour that contrasts with the background under it,
  but otherwise random;
- clutter: ellipses, rectangles and strokes (straight and bent lines, the same kind of marks
  a digit is made of) before and after the digits; the ones after may partly occlude a digit;
- 0..`max_objects` digits per image, with about `background_fraction` of the images empty.

Boxes are tight around the *visible* ink: the pixels where the digit's (upscaled) ink alpha is
at least `INK_ALPHA` and no occluder was drawn over it. An occluder is kept only if the digit
keeps at least `MIN_VISIBLE` of its ink, so that every box still shows a readable digit.

Exemplars: `exemplars="train"` uses four of every five of the 1,797 digit drawings,
`"holdout"` the fifth, `"all"` every one. Generate a validation set from the holdout
exemplars so that it measures generalisation to unseen handwriting, not recall of drawings.

Everything is deterministic given `seed`: image `i` depends on `(seed, i)` only, so the first
images of a larger dataset are the images of a smaller one, and the files are the same bytes.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import numpy as np
from PIL import Image, ImageDraw

from visionloop.core.errors import DataError
from visionloop.tasks.detection.annotations import DetectionSample, DetectionSource, write_coco

INK_ALPHA = 0.5  # a pixel is ink where the digit's alpha reaches this
MIN_VISIBLE = 0.7  # an occluder may hide at most 30% of a digit's ink
MAX_OVERLAP = 0.15  # two digits' boxes overlap by at most this IoU

Exemplars = Literal["all", "train", "holdout"]


@dataclass(frozen=True, slots=True)
class RenderedImage:
    """One generated image. `ink[i]` is the visible-ink mask of object `i`; `boxes[i]` its
    tight box `(x1, y1, x2, y2)` in pixel edges; `labels[i]` an index into the classes."""

    pixels: np.ndarray  # (H, W, 3) uint8
    boxes: list[tuple[float, float, float, float]]
    labels: list[int]
    ink: list[np.ndarray]  # (H, W) bool each
    hidden: list[np.ndarray]  # (H, W) bool each: pixels drawn over object i after it was pasted


@cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()  # bundled with scikit-learn: no download
    images = np.asarray(bunch.images, dtype=np.float32) / 16.0  # (1797, 8, 8) in [0, 1]
    return images, np.asarray(bunch.target, dtype=np.int64)


def _exemplar_pool(digit: int, exemplars: Exemplars) -> np.ndarray:
    _, target = _digits()
    index: np.ndarray = np.flatnonzero(target == digit)
    if exemplars == "all":
        return index
    keep = np.arange(len(index)) % 5 == 0
    out: np.ndarray = index[keep if exemplars == "holdout" else ~keep]
    return out


def _value_noise(rng: np.random.Generator, h: int, w: int, cells: int) -> np.ndarray:
    grid = rng.random((cells + 1, cells + 1)).astype(np.float32)
    up = Image.fromarray(grid).resize((w, h), Image.Resampling.BICUBIC)
    return np.clip(np.asarray(up, dtype=np.float32), 0.0, 1.0)


def _background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    base = rng.uniform(30, 225, 3).astype(np.float32)
    out = np.broadcast_to(base, (h, w, 3)).copy()
    # Smooth noise, a gradient and stripes, each with a random strength and colour direction.
    for _ in range(int(rng.integers(1, 3))):
        noise = _value_noise(rng, h, w, int(rng.integers(2, 8))) - 0.5
        out += noise[..., None] * rng.uniform(-90, 90, 3).astype(np.float32)
    angle = rng.uniform(0, 2 * math.pi)
    ramp = (np.cos(angle) * xx + np.sin(angle) * yy) / max(h, w) - 0.5
    out += ramp[..., None] * rng.uniform(-80, 80, 3).astype(np.float32)
    if rng.random() < 0.5:
        angle = rng.uniform(0, math.pi)
        period = rng.uniform(4, max(h, w) / 3)
        phase = (np.cos(angle) * xx + np.sin(angle) * yy) * 2 * math.pi / period
        out += np.sin(phase)[..., None] * rng.uniform(-35, 35, 3).astype(np.float32)
    out += rng.normal(0, rng.uniform(0, 10), (h, w, 3)).astype(np.float32)
    return np.clip(out, 0, 255)


def _random_colour(rng: np.random.Generator) -> tuple[int, int, int]:
    r, g, b = (int(v) for v in rng.integers(0, 256, 3))
    return (r, g, b)


def _draw_clutter(rng: np.random.Generator, canvas: np.ndarray, count: int) -> np.ndarray:
    """Blobs, boxes and strokes. Returns the mask of the pixels it drew on."""
    h, w = canvas.shape[:2]
    layer = Image.new("RGB", (w, h))
    mask = Image.new("L", (w, h))
    draw, mdraw = ImageDraw.Draw(layer), ImageDraw.Draw(mask)
    for _ in range(count):
        colour = _random_colour(rng)
        kind = rng.integers(0, 4)
        cx, cy = rng.uniform(0, w), rng.uniform(0, h)
        rx, ry = rng.uniform(2, w / 8), rng.uniform(2, h / 8)
        xy = (cx - rx, cy - ry, cx + rx, cy + ry)
        if kind == 0:
            draw.ellipse(xy, fill=colour)
            mdraw.ellipse(xy, fill=255)
        elif kind == 1:
            draw.rectangle(xy, fill=colour)
            mdraw.rectangle(xy, fill=255)
        else:
            # A stroke: straight (kind 2) or bent through a middle point (kind 3).
            points = [(cx, cy)]
            for _ in range(int(kind)):
                points.append(
                    (points[-1][0] + rng.uniform(-w / 5, w / 5), points[-1][1] + rng.uniform(-h / 5, h / 5))
                )
            width = int(rng.integers(1, 4))
            draw.line(points, fill=colour, width=width)
            mdraw.line(points, fill=255, width=width)
    drawn = np.asarray(mask) > 0
    canvas[drawn] = np.asarray(layer, dtype=np.float32)[drawn]
    return drawn


def _iou(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _mask_box(mask: np.ndarray) -> tuple[float, float, float, float]:
    ys, xs = np.nonzero(mask)
    return (float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1))


def render_image(
    rng: np.random.Generator,
    *,
    image_size: tuple[int, int],
    classes: Sequence[int],
    max_objects: int,
    background_fraction: float,
    digit_size: tuple[int, int],
    exemplars: Exemplars,
    rotate: float = 12.0,
) -> RenderedImage:
    """Draw one image from `rng` (see the module docstring for what is in it)."""
    w, h = image_size
    images, _ = _digits()
    canvas = _background(rng, h, w)
    _draw_clutter(rng, canvas, int(rng.integers(0, 5)))
    n_objects = 0 if rng.random() < background_fraction else int(rng.integers(1, max_objects + 1))

    ink: list[np.ndarray] = []  # visible ink of each digit placed so far
    full: list[int] = []  # its ink pixel count before anything was drawn over it
    hidden: list[np.ndarray] = []
    labels: list[int] = []
    placed: list[tuple[float, float, float, float]] = []

    def readable(drawn: np.ndarray) -> bool:
        return all((m & ~drawn).sum() >= MIN_VISIBLE * n for m, n in zip(ink, full, strict=True))

    for _ in range(n_objects):
        label = int(rng.integers(0, len(classes)))
        pool = _exemplar_pool(int(classes[label]), exemplars)
        drawing = images[int(pool[int(rng.integers(0, len(pool)))])]
        side = rng.uniform(digit_size[0], digit_size[1])
        aspect = rng.uniform(0.85, 1.15)
        dw, dh = max(4, round(side * aspect)), max(4, round(side / aspect))
        if dw > w or dh > h:
            continue
        # The 8x8 drawing's ink fills about 6x8 of its cells; the box is measured after pasting.
        # A small rotation and shear make new handwriting out of the 1,797 drawings.
        sprite = Image.fromarray(drawing).resize((dw, dh), Image.Resampling.BILINEAR)
        if rotate > 0:
            shear = rng.uniform(-rotate, rotate) * math.pi / 180
            sprite = sprite.transform(
                sprite.size,
                Image.Transform.AFFINE,
                (1, shear, -shear * dh / 2, 0, 1, 0),
                Image.Resampling.BILINEAR,
            ).rotate(rng.uniform(-rotate, rotate), Image.Resampling.BILINEAR, expand=True)
        alpha_small = np.clip(np.asarray(sprite, dtype=np.float32), 0.0, 1.0)
        dh, dw = alpha_small.shape
        if dw > w or dh > h:
            continue
        for _attempt in range(10):
            x0, y0 = int(rng.integers(0, w - dw + 1)), int(rng.integers(0, h - dh + 1))
            candidate = (float(x0), float(y0), float(x0 + dw), float(y0 + dh))
            if all(_iou(candidate, other) <= MAX_OVERLAP for other in placed):
                break
        else:
            continue
        alpha = np.zeros((h, w), np.float32)
        alpha[y0 : y0 + dh, x0 : x0 + dw] = alpha_small
        mine = alpha >= INK_ALPHA
        # Any pixel this digit touches is no longer the earlier digits' ink.
        if not mine.any() or not readable(alpha > 0):
            continue
        # A colour far from the background under the digit: light on dark, dark on light.
        under = canvas[mine].mean(axis=0)
        lum = float(under @ np.array([0.299, 0.587, 0.114], np.float32))
        colour = rng.uniform(0, 70, 3) if lum > 128 else rng.uniform(185, 255, 3)
        if rng.random() < 0.5:  # a tint, keeping the contrast
            colour[int(rng.integers(0, 3))] = rng.uniform(0, 255)
        canvas = canvas * (1 - alpha[..., None]) + colour.astype(np.float32) * alpha[..., None]
        ink = [m & ~(alpha > 0) for m in ink]
        hidden = [m | (alpha > 0) for m in hidden]
        ink.append(mine)
        hidden.append(np.zeros_like(mine))
        full.append(int(mine.sum()))
        placed.append(candidate)
        labels.append(label)

    # Occluders and clutter drawn over the digits: kept only where every digit stays readable.
    for _ in range(int(rng.integers(0, 4))):
        trial = canvas.copy()
        drawn = _draw_clutter(rng, trial, 1)
        if readable(drawn):
            canvas = trial
            ink = [m & ~drawn for m in ink]
            hidden = [m | drawn for m in hidden]
    pixels = np.clip(np.rint(canvas), 0, 255).astype(np.uint8)
    return RenderedImage(pixels, [_mask_box(m) for m in ink], labels, ink, hidden)


def generate_detection_dataset(
    out_dir: Path,
    n_images: int,
    *,
    image_size: int | tuple[int, int] = 96,
    seed: int = 0,
    classes: Sequence[int] = tuple(range(10)),
    max_objects: int = 4,
    background_fraction: float = 0.08,
    digit_size: tuple[int, int] = (14, 40),
    exemplars: Exemplars = "all",
    rotate: float = 12.0,
    image_format: Literal["png", "jpeg"] = "png",
) -> Path:
    """Write `n_images` images to `out_dir/images/` and their boxes to `out_dir/instances.json`
    (COCO, `file_name`s relative to `out_dir/images`); return the JSON's path.

    `classes` picks the digits (class names are the digits as strings, in the order given);
    `image_size` is `side` or `(width, height)`; `digit_size` the range of a digit's side in
    pixels before the aspect jitter; `rotate` the largest shear and rotation, in degrees.
    PNG is lossless, so boxes match the written pixels exactly; JPEG (quality 92) is
    smaller. Read it back with `read_coco(out_dir / "images", out_dir / "instances.json")`.
    """
    size = (
        (image_size, image_size) if isinstance(image_size, int) else (int(image_size[0]), int(image_size[1]))
    )
    if n_images < 0:
        raise DataError(f"n_images must be >= 0, got {n_images}")
    if not classes or any(not 0 <= int(c) <= 9 for c in classes) or len(set(classes)) != len(classes):
        raise DataError(f"classes must be distinct digits 0-9, e.g. (0, 1, 2, 3, 4); got {list(classes)}")
    if not 1 <= digit_size[0] <= digit_size[1] or digit_size[1] > min(size):
        raise DataError(
            f"digit_size {digit_size} must be a range (low, high) with 1 <= low <= high <= "
            f"the image side {min(size)}, e.g. (14, 40) for 96-pixel images"
        )
    out_dir = Path(out_dir)
    images_dir = out_dir / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    suffix = "png" if image_format == "png" else "jpg"
    samples: list[DetectionSample] = []
    for i in range(n_images):
        rng = np.random.default_rng([seed, i])
        rendered = render_image(
            rng,
            image_size=size,
            classes=classes,
            max_objects=max_objects,
            background_fraction=background_fraction,
            digit_size=digit_size,
            exemplars=exemplars,
            rotate=rotate,
        )
        path = images_dir / f"{i:06d}.{suffix}"
        image = Image.fromarray(rendered.pixels)
        if image_format == "png":
            image.save(path, format="PNG", optimize=False, compress_level=6)
        else:
            image.save(path, format="JPEG", quality=92)
        samples.append(
            DetectionSample(
                image=path,
                rel=path.name,
                width=size[0],
                height=size[1],
                boxes=list(rendered.boxes),
                labels=list(rendered.labels),
                difficult=[False] * len(rendered.boxes),
            )
        )
    source = DetectionSource("synthetic", images_dir, [str(int(c)) for c in classes], samples)
    out_json = out_dir / "instances.json"
    write_coco(source, out_json, images_dir)
    return out_json


def write_coco_source(
    root: Path, n_train: int, n_val: int, *, image_size: int, classes: tuple[int, ...]
) -> Path:
    """A COCO source under `root` (replaced if present): `annotations/instances_{train,val}.json`
    beside the images in `train/` and `val/`. The val images draw handwriting that the train
    images never show (`exemplars="holdout"`), so val mAP measures generalisation."""
    if root.exists():
        shutil.rmtree(root)
    (root / "annotations").mkdir(parents=True)
    plan: tuple[tuple[str, int, Exemplars, int], ...] = (
        ("train", n_train, "train", 0),
        ("val", n_val, "holdout", 1),
    )
    for split, n, exemplars, seed in plan:
        work = root / f".gen-{split}"
        generate_detection_dataset(
            work, n, image_size=image_size, seed=seed, classes=classes, exemplars=exemplars
        )
        (work / "images").rename(root / split)
        (work / "instances.json").rename(root / "annotations" / f"instances_{split}.json")
        work.rmdir()
    return root
