"""The synthetic digits detection dataset: deterministic bytes, tight boxes on the written
pixels, the counts asked for, and a COCO file our own reader accepts without an issue."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypedDict

import numpy as np
import pytest
from PIL import Image

from visionloop.core.errors import DataError
from visionloop.tasks.detection.annotations import read_coco
from visionloop.tasks.detection.synthetic import INK_ALPHA, generate_detection_dataset, render_image

SIZE = 64


class _Kw(TypedDict):
    image_size: int
    digit_size: tuple[int, int]


KW: _Kw = {"image_size": SIZE, "digit_size": (12, 30)}


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_other_seed_other_images(tmp_path: Path) -> None:
    generate_detection_dataset(tmp_path / "a", 12, seed=7, **KW)
    generate_detection_dataset(tmp_path / "b", 12, seed=7, **KW)
    generate_detection_dataset(tmp_path / "c", 12, seed=8, **KW)
    a, b, c = _files(tmp_path / "a"), _files(tmp_path / "b"), _files(tmp_path / "c")
    assert len(a) == 13  # 12 images + instances.json
    assert a == b
    differing = [k for k in a if k.startswith("images/") and a[k] != c[k]]
    assert len(differing) == 12


def test_image_i_depends_on_seed_and_i_only(tmp_path: Path) -> None:
    generate_detection_dataset(tmp_path / "small", 3, seed=1, **KW)
    generate_detection_dataset(tmp_path / "large", 6, seed=1, **KW)
    small, large = _files(tmp_path / "small"), _files(tmp_path / "large")
    for name in small:
        if name.startswith("images/"):
            assert small[name] == large[name]


def test_reads_back_through_read_coco_with_no_issue_and_the_counts_asked_for(tmp_path: Path) -> None:
    out = generate_detection_dataset(
        tmp_path / "ds", 60, seed=3, classes=(3, 5, 8), max_objects=3, background_fraction=0.25, **KW
    )
    assert out == tmp_path / "ds" / "instances.json"
    source = read_coco(tmp_path / "ds" / "images", out)
    assert source.issues == [] and source.warnings == []
    assert source.classes == ["3", "5", "8"]
    counts = source.counts()
    assert counts.images == 60
    assert 5 <= counts.background_images <= 25  # about a quarter
    assert all(n > 5 for n in counts.instances.values())  # every class drawn
    for sample in source.samples:
        assert (sample.width, sample.height) == (SIZE, SIZE)
        assert len(sample.boxes) <= 3
        for x1, y1, x2, y2 in sample.boxes:
            assert 0 <= x1 < x2 <= SIZE and 0 <= y1 < y2 <= SIZE
            assert x2 - x1 >= 2 and y2 - y1 >= 4  # a digit, not a speck
    doc = json.loads(out.read_text())
    assert len(doc["annotations"]) == sum(counts.instances.values())


def test_boxes_are_tight_around_visible_ink_of_the_written_pixels(tmp_path: Path) -> None:
    seed, n = 11, 25
    generate_detection_dataset(tmp_path / "ds", n, seed=seed, **KW)
    source = read_coco(tmp_path / "ds" / "images", tmp_path / "ds" / "instances.json")
    contrasts: list[float] = []
    checked = occluded = 0
    for i, sample in enumerate(source.samples):
        rendered = render_image(
            np.random.default_rng([seed, i]),
            image_size=(SIZE, SIZE),
            classes=tuple(range(10)),
            max_objects=4,
            background_fraction=0.08,
            digit_size=(12, 30),
            exemplars="all",
        )
        # The file holds exactly the rendered pixels (PNG is lossless), and the same boxes.
        written = np.asarray(Image.open(sample.image).convert("RGB"))
        assert np.array_equal(written, rendered.pixels)
        assert sample.boxes == rendered.boxes and sample.labels == rendered.labels
        pixels = written.astype(np.float32)
        for box, ink, hidden in zip(rendered.boxes, rendered.ink, rendered.hidden, strict=True):
            # Whatever was drawn over a digit (a later digit, an occluder) is not its ink.
            assert not (ink & hidden).any()
            assert all(float(v).is_integer() for v in box)  # integer pixel edges
            x1, y1, x2, y2 = (int(v) for v in box)
            occluded += bool(hidden[y1:y2, x1:x2].any())
            inside = np.zeros_like(ink)
            inside[y1:y2, x1:x2] = True
            assert not (ink & ~inside).any(), "ink outside its box"
            # Tight: every edge row and column of the box holds ink.
            assert ink[y1, x1:x2].any() and ink[y2 - 1, x1:x2].any()
            assert ink[y1:y2, x1].any() and ink[y1:y2, x2 - 1].any()
            # The ink is visible in the file: its colour stands out from a ring around the box.
            ring = np.zeros_like(ink)
            ring[max(0, y1 - 3) : y2 + 3, max(0, x1 - 3) : x2 + 3] = True
            ring &= ~inside
            if ring.sum() > 10:
                contrasts.append(float(np.abs(pixels[ink].mean(0) - pixels[ring].mean(0)).max()))
            checked += 1
    assert checked >= 30 and occluded >= 5
    assert float(np.median(contrasts)) > 60
    assert INK_ALPHA == 0.5


def test_bad_arguments_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="distinct digits"):
        generate_detection_dataset(tmp_path, 1, classes=(1, 1))
    with pytest.raises(DataError, match="digit_size"):
        generate_detection_dataset(tmp_path, 1, image_size=32, digit_size=(10, 40))
