"""Seeded image corruptions at five severities, for stress-testing a model.

In the spirit of ImageNet-C (Hendrycks & Dietterich, ICLR 2019), written with numpy, scipy
and Pillow only, plus what a deployed camera meets that ImageNet-C lacks (night, glare,
occlusion):

    from visionloop.eval.corruptions import CORRUPTIONS, SEVERITIES, corrupt, image_seed
    for i, image in enumerate(images):
        for name in CORRUPTIONS:
            for severity in SEVERITIES:
                bad = corrupt(image, name, severity, image_seed(run_seed, i))

Guarantees every corruption keeps:
- geometry: the output has the input's shape and dtype (uint8), and nothing moves (blur
  kernels are centred, pixelation maps blocks back in place), so detection boxes stay valid;
- reproducibility: the output is a function of (image, name, severity, seed) alone, drawn
  from `np.random.default_rng` seeded by (seed, name), never from global state;
- order: severity 1 is mild and 5 severe. The random draws do not depend on the severity
  (one image and seed get the same streak angle, occluder place, fog field, glare spot and
  noise pattern at every severity) and only the strength grows, so damage to each image
  grows with severity, and a severity curve compares like with like (common random
  numbers) instead of mixing in a new random layout at each step;
- scale: lengths (blur radii, streaks, bloom, glare spot) are fractions of the image's short
  side, given below in pixels of a 224-pixel image (ImageNet-C's size) and multiplied by
  short_side / 224, so a 16 px digit and a 768 px photo see comparable damage relative to
  their content. Blur kernels are built at sub-pixel precision, so a tiny image still gets a
  graded (if slight) blur instead of none. Per-pixel corruptions (noise, JPEG, night) do not
  scale; pixelate scales above 224 px only (see `_pixelate`).
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Callable
from typing import Final

import numpy as np
from numpy.typing import NDArray
from PIL import Image

# scipy ships no type hints and pyproject's mypy overrides do not list it (yet); it is installed
# with scikit-learn, a runtime dependency.
from scipy import ndimage, signal, special  # type: ignore[import-untyped]

from visionloop.core.errors import DataError, SpecError
from visionloop.eval.options import CORRUPTIONS as CORRUPTIONS
from visionloop.eval.options import SEVERITIES as SEVERITIES

# The names and severities live with the options (`visionloop eval` checks them before
# importing this module's scipy): re-exported here, where the corruptions are.

REFERENCE_SIDE: Final = 224
"""Lengths in the parameter tables are pixels of an image whose short side is this long."""

_Float = NDArray[np.float32]
# A corruption sees the image as float32 H x W x C in [0, 1], the severity as 0..4, its own
# generator and the length scale (short side / REFERENCE_SIDE); it may return values outside
# [0, 1]: `corrupt` clips once.
_Corruption = Callable[[_Float, int, np.random.Generator, float], _Float]

# Above this many taps a direct convolution costs more than an FFT of the padded image.
_DIRECT_MAX_TAPS = 81


# -- kernels -----------------------------------------------------------------------------


def _splat_kernel(points: NDArray[np.float64]) -> NDArray[np.float32]:
    """A blur kernel from sample points (dy, dx) of a continuous point-spread function.

    Each point is spread bilinearly over its four pixels, which is the PSF convolved with a
    pixel's footprint: a radius or a streak of 0.3 px gives a slight blur rather than the
    identity a rasterised disk or line would, so damage stays graded on tiny images.
    """
    reach = int(np.ceil(np.abs(points).max())) + 1
    size = 2 * reach + 1
    kernel = np.zeros((size, size), dtype=np.float64)
    shifted = points + reach
    base = np.floor(shifted).astype(np.int64)
    frac = shifted - base
    for oy, wy in ((0, 1.0 - frac[:, 0]), (1, frac[:, 0])):
        for ox, wx in ((0, 1.0 - frac[:, 1]), (1, frac[:, 1])):
            np.add.at(kernel, (base[:, 0] + oy, base[:, 1] + ox), wy * wx)
    # Trim empty outer rings symmetrically: the kernel stays odd-sized and centred.
    while kernel.shape[0] > 1 and not kernel[[0, -1], :].any() and not kernel[:, [0, -1]].any():
        kernel = kernel[1:-1, 1:-1]
    return np.asarray(kernel / kernel.sum(), dtype=np.float32)


def _disk_kernel(radius: float) -> NDArray[np.float32]:
    """Defocus: a uniform disk of `radius` pixels (sampled on a grid at most 1/4 px apart)."""
    if radius <= 0.0:
        return np.ones((1, 1), dtype=np.float32)
    steps = int(np.ceil(radius / min(0.25, radius / 8.0)))
    axis = np.linspace(-radius, radius, 2 * steps + 1)
    yy, xx = np.meshgrid(axis, axis, indexing="ij")
    inside = yy**2 + xx**2 <= radius**2 + 1e-12
    return _splat_kernel(np.stack([yy[inside], xx[inside]], axis=1))


def _line_kernel(length: float, angle: float) -> NDArray[np.float32]:
    """Motion: a uniform streak `length` pixels long at `angle` radians, centred on the pixel
    (a one-sided streak would shift the image by half its length and move every box)."""
    if length <= 0.0:
        return np.ones((1, 1), dtype=np.float32)
    t = np.linspace(-length / 2.0, length / 2.0, int(np.ceil(length / 0.25)) + 2)
    return _splat_kernel(np.stack([t * np.sin(angle), t * np.cos(angle)], axis=1))


def _gaussian_kernel(sigma: float) -> NDArray[np.float32]:
    """A Gaussian integrated over each pixel (exact for sub-pixel sigma), to 3 sigma."""
    if sigma <= 0.0:
        return np.ones((1, 1), dtype=np.float32)
    reach = max(1, int(np.ceil(3.0 * sigma)))
    edges = (np.arange(-reach, reach + 2) - 0.5) / sigma
    g = np.diff(special.ndtr(edges))
    g /= g.sum()
    return np.outer(g, g).astype(np.float32)


def _convolve(x: _Float, kernel: NDArray[np.float32]) -> _Float:
    """Blur every channel of H x W x C `x` by a centred, point-symmetric kernel, mirroring at
    the borders (so edges do not darken)."""
    if kernel.shape == (1, 1):
        return x
    if kernel.size <= _DIRECT_MAX_TAPS:
        return np.asarray(ndimage.correlate(x, kernel[:, :, None], mode="reflect"), dtype=np.float32)
    r = kernel.shape[0] // 2
    padded = np.pad(x, ((r, r), (r, r), (0, 0)), mode="symmetric")
    out = signal.fftconvolve(padded, kernel[:, :, None], mode="valid", axes=(0, 1))
    return np.asarray(out, dtype=np.float32)


def _interp_matrix(n_out: int, n_in: int) -> NDArray[np.float32]:
    """Rows that interpolate `n_in` grid values to `n_out` positions with a smoothstep
    (value noise without the creases of plain bilinear interpolation)."""
    t = np.linspace(0.0, n_in - 1.0, n_out)
    i0 = np.minimum(np.floor(t).astype(np.int64), n_in - 2)
    f = t - i0
    f = f * f * (3.0 - 2.0 * f)
    m = np.zeros((n_out, n_in), dtype=np.float32)
    rows = np.arange(n_out)
    m[rows, i0] = 1.0 - f
    m[rows, i0 + 1] += f
    return m


def _fractal_field(height: int, width: int, decay: float, rng: np.random.Generator) -> _Float:
    """Smooth seeded noise in [0, 1]: octaves of value noise on grids of 3, 5, 9, ... points
    across the image, each finer octave `decay` times weaker (lower decay, busier fog)."""
    field = np.zeros((height, width), dtype=np.float32)
    # Octaves finer than 64 cells carry < 1/decay**6 of the weight and most of the cost.
    finest = max(2, min(max(height, width), 64))
    cells, amplitude = 2, 1.0
    while cells <= finest:
        grid = rng.random((cells + 1, cells + 1), dtype=np.float32)
        field += amplitude * (_interp_matrix(height, cells + 1) @ grid @ _interp_matrix(width, cells + 1).T)
        cells, amplitude = cells * 2, amplitude / decay
    span = float(field.max() - field.min())
    return (field - field.min()) / span if span > 0 else np.zeros_like(field)


def _to_uint8(x: _Float) -> NDArray[np.uint8]:
    return np.asarray(np.clip(np.rint(x * 255.0), 0, 255), dtype=np.uint8)


def _pil(x: _Float) -> Image.Image:
    u8 = _to_uint8(x)
    return Image.fromarray(u8[:, :, 0] if u8.shape[2] == 1 else u8)


def _from_pil(im: Image.Image, channels: int) -> _Float:
    arr = np.asarray(im, dtype=np.float32) / 255.0
    return arr.reshape(arr.shape[0], arr.shape[1], channels)


# -- the corruptions -----------------------------------------------------------------------
# Each table holds one value per severity 1..5.

_NOISE_SIGMA = (0.08, 0.12, 0.18, 0.26, 0.38)  # ImageNet-C's gaussian_noise, in [0, 1] units


def _gaussian_noise(x: _Float, s: int, rng: np.random.Generator, scale: float) -> _Float:
    return x + np.float32(_NOISE_SIGMA[s]) * rng.standard_normal(x.shape, dtype=np.float32)


_NIGHT_EXPOSURE = (0.6, 0.42, 0.28, 0.17, 0.10)  # fraction of the light reaching the sensor
_NIGHT_GAMMA = (1.1, 1.2, 1.35, 1.5, 1.7)  # shadows sink first
_NIGHT_PHOTONS = (2000.0, 1000.0, 500.0, 250.0, 120.0)  # photons of a full-scale pixel in daylight
_NIGHT_READ = (0.002, 0.003, 0.004, 0.006, 0.008)  # read noise before the gain, in [0, 1] units
_NIGHT_TINT = (0.04, 0.06, 0.08, 0.10, 0.12)  # blue cast


def _night(x: _Float, s: int, rng: np.random.Generator, scale: float) -> _Float:
    """Low light as a camera records it: a dark gamma curve, a sensor's shot (Poisson) and
    read (Gaussian) noise at that light, then the auto-exposure's gain, which restores only
    part of the brightness (sqrt of the loss) and amplifies the noise with it; a slight blue
    tint on colour images. A white pixel ends 23% (severity 1) to 68% (5) darker, with 3% to
    29% noise."""
    exposure, photons = _NIGHT_EXPOSURE[s], _NIGHT_PHOTONS[s]
    light = exposure * photons * np.power(x, _NIGHT_GAMMA[s], dtype=np.float32)
    captured = rng.poisson(light).astype(np.float32) / np.float32(photons)
    captured += np.float32(_NIGHT_READ[s]) * rng.standard_normal(x.shape, dtype=np.float32)
    out = captured * np.float32(1.0 / np.sqrt(exposure))
    if x.shape[2] == 3:
        t = _NIGHT_TINT[s]
        out *= np.array([1.0 - t, 1.0 - t / 3.0, 1.0 + t / 3.0], dtype=np.float32)
    return out


_GLARE_GAIN = (1.15, 1.3, 1.5, 1.75, 2.0)  # over-exposure
_GLARE_BLOOM = (0.3, 0.45, 0.6, 0.8, 1.0)  # blurred highlights added back
_GLARE_SPOT = (0.25, 0.4, 0.6, 0.8, 1.0)  # peak of the light source's spot
_GLARE_SPOT_RADIUS = (18.0, 25.0, 31.0, 38.0, 45.0)  # reference pixels
_GLARE_VEIL = (0.03, 0.06, 0.10, 0.15, 0.20)  # veiling glare: stray light lifts the blacks
_GLARE_BLOOM_SIGMA = 9.0  # reference pixels
_GLARE_HIGHLIGHT = 0.8  # over-exposed luminance above this blooms


def _glare(x: _Float, s: int, rng: np.random.Generator, scale: float) -> _Float:
    """A bright light in or near the frame: over-exposure, bloom around highlights, a seeded
    bright spot, and a veil of stray light that lowers contrast everywhere."""
    h, w = x.shape[:2]
    out = x * np.float32(_GLARE_GAIN[s])
    highlights = np.maximum(out.mean(axis=2, keepdims=True) - _GLARE_HIGHLIGHT, 0.0)
    bloom = _convolve(highlights, _gaussian_kernel(_GLARE_BLOOM_SIGMA * scale))
    cy, cx = rng.uniform(0.0, h), rng.uniform(0.0, w)
    radius = _GLARE_SPOT_RADIUS[s] * scale
    yy, xx = np.ogrid[:h, :w]
    d2 = ((yy + 0.5 - cy) ** 2 + (xx + 0.5 - cx) ** 2).astype(np.float32)
    spot = _GLARE_SPOT[s] * np.exp(-d2 / np.float32(2.0 * radius**2))
    out = out + np.float32(_GLARE_BLOOM[s]) * bloom + spot[:, :, None]
    veil = np.float32(_GLARE_VEIL[s])
    return np.asarray(out + veil * (1.0 - np.minimum(out, 1.0)), dtype=np.float32)


_MOTION_LENGTH = (6.0, 10.0, 15.0, 21.0, 28.0)  # reference pixels, close to ImageNet-C's spread


def _motion_blur(x: _Float, s: int, rng: np.random.Generator, scale: float) -> _Float:
    """Camera shake: a centred streak at a seeded angle in [-45°, 45°] (as ImageNet-C)."""
    angle = np.deg2rad(rng.uniform(-45.0, 45.0))
    return _convolve(x, _line_kernel(_MOTION_LENGTH[s] * scale, angle))


_DEFOCUS_RADIUS = (3.0, 4.0, 6.0, 8.0, 10.0)  # reference pixels, ImageNet-C's disk radii


def _defocus_blur(x: _Float, s: int, rng: np.random.Generator, scale: float) -> _Float:
    return _convolve(x, _disk_kernel(_DEFOCUS_RADIUS[s] * scale))


_FOG_DENSITY = (0.35, 0.6, 0.9, 1.3, 1.8)  # optical depth: mean haze 1 - exp(-d) ≈ 30%..83%
_FOG_DECAY = (2.0, 2.0, 1.7, 1.5, 1.4)  # ImageNet-C's wibble decay
_FOG_AIRLIGHT = 0.85  # the haze's own brightness


def _fog(x: _Float, s: int, rng: np.random.Generator, scale: float) -> _Float:
    """Haze of seeded, uneven thickness (the scattering model I = J·t + A·(1 - t)), with
    transmission t = exp(-density · (0.5 + field)) over a smooth fractal field in [0, 1]."""
    field = _fractal_field(x.shape[0], x.shape[1], _FOG_DECAY[s], rng)
    haze = 1.0 - np.exp(-np.float32(_FOG_DENSITY[s]) * (0.5 + field))
    haze = haze[:, :, None]
    return np.asarray(x * (1.0 - haze) + np.float32(_FOG_AIRLIGHT) * haze, dtype=np.float32)


# ImageNet-C's 25, 18, 15, 10, 7, spread a little wider so each step visibly adds damage.
# JPEG works on 8 x 8 pixel blocks whatever the image size: at one quality, a large smooth
# photo loses less than a small busy one, as it would from a camera.
_JPEG_QUALITY = (25, 18, 12, 8, 5)


def _jpeg(x: _Float, s: int, rng: np.random.Generator, scale: float) -> _Float:
    buf = io.BytesIO()
    _pil(x).save(buf, "JPEG", quality=_JPEG_QUALITY[s])
    buf.seek(0)
    with Image.open(buf) as im:
        return _from_pil(im.convert("L" if x.shape[2] == 1 else "RGB"), x.shape[2])


_PIXELATE_FACTOR = (0.6, 0.5, 0.4, 0.3, 0.25)  # ImageNet-C's, on a 224-pixel image


def _pixelate(x: _Float, s: int, rng: np.random.Generator, scale: float) -> _Float:
    """Down-sample by averaging, then up-sample to the same size by repeating pixels.

    Up to 224 px (short side) the factors are ImageNet-C's, cells of 1.7 to 4 px; above, the
    cells grow with the image (a 768 px photo keeps as many cells as a 224 px one), so large
    photos lose comparable detail. A cell cannot shrink under a pixel, so below 224 px the
    factors stay ImageNet-C's and small images lose relatively more than large ones.
    """
    h, w = x.shape[:2]
    f = _PIXELATE_FACTOR[s] / max(1.0, scale)
    small = _pil(x).resize((max(1, round(w * f)), max(1, round(h * f))), Image.Resampling.BOX)
    return _from_pil(small.resize((w, h), Image.Resampling.NEAREST), x.shape[2])


_OCCLUSION_AREA = (0.05, 0.10, 0.20, 0.30, 0.40)  # share of the image covered


def _occlusion(x: _Float, s: int, rng: np.random.Generator, scale: float) -> _Float:
    """One seeded rectangle covering a share of the area, at a seeded aspect ratio (1:2 to
    2:1) and place, filled with uniform noise as in Random Erasing (Zhong et al. 2020)."""
    h, w = x.shape[:2]
    area = _OCCLUSION_AREA[s] * h * w
    aspect = float(np.exp(rng.uniform(np.log(0.5), np.log(2.0))))  # height / width
    # Place by a share of the free room, not an integer draw over it: the same seed puts
    # the rectangle in the same region at every severity, growing rather than jumping.
    fy, fx = rng.random(2)
    rh = int(np.clip(round(np.sqrt(area * aspect)), 1, h))
    rw = int(np.clip(round(area / rh), 1, w))
    top = min(int(fy * (h - rh + 1)), h - rh)
    left = min(int(fx * (w - rw + 1)), w - rw)
    out = x.copy()
    out[top : top + rh, left : left + rw] = rng.random((rh, rw, x.shape[2]), dtype=np.float32)
    return out


_FUNCTIONS: dict[str, _Corruption] = {
    "night": _night,
    "glare": _glare,
    "motion_blur": _motion_blur,
    "defocus_blur": _defocus_blur,
    "fog": _fog,
    "gaussian_noise": _gaussian_noise,
    "jpeg": _jpeg,
    "pixelate": _pixelate,
    "occlusion": _occlusion,
}


# -- the public entry points -----------------------------------------------------------------


def _check_seed(seed: object, what: str) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise SpecError(f"{what} must be a non-negative integer, got {seed!r} (e.g. {what}=0)")
    return int(seed)


def image_seed(seed: int, index: int) -> int:
    """The seed for image number `index` of a pass over a dataset run with `seed`.

    Pass it to `corrupt`, so each image gets its own stream, the same in every run whatever
    order or subset of the images is corrupted: `corrupt(img_i, name, sev, image_seed(seed, i))`.
    """
    entropy = (_check_seed(seed, "seed"), _check_seed(index, "index"))
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0])


def corrupt(image: np.ndarray, name: str, severity: int, seed: int) -> np.ndarray:
    """`image` (uint8, H x W x 3, H x W or H x W x 1) corrupted by `name` at `severity` (1 mild
    .. 5 severe); a new uint8 array of the same shape, a function of the four arguments alone.

    `seed` is a non-negative integer; for a dataset, give each image `image_seed(seed, index)`.
    The corruptions (see the module docstring for the scale rule) are:
    night, glare, motion_blur, defocus_blur, fog, gaussian_noise, jpeg, pixelate, occlusion.
    defocus_blur, jpeg and pixelate are deterministic and ignore the seed.
    """
    fn = _FUNCTIONS.get(name) if isinstance(name, str) else None
    if fn is None:
        raise SpecError(f"unknown corruption {name!r}; choose one of: {', '.join(CORRUPTIONS)}.")
    if isinstance(severity, bool) or not isinstance(severity, int | np.integer) or severity not in SEVERITIES:
        raise SpecError(
            f"severity must be one of {', '.join(map(str, SEVERITIES))} (1 mild, 5 severe), got {severity!r}."
        )
    seed = _check_seed(seed, "seed")
    arr = np.asarray(image)
    if arr.dtype != np.uint8:
        raise DataError(
            f"corrupt needs a uint8 image, got dtype {arr.dtype}; convert it first, "
            "e.g. np.clip(image * 255, 0, 255).astype(np.uint8) for floats in [0, 1]."
        )
    if not (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[2] in (1, 3))) or min(arr.shape[:2]) < 1:
        raise DataError(
            f"corrupt needs an H x W x 3 (RGB), H x W or H x W x 1 (grey) image, got shape {arr.shape}; "
            "drop an alpha channel with image[..., :3]."
        )
    x = arr.reshape(arr.shape[0], arr.shape[1], -1).astype(np.float32) / np.float32(255.0)
    # The name's CRC, not its place in CORRUPTIONS, so adding a corruption changes no stream.
    rng = np.random.default_rng(np.random.SeedSequence((seed, zlib.crc32(name.encode()))))
    scale = min(arr.shape[0], arr.shape[1]) / REFERENCE_SIDE
    return _to_uint8(fn(x, int(severity) - 1, rng, scale)).reshape(arr.shape)
