"""Where to draw the near-duplicate line: pHash distances of copies and of distinct images.

Originals: photo-like synthetic images (`_common.synthetic_photos`: smooth colour fields,
texture and shapes, 320x240 JPEG) and non-overlapping 160x160 crops of scikit-learn's two
sample photographs (`load_sample_images`, no download), which are distinct images of the same
scenes: the hard negatives. Copies of each original: JPEG re-encodes (quality 30, 50, 75, 95),
halved, doubled, a 2% crop on every side, brightness +-15%, a 1 px Gaussian blur, and halved
then re-encoded at quality 75. Also scikit-learn's digits (8x8, upscaled): pairs of different
handwritten digits, the benchmark pool's images.

Prints, per threshold, the share of copies that would be caught, the share of distinct pairs
that would be wrongly called duplicates, and how many of the 1,797 digits the within-pool
search would leave out; writes benchmarks/results/label_phash.json.

    python benchmarks/label/phash_threshold.py [--photos 150]
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import synthetic_photos, write_result
from visionloop.label.phash import hamming, near_duplicates, phash_bytes, phash_image

THRESHOLDS = (2, 4, 6, 8, 10, 12)


def jpeg(im: Image.Image, quality: int) -> bytes:
    buf = io.BytesIO()
    im.convert("RGB").save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def copies(im: Image.Image) -> dict[str, bytes]:
    w, h = im.size
    cw, ch = max(1, round(w * 0.02)), max(1, round(h * 0.02))
    half = im.resize((w // 2, h // 2), Image.Resampling.LANCZOS)
    return {
        **{f"jpeg_q{q}": jpeg(im, q) for q in (30, 50, 75, 95)},
        "half": png(half),
        "double": png(im.resize((w * 2, h * 2), Image.Resampling.BICUBIC)),
        "crop_2pct": png(im.crop((cw, ch, w - cw, h - ch))),
        "brighter_15pct": png(ImageEnhance.Brightness(im).enhance(1.15)),
        "darker_15pct": png(ImageEnhance.Brightness(im).enhance(0.85)),
        "blur_1px": png(im.filter(ImageFilter.GaussianBlur(1))),
        "half_jpeg_q75": jpeg(half, 75),
    }


def originals(n_photos: int, root: Path) -> list[Image.Image]:
    from sklearn.datasets import load_sample_images

    synthetic_photos(root, n_photos, classes=1, size=(320, 240), seed=0)
    ims = [Image.open(p).convert("RGB") for p in sorted(root.rglob("*.jpg"))]
    for photo in load_sample_images().images:  # (427, 640, 3) each
        for y in range(0, photo.shape[0] - 159, 160):
            for x in range(0, photo.shape[1] - 159, 160):
                ims.append(Image.fromarray(photo[y : y + 160, x : x + 160]))
    return ims


def summary(d: np.ndarray) -> dict[str, float]:
    return {
        "min": int(d.min()),
        "p1": float(np.percentile(d, 1)),
        "median": float(np.median(d)),
        "p99": float(np.percentile(d, 99)),
        "max": int(d.max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--photos", type=int, default=150)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        ims = originals(args.photos, Path(tmp))
    base = np.array([phash_bytes(png(im)) for im in ims], dtype=np.uint64)
    per_kind: dict[str, list[int]] = {}
    for im, h in zip(ims, base, strict=True):
        for kind, data in copies(im).items():
            per_kind.setdefault(kind, []).append(int(hamming(h, phash_bytes(data))))
    copy_d = np.concatenate([np.asarray(v) for v in per_kind.values()])
    iu = np.triu_indices(len(base), k=1)
    distinct_d = hamming(base[:, None], base[None, :])[iu]

    from sklearn.datasets import load_digits

    digits = load_digits()
    dh = np.array(
        [
            phash_image(Image.fromarray((img * 255 / 16).astype(np.uint8)).resize((32, 32)))
            for img in digits.images
        ],
        dtype=np.uint64,
    )
    du = np.triu_indices(len(dh), k=1)
    digit_d = hamming(dh[:, None], dh[None, :])[du]
    same = (digits.target[:, None] == digits.target[None, :])[du]

    rows: list[dict[str, Any]] = []
    print(f"{len(ims)} originals x {len(per_kind)} kinds of copy; {len(distinct_d):,} distinct pairs")
    print(
        f"{'bits':>4}  {'copies caught':>13}  {'distinct called dup':>19}  "
        f"{'digit pairs called dup (same class)':>36}"
    )
    for t in THRESHOLDS:
        digits_left_out = len(near_duplicates(dh, max_distance=t))
        row = {
            "max_distance": t,
            "digit_images_left_out": digits_left_out,
            "copies_caught": float((copy_d <= t).mean()),
            "distinct_called_duplicate": float((distinct_d <= t).mean()),
            "digit_pairs_called_duplicate": float((digit_d <= t).mean()),
            "digit_same_class_pairs_called_duplicate": float((digit_d[same] <= t).mean()),
        }
        rows.append(row)
        print(
            f"{t:>4}  {row['copies_caught']:>13.4f}  {row['distinct_called_duplicate']:>19.5f}  "
            f"{row['digit_pairs_called_duplicate']:>26.5f} "
            f"({row['digit_same_class_pairs_called_duplicate']:.5f}); "
            f"{digits_left_out} of {len(dh)} digit images left out"
        )
    kinds = {k: summary(np.asarray(v)) for k, v in per_kind.items()}
    for k, s in kinds.items():
        print(f"  copy {k:<15} distance median {s['median']:.0f}, p99 {s['p99']:.1f}, max {s['max']}")
    print(f"  distinct pairs: {summary(distinct_d)}")
    print(f"  digits pairs:   {summary(digit_d)}")
    path = write_result(
        "label_phash",
        {
            "originals": len(ims),
            "copy_distances": summary(copy_d),
            "copy_distances_by_kind": kinds,
            "distinct_distances": summary(distinct_d),
            "digit_distances": summary(digit_d),
            "thresholds": rows,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
