"""Seeded corruptions: reproducible bytes, kept geometry, damage that grows with severity and
scales with the image, and errors that list what is valid."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from scipy import ndimage  # type: ignore[import-untyped]

from visionloop.core.errors import DataError, SpecError
from visionloop.eval.corruptions import CORRUPTIONS, SEVERITIES, corrupt, image_seed

RANDOM = ("night", "glare", "motion_blur", "fog", "gaussian_noise", "occlusion")
DETERMINISTIC = ("defocus_blur", "jpeg", "pixelate")


def scene(h: int, w: int) -> np.ndarray:
    """A natural-looking RGB test image: colour gradients, a rectangle, a disk, a thin bar and
    a smooth multi-scale texture (no pure periodic pattern, which a blur could cancel)."""
    yy, xx = np.mgrid[:h, :w].astype(np.float64)
    u, v = xx / w, yy / h
    img = np.stack([40 + 160 * u, 50 + 140 * v, 120 + 60 * np.sin(6.3 * u) * np.cos(4.1 * v)], axis=-1)
    rng = np.random.default_rng(1234)
    texture = np.zeros((h, w))
    for cells in (4, 8, 16, 32):  # value noise, each octave half as strong: a 1/f-like spectrum
        grid = rng.standard_normal((cells + 1, cells + 1))
        texture += ndimage.map_coordinates(grid, [v * cells, u * cells], order=1) * 32 / cells
    img += 12 * texture[:, :, None]
    # Shapes with edges at every angle and phase, as in a photo: a tilted square, a disk, a
    # tilted thin bar. (Axis-aligned edges would each sit at one offset to a pixelation grid.)
    a, b = (u - 0.27) * w / h, v - 0.38
    img[np.abs(0.94 * a + 0.34 * b) + np.abs(-0.34 * a + 0.94 * b) < 0.17] = [225, 45, 40]
    img[(v - 0.66) ** 2 + ((u - 0.71) * w / h) ** 2 < 0.19**2] = [30, 70, 205]
    img[(np.abs(v - 0.84 - 0.08 * (u - 0.5)) < 0.025) & (u > 0.07) & (u < 0.93)] = [240, 240, 230]
    return np.clip(img, 0, 255).astype(np.uint8)


def damage(a: np.ndarray, b: np.ndarray) -> float:
    """Mean absolute difference, in 8-bit levels."""
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


IMAGE = scene(96, 128)


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_same_seed_same_bytes_and_input_untouched(name: str) -> None:
    before = IMAGE.copy()
    for severity in SEVERITIES:
        first = corrupt(IMAGE, name, severity, seed=7)
        second = corrupt(IMAGE, name, severity, seed=7)
        assert first.tobytes() == second.tobytes()
        assert first.shape == IMAGE.shape and first.dtype == np.uint8
        assert not np.shares_memory(first, IMAGE)
    assert np.array_equal(IMAGE, before)


@pytest.mark.parametrize("name", RANDOM)
def test_another_seed_gives_other_bytes(name: str) -> None:
    for severity in SEVERITIES:
        assert not np.array_equal(corrupt(IMAGE, name, severity, 0), corrupt(IMAGE, name, severity, 1))


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_deterministic_corruptions_ignore_the_seed(name: str) -> None:
    for severity in SEVERITIES:
        assert np.array_equal(corrupt(IMAGE, name, severity, 0), corrupt(IMAGE, name, severity, 99))


def test_every_corruption_is_listed_and_does_damage() -> None:
    assert len(set(CORRUPTIONS)) == 9
    assert SEVERITIES == (1, 2, 3, 4, 5)
    for name in CORRUPTIONS:
        # Even the mildest setting visibly changes a 96 x 128 image.
        assert damage(corrupt(IMAGE, name, 1, 0), IMAGE) > 1.0, name


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_damage_grows_with_severity(name: str) -> None:
    for seed in (0, 1, 2):
        d = [damage(corrupt(IMAGE, name, s, seed), IMAGE) for s in SEVERITIES]
        # Each step adds at least 5% more damage, and severity 5 is far from severity 1.
        assert all(hi > 1.05 * lo for lo, hi in itertools.pairwise(d)), (name, seed, d)
        assert d[-1] > 1.4 * d[0], (name, seed, d)


@pytest.mark.parametrize("name", CORRUPTIONS)
@pytest.mark.parametrize("shape", [(8, 8, 3), (8, 8), (16, 16, 1), (16, 16, 3), (5, 11, 3)])
def test_tiny_images_keep_shape_and_get_worse(name: str, shape: tuple[int, ...]) -> None:
    image = scene(shape[0], shape[1])
    image = image if len(shape) == 3 and shape[2] == 3 else image[:, :, 1].reshape(shape)
    outs = [corrupt(image, name, s, 3) for s in SEVERITIES]
    assert all(o.shape == shape and o.dtype == np.uint8 for o in outs)
    assert damage(outs[-1], image) > damage(outs[0], image) > 0.0


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_grey_2d_and_one_channel_agree(name: str) -> None:
    grey = IMAGE[:, :, 0]
    flat = corrupt(grey, name, 3, 5)
    deep = corrupt(grey[:, :, None], name, 3, 5)
    assert flat.shape == grey.shape and deep.shape == (*grey.shape, 1)
    assert np.array_equal(flat, deep[:, :, 0])
    assert damage(flat, grey) > 1.0


@pytest.fixture(scope="module")
def large() -> np.ndarray:
    return scene(768, 1024)


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_large_image(name: str, large: np.ndarray) -> None:
    image = large
    out = corrupt(image, name, 5, 0)
    assert out.shape == image.shape and out.dtype == np.uint8
    assert damage(out, image) > 2.0


@pytest.mark.parametrize("name", ["motion_blur", "defocus_blur"])
def test_blur_scales_with_image_size(name: str) -> None:
    # The same scene at 4x the size, blurred, then shrunk back, matches the small one blurred:
    # the kernel grew with the image. An unscaled kernel would blur the big one 4x less.
    small = scene(48, 64)
    big = np.repeat(np.repeat(small, 4, axis=0), 4, axis=1)
    for severity in (1, 3, 5):
        blurred_small = corrupt(small, name, severity, 0).astype(np.float64)
        blurred_big = corrupt(big, name, severity, 0).astype(np.float64)
        shrunk = blurred_big.reshape(48, 4, 64, 4, 3).mean(axis=(1, 3))
        assert damage(shrunk, blurred_small) < 0.3 * damage(blurred_small, small), severity


def test_gaussian_noise_has_the_documented_sigma() -> None:
    grey = np.full((128, 128, 3), 128, dtype=np.uint8)
    for severity, sigma in zip((1, 2, 3), (0.08, 0.12, 0.18), strict=True):
        diff = corrupt(grey, "gaussian_noise", severity, 0).astype(np.float64) - 128
        assert diff.std() == pytest.approx(sigma * 255, rel=0.03)
        assert abs(diff.mean()) < 0.5


def test_occlusion_covers_the_stated_share() -> None:
    for severity, share in zip(SEVERITIES, (0.05, 0.10, 0.20, 0.30, 0.40), strict=True):
        for seed in range(5):
            out = corrupt(IMAGE, "occlusion", severity, seed)
            changed = np.any(out != IMAGE, axis=2)
            assert changed.mean() == pytest.approx(share, rel=0.06), (severity, seed)
            rows, cols = np.nonzero(changed)  # one solid rectangle
            box = (rows.max() - rows.min() + 1) * (cols.max() - cols.min() + 1)
            assert changed.sum() / box > 0.99


def test_occluder_stays_in_place_as_it_grows() -> None:
    # The seed fixes the place, the severity the size: each occluder overlaps the next one.
    masks = [np.any(corrupt(IMAGE, "occlusion", s, 11) != IMAGE, axis=2) for s in SEVERITIES]
    for small, large in itertools.pairwise(masks):
        assert (small & large).sum() > 0.5 * small.sum()


def test_image_seed_gives_each_image_its_own_stream() -> None:
    seeds = [image_seed(42, i) for i in range(100)]
    assert seeds == [image_seed(42, i) for i in range(100)]
    assert len(set(seeds)) == 100 and all(isinstance(s, int) and s >= 0 for s in seeds)
    assert image_seed(43, 0) != image_seed(42, 0)
    a = corrupt(IMAGE, "gaussian_noise", 2, image_seed(42, 0))
    b = corrupt(IMAGE, "gaussian_noise", 2, image_seed(42, 1))
    assert not np.array_equal(a, b)


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(SpecError) as e:
        corrupt(IMAGE, "snow", 1, 0)
    assert "'snow'" in str(e.value)
    assert all(name in str(e.value) for name in CORRUPTIONS)


@pytest.mark.parametrize("severity", [0, 6, -1, True, 2.5, 2.0, "3", np.array([1, 2])])
def test_bad_severity_says_the_range(severity: object) -> None:
    with pytest.raises(SpecError, match=r"severity must be one of 1, 2, 3, 4, 5"):
        corrupt(IMAGE, "fog", severity, 0)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [-1, 1.5, None, True])
def test_bad_seed(seed: object) -> None:
    with pytest.raises(SpecError, match="seed must be a non-negative integer"):
        corrupt(IMAGE, "fog", 1, seed)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="must be a non-negative integer"):
        image_seed(seed, 0)  # type: ignore[arg-type]


def test_numpy_integers_are_accepted() -> None:
    out = corrupt(IMAGE, "fog", np.int64(2), np.uint32(4))  # type: ignore[arg-type]
    assert np.array_equal(out, corrupt(IMAGE, "fog", 2, 4))


@pytest.mark.parametrize(
    ("image", "match"),
    [
        (IMAGE.astype(np.float32) / 255, "uint8"),
        (np.zeros((8, 8, 4), dtype=np.uint8), r"alpha channel"),
        (np.zeros((8,), dtype=np.uint8), "H x W x 3"),
        (np.zeros((0, 8, 3), dtype=np.uint8), "H x W x 3"),
    ],
)
def test_bad_images_say_what_to_pass(image: np.ndarray, match: str) -> None:
    with pytest.raises(DataError, match=match):
        corrupt(image, "jpeg", 1, 0)
