"""Per-image statistics: exact values on constructed images, agreement with a plain float64
computation, finite values on degenerate images, a bounded grid for large ones, and a blur
that `univariate_ks` catches through them. No timing is asserted here."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import ndimage  # type: ignore[import-untyped]  # no type hints; comes with scikit-learn

from visionloop.core.errors import DataError
from visionloop.monitor.drift import univariate_ks
from visionloop.monitor.imagestats import IMAGE_STATS, MAX_GRID_PIXELS, MAX_GRID_SIDE, grid_step, image_stats


def rgb(h: int, w: int, colour: tuple[int, int, int]) -> np.ndarray:
    return np.broadcast_to(np.array(colour, dtype=np.uint8), (h, w, 3)).copy()


def checkerboard(h: int, w: int, cell: int) -> np.ndarray:
    yy, xx = np.mgrid[:h, :w]
    return np.where(((yy // cell + xx // cell) % 2) == 0, 255, 0).astype(np.uint8)


def reference_stats(image: np.ndarray) -> dict[str, float]:
    """The definitions, written plainly in float64 (no grid: images within 256 x 256)."""
    img = image.astype(np.float64)
    if img.ndim == 2:
        img = np.repeat(img[:, :, None], 3, axis=2)
    luma = (0.299 * img[..., 0] + 0.587 * img[..., 1] + 0.114 * img[..., 2]) / 255.0
    lap = ndimage.laplace(luma)[1:-1, 1:-1]  # [1, -2, 1] on each axis: the 4-neighbour kernel
    hi, lo = img.max(axis=2), img.min(axis=2)
    sat = np.divide(hi - lo, hi, out=np.zeros_like(hi), where=hi > 0)
    return {
        "brightness": luma.mean(),
        "contrast": luma.std(),
        "sharpness": lap.var() if lap.size else 0.0,
        "saturation": sat.mean() if image.ndim == 3 else 0.0,
        "width": float(image.shape[1]),
        "height": float(image.shape[0]),
        "aspect": image.shape[1] / image.shape[0],
    }


def test_keys_are_the_published_names_in_order() -> None:
    assert tuple(image_stats(rgb(4, 4, (1, 2, 3)))) == IMAGE_STATS
    assert IMAGE_STATS == ("brightness", "contrast", "sharpness", "saturation", "width", "height", "aspect")


def test_black_white_and_grey() -> None:
    black = image_stats(rgb(32, 48, (0, 0, 0)))
    assert black == {
        "brightness": 0.0,
        "contrast": 0.0,
        "sharpness": 0.0,
        "saturation": 0.0,
        "width": 48.0,
        "height": 32.0,
        "aspect": 1.5,
    }
    white = image_stats(rgb(32, 48, (255, 255, 255)))
    assert white["brightness"] == pytest.approx(1.0, abs=1e-12)
    assert (white["contrast"], white["sharpness"], white["saturation"]) == (0.0, 0.0, 0.0)
    grey = image_stats(rgb(10, 10, (128, 128, 128)))
    assert grey["brightness"] == pytest.approx(128 / 255, abs=1e-12) and grey["saturation"] == 0.0


def test_saturated_red_against_grey_and_half_black() -> None:
    red = image_stats(rgb(20, 20, (255, 0, 0)))
    assert red["saturation"] == 1.0
    assert red["brightness"] == pytest.approx(0.299, abs=1e-12)  # BT.601 weight of red
    assert image_stats(rgb(20, 20, (0, 255, 0)))["brightness"] == pytest.approx(0.587, abs=1e-12)
    half = rgb(20, 20, (255, 0, 0))
    half[:, 10:] = 0  # black has no saturation: (max - min) / max is taken as 0 there
    assert image_stats(half)["saturation"] == pytest.approx(0.5, abs=1e-7)
    pastel = image_stats(rgb(8, 8, (200, 100, 100)))
    assert pastel["saturation"] == pytest.approx(0.5, abs=1e-7)


def test_a_sharp_checkerboard_against_blurred_copies() -> None:
    sharp = checkerboard(64, 64, 1)
    s = image_stats(sharp)
    # every interior Laplacian is +-4 (in luma units of [0, 1]): variance 16, the maximum
    assert s["sharpness"] == pytest.approx(16.0, abs=1e-12)
    assert s["brightness"] == pytest.approx(0.5, abs=1e-12)
    assert s["contrast"] == pytest.approx(0.5, abs=1e-12)

    board = checkerboard(96, 96, 8)
    values = [image_stats(board)["sharpness"]]
    for sigma in (0.7, 1.5, 3.0):
        blurred = np.clip(np.round(ndimage.gaussian_filter(board.astype(float), sigma)), 0, 255)
        values.append(image_stats(blurred.astype(np.uint8))["sharpness"])
    assert values == sorted(values, reverse=True) and values[-1] < values[0] / 20, values
    # blur hardly moves brightness
    assert image_stats(board)["brightness"] == pytest.approx(0.5, abs=0.01)


def test_sizes_and_aspect() -> None:
    tall = image_stats(rgb(100, 50, (9, 9, 9)))
    assert (tall["width"], tall["height"], tall["aspect"]) == (50.0, 100.0, 0.5)
    wide = image_stats(np.zeros((30, 90), dtype=np.uint8))
    assert (wide["width"], wide["height"], wide["aspect"]) == (90.0, 30.0, 3.0)


@pytest.mark.parametrize("shape", [(1, 1, 3), (1, 1), (2, 2, 3), (1, 7, 3), (9, 1), (3, 3, 3), (1, 1, 1)])
@pytest.mark.parametrize("value", [0, 1, 254, 255])
def test_tiny_and_constant_images_give_finite_values(shape: tuple[int, ...], value: int) -> None:
    stats = image_stats(np.full(shape, value, dtype=np.uint8))
    assert all(math.isfinite(v) for v in stats.values()), stats
    assert stats["contrast"] == 0.0 and stats["sharpness"] == 0.0
    assert stats["brightness"] == pytest.approx(value / 255, abs=1e-12)
    assert stats["aspect"] == shape[1] / shape[0]


def test_agrees_with_a_plain_float64_computation() -> None:
    rng = np.random.default_rng(0)
    for shape in [(224, 224, 3), (37, 91, 3), (256, 256, 3), (64, 48), (50, 40, 1)]:
        image = rng.integers(0, 256, size=shape, dtype=np.uint8)
        got = image_stats(image)
        want = reference_stats(image[:, :, 0] if shape[-1:] == (1,) else image)
        for key in IMAGE_STATS:
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (shape, key)


def test_grey_equals_rgb_with_equal_channels_and_the_input_is_untouched() -> None:
    grey = np.random.default_rng(1).integers(0, 256, size=(40, 30), dtype=np.uint8)
    before = grey.copy()
    as_rgb = np.repeat(grey[:, :, None], 3, axis=2)
    a, b, c = image_stats(grey), image_stats(as_rgb), image_stats(grey[:, :, None])
    assert a == c
    for key in IMAGE_STATS:
        assert a[key] == pytest.approx(b[key], abs=1e-12)
    assert np.array_equal(grey, before)
    assert image_stats(grey) == a  # deterministic


def test_large_images_are_read_on_a_bounded_grid() -> None:
    assert grid_step(224, 224) == 1 and grid_step(256, 256) == 1
    assert grid_step(1080, 1920) == 6  # 180 x 320 grid
    for h, w in [(1080, 1920), (4000, 3000), (257, 257), (1, 10_000_000), (300, 90_000)]:
        step = grid_step(h, w)
        rows, cols = math.ceil(h / step), math.ceil(w / step)
        assert rows * cols <= MAX_GRID_PIXELS + rows + cols and max(rows, cols) <= MAX_GRID_SIDE
    # estimates from the grid stay close to the full-image values of a smooth scene
    yy, xx = np.mgrid[:1080, :1920]
    scene = np.stack([xx * 255 // 1919, yy * 255 // 1079, (xx + yy) * 255 // 2998], axis=-1).astype(np.uint8)
    got, want = image_stats(scene), reference_stats(scene)
    for key in ("brightness", "contrast", "saturation", "width", "height", "aspect"):
        assert got[key] == pytest.approx(want[key], rel=0.01, abs=1e-3), key
    assert image_stats(np.zeros((1, 10_000_000), dtype=np.uint8))["aspect"] == 10_000_000.0


def test_a_blur_moves_sharpness_and_univariate_ks_names_it() -> None:
    """A camera that loses focus: the reference is 60 textured frames, the window 40 others
    slightly blurred (sigma 1 px); brightness stays, sharpness drops most (contrast a little
    too: blur smooths the texture)."""
    rng = np.random.default_rng(2)

    def frame(blur: float) -> np.ndarray:
        noise = rng.normal(size=(48, 64, 3))
        texture = ndimage.gaussian_filter(noise, sigma=(1.5, 1.5, 0)) * 400 + rng.uniform(80, 170)
        if blur:
            texture = ndimage.gaussian_filter(texture, sigma=(blur, blur, 0))
        return np.clip(np.round(texture), 0, 255).astype(np.uint8)

    def table(frames: list[np.ndarray]) -> dict[str, np.ndarray]:
        rows = [image_stats(f) for f in frames]
        return {
            k: np.array([r[k] for r in rows]) for k in ("brightness", "contrast", "sharpness", "saturation")
        }

    reference = table([frame(0.0) for _ in range(60)])
    same = univariate_ks(reference, table([frame(0.0) for _ in range(40)]))
    blurred = univariate_ks(reference, table([frame(1.0) for _ in range(40)]))
    assert not same.drift
    assert blurred.drift and blurred.moved[0] == "sharpness"


def test_bad_inputs_say_what_to_do() -> None:
    with pytest.raises(DataError, match=r"uint8.*astype\(np.uint8\)"):
        image_stats(np.zeros((4, 4, 3), dtype=np.float32))
    with pytest.raises(DataError, match=r"drop the alpha channel"):
        image_stats(np.zeros((4, 4, 4), dtype=np.uint8))
    with pytest.raises(DataError, match="H x W x 3"):
        image_stats(np.zeros((2, 4, 4, 3), dtype=np.uint8))
    with pytest.raises(DataError, match="empty"):
        image_stats(np.zeros((0, 4, 3), dtype=np.uint8))
    with pytest.raises(DataError, match="numpy array"):
        image_stats([[0, 1], [2, 3]])  # type: ignore[arg-type]
