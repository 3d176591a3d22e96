"""Per-sample seeded augmentation: same (seed, epoch, sample) → same pixels, no global RNG use."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from visionloop.data.normalize import Normalizer
from visionloop.specs import AugmentSpec
from visionloop.tasks.classification.transforms import (
    EvalTransform,
    TrainTransform,
    decode_rgb,
    sample_seed,
)


def image(h: int = 40, w: int = 56) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)


def test_decode_rgb_returns_exact_pixels_for_png() -> None:
    arr = np.random.default_rng(0).integers(0, 256, (5, 7, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    out = decode_rgb(buf.getvalue())
    assert out.dtype == torch.uint8 and out.shape == (3, 5, 7)
    assert torch.equal(out.permute(1, 2, 0), torch.from_numpy(arr))


def test_same_sample_same_epoch_is_augmented_identically_and_the_global_rng_is_untouched() -> None:
    t = TrainTransform(size=24, augment=AugmentSpec(hflip=0.5, color_jitter=0.3), seed=7)
    before = torch.get_rng_state()
    a = t(image(), epoch=3, sample_id=11)
    b = t(image(), epoch=3, sample_id=11)
    assert torch.equal(torch.get_rng_state(), before)
    assert a.shape == (3, 24, 24) and a.dtype == torch.uint8
    assert torch.equal(a, b)


def test_other_epochs_samples_and_seeds_get_other_augmentations() -> None:
    t = TrainTransform(size=24, augment=AugmentSpec(hflip=0.5, color_jitter=0.3), seed=7)
    base = t(image(), epoch=3, sample_id=11)
    assert not torch.equal(base, t(image(), epoch=4, sample_id=11))
    assert not torch.equal(base, t(image(), epoch=3, sample_id=12))
    other = TrainTransform(size=24, augment=AugmentSpec(hflip=0.5, color_jitter=0.3), seed=8)
    assert not torch.equal(base, other(image(), epoch=3, sample_id=11))


def test_sample_seed_is_64_bit_and_spreads() -> None:
    seeds = {sample_seed(0, e, i) for e in range(10) for i in range(1000)}
    assert len(seeds) == 10_000 and all(0 <= s < 2**64 for s in seeds)


def test_no_augmentation_is_a_plain_resize() -> None:
    spec = AugmentSpec(random_resized_crop=False, hflip=0.0)
    out = TrainTransform(size=20, augment=spec, seed=0)(image(), epoch=0, sample_id=0)
    ref = torch.nn.functional.interpolate(
        image()[None].float(), size=(20, 20), mode="bilinear", antialias=True
    )
    assert (out.float() - ref[0]).abs().max() <= 1.0  # uint8 rounding only


@pytest.mark.parametrize(("h", "w"), [(40, 56), (56, 40), (24, 24)])
def test_eval_transform_centre_crops_to_size(h: int, w: int) -> None:
    out = EvalTransform(24, crop_pct=0.875)(image(h, w))
    assert out.shape == (3, 24, 24) and out.dtype == torch.uint8


def coordinates(h: int, w: int) -> torch.Tensor:
    """Every pixel tells where it is: channel 0 its row, channel 1 its column."""
    rows = torch.arange(h, dtype=torch.uint8).view(h, 1).expand(h, w)
    cols = torch.arange(w, dtype=torch.uint8).view(1, w).expand(h, w)
    return torch.stack([rows, cols, (rows * 3 + cols) % 251]).contiguous()


@pytest.mark.parametrize(("h", "w", "top", "left"), [(32, 48, 4, 12), (48, 32, 12, 4), (32, 32, 4, 4)])
def test_eval_transform_takes_exactly_the_centre_pixels(h: int, w: int, top: int, left: int) -> None:
    # crop_pct 0.75: the short side must be 24 / 0.75 = 32, which it already is (no resize),
    # so the output is the 24x24 window whose margins are equal on both sides.
    img = coordinates(h, w)
    out = EvalTransform(24, crop_pct=0.75)(img)
    assert torch.equal(out, img[:, top : top + 24, left : left + 24])
    assert out[0, 0, 0] == top and out[1, 0, 0] == left  # the crop's corner, by hand
    assert (h - 24 - top, w - 24 - left) == (top, left)  # as much cut below/right as above/left


def test_eval_transform_resizes_then_keeps_the_centre_of_four_quadrants() -> None:
    # 64x96 → short side 32 (half size) → 32x48 → centre 24x24 = rows 4..27, columns 12..35 of
    # the half-size image, whose quadrant borders (row 16, column 24) are at 12 and 12 in the crop.
    colours = {(0, 0): (200, 10, 10), (0, 1): (10, 200, 10), (1, 0): (10, 10, 200), (1, 1): (90, 90, 90)}
    img = torch.empty(3, 64, 96, dtype=torch.uint8)
    for (qr, qc), rgb in colours.items():
        img[:, qr * 32 : (qr + 1) * 32, qc * 48 : (qc + 1) * 48] = torch.tensor(rgb, dtype=torch.uint8).view(
            3, 1, 1
        )
    out = EvalTransform(24, crop_pct=0.75)(img)
    assert out.shape == (3, 24, 24)
    # The antialiasing filter blends only the two pixels either side of a border (11 and 12):
    # everything else in each quadrant is exactly its colour, so the borders sit at the
    # crop's centre to the pixel (a crop one pixel off moves the blend onto a checked pixel).
    for (qr, qc), rgb in colours.items():
        rows = slice(0, 11) if qr == 0 else slice(13, 24)
        cols = slice(0, 11) if qc == 0 else slice(13, 24)
        expected = torch.tensor(rgb, dtype=torch.uint8).view(3, 1, 1).expand(3, 11, 11)
        assert torch.equal(out[:, rows, cols], expected), (qr, qc)
    for border in (11, 12):
        assert not torch.equal(out[:, border, :11], out[:, 0, :11])  # blended: the border is there


def test_normalizer_matches_the_textbook_formula() -> None:
    x = image()[None]
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    expected = (x.float() / 255 - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3, 1, 1)
    out = Normalizer(mean, std)(x, channels_last=True)
    assert torch.allclose(out, expected, atol=1e-5)
    assert out.is_contiguous(memory_format=torch.channels_last)
