"""Perceptual hashes (64-bit DCT pHash) and the near-duplicate search that keeps copies of
training images, and of each other, out of a labelling budget.

The hash (Zauner, "Implementation and Benchmarking of Perceptual Image Hash Functions", 2010;
the variant of the `imagehash` library): the image, upright (EXIF orientation applied) and
composited onto white, is reduced to 32x32 grayscale (ITU-R 601 luma, Lanczos, aspect
ignored); its 2-D DCT-II is taken and the 8x8 lowest frequencies kept; bit i is set where
coefficient i (row-major, DC first, bit 63 first) is above the median of the 64. Re-encoding,
rescaling, mild blur or a brightness change barely move the low frequencies, so a copy keeps
almost all 64 bits while unrelated images differ in about half of them.

Why 6 bits by default (`DEFAULT_MAX_DISTANCE`), from `benchmarks/label/phash_threshold.py`
(166 photo-like images, each copied 11 ways: JPEG quality 30-95, halved, doubled, a 2% crop,
brightness +-15%, a 1 px blur): 98.5% of the copies lie within 6 bits of their original (the
median copy at 0; 99.3% within 8, 99.8% within 10; what escapes is mostly crops and brightness
changes of nearly flat images, whose low frequencies sit near their median), and no two distinct
images came closer than 14 bits. Tiny, low-detail images are the exception: among scikit-learn's
8x8 digits, different handwritten digits of one class can lie 2 bits apart, and 6 bits would
leave out 11% of the set (27% at 8): for such images, lower the threshold or keep the filter to
training images only (`within=False`; in selection, `SelectOptions(dedupe_within_pool=False)`).
Raise it (8-10) to catch heavier edits.

Decoding is bounded as ingest bounds it (`visionloop.data.imageio`): only the decoders of
`DECODABLE_FORMATS`, and the pixel count read from the header is checked before any pixel is
decoded; a large JPEG is decoded reduced (DCT scaling), since 32x32 is all the hash needs.

Searching: `near_duplicates` compares every candidate with every reference hash (XOR and a
population count on uint64 arrays, in chunks of ~4M pairs) and with every earlier candidate;
100k candidates against 10k training images is ~1e9 pairs, seconds on one core, and the
within-pool pass costs n²/2 pairs (100k: ~5e9, under a minute).

    >>> from visionloop.label.phash import phash_file, near_duplicates
    >>> train = np.array([phash_file(p) for p in train_paths], dtype=np.uint64)
    >>> pool = np.array([phash_file(p) for p in pool_paths], dtype=np.uint64)
    >>> for d in near_duplicates(pool, train):
    ...     print(pool_paths[d.index], "copies", (train_paths if d.in_reference else pool_paths)[d.of])
"""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from os import PathLike
from typing import Any

import numpy as np
import numpy.typing as npt
from PIL import Image, ImageOps, UnidentifiedImageError

from visionloop.core.errors import DataError
from visionloop.core.fsutil import TooLargeError, read_capped
from visionloop.data.imageio import DECODABLE_FORMATS, UnsupportedModeError, to_rgb
from visionloop.data.manifest import ImagePolicy

HASH_SIZE = 8  # 8x8 low frequencies: 64 bits
IMAGE_SIZE = 32  # the grayscale reduction the DCT is taken on
DEFAULT_MAX_DISTANCE = 6  # bits of 64; see the module docstring
# Ingest's own default, so every image a dataset may hold can be hashed.
MAX_PIXELS = ImagePolicy().max_pixels
# XOR-and-count work per chunk: 4M uint64 cells, 32 MiB, whatever the sizes of the sets.
_CHUNK_CELLS = 1 << 22
# Decode a JPEG to at least twice the hash's input size (Image.thumbnail's reducing gap).
_DRAFT_SIZE = 2 * IMAGE_SIZE

HashArray = npt.NDArray[np.uint64]


def _dct_matrix(n: int) -> npt.NDArray[np.float64]:
    """The unnormalised DCT-II as a matrix, y = C @ x (scipy.fft.dct(x, type=2, norm=None)):
    C[k, j] = 2 cos(pi k (2j + 1) / 2n). As a matrix, a batch of images is one einsum."""
    k = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    return 2.0 * np.cos(np.pi * k * (2 * j + 1) / (2 * n))


_DCT = _dct_matrix(IMAGE_SIZE)[:HASH_SIZE]  # only the low frequencies are ever kept
_BIT_WEIGHTS = np.uint64(1) << np.arange(HASH_SIZE * HASH_SIZE - 1, -1, -1, dtype=np.uint64)


def phash_pixels(gray: npt.ArrayLike) -> HashArray:
    """The hashes of already-reduced grayscale images, (..., 32, 32) -> (...) uint64."""
    x = np.asarray(gray, dtype=np.float64)
    if x.shape[-2:] != (IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(f"expected (..., {IMAGE_SIZE}, {IMAGE_SIZE}) pixels, got {x.shape}")
    low = np.einsum("ka,...ab,lb->...kl", _DCT, x, _DCT).reshape(*x.shape[:-2], HASH_SIZE * HASH_SIZE)
    bits = low > np.median(low, axis=-1, keepdims=True)
    hashes: HashArray = (bits.astype(np.uint64) * _BIT_WEIGHTS).sum(axis=-1, dtype=np.uint64)
    return hashes


def reduce_image(im: Image.Image) -> npt.NDArray[np.uint8]:
    """A decoded image as the hash sees it: upright, on white, 32x32 ITU-R 601 luma."""
    # A malformed EXIF block says nothing reliable about orientation; the pixels are still fine.
    with contextlib.suppress(Exception):
        im = ImageOps.exif_transpose(im)
    gray = Image.fromarray(to_rgb(im)).convert("L")
    return np.asarray(gray.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.LANCZOS))


def phash_image(im: Image.Image) -> int:
    """The 64-bit pHash of a decoded image, as a Python int."""
    return int(phash_pixels(reduce_image(im)))


def phash_bytes(data: bytes, *, max_pixels: int = MAX_PIXELS, name: str = "the image") -> int:
    """The pHash of an encoded image (JPEG, PNG, ...: `DECODABLE_FORMATS`). Raises DataError
    for what cannot be hashed (not an image, corrupt, more than `max_pixels` pixels)."""
    try:
        # Our limit below decides, checked on the header before any pixel is allocated;
        # Pillow's own warning (lower, at open()) would only report a different limit.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=DECODABLE_FORMATS)
    except Image.DecompressionBombError as e:  # Pillow's own limit, past 2 x its MAX_IMAGE_PIXELS
        raise DataError(f"{name} declares too many pixels ({e}); resize it if it is real") from None
    except UnidentifiedImageError:
        raise DataError(
            f"{name} is not an image Pillow recognises (starts with {data[:16]!r}); "
            "leave it out of the pool or fix the file"
        ) from None
    except Exception as e:  # a hostile header surfaces as anything Pillow's parsers raise
        raise DataError(f"{name} cannot be decoded ({type(e).__name__}: {e}); check the file") from None
    with im:
        width, height = im.size
        if width * height > max_pixels:
            raise DataError(
                f"{name} declares {width}x{height} = {width * height:,} pixels, over the limit of "
                f"{max_pixels:,} (a decompression bomb or a scan); resize it, or raise max_pixels if real"
            )
        try:
            if im.format in ("JPEG", "MPO"):
                im.draft(im.mode, (_DRAFT_SIZE, _DRAFT_SIZE))  # libjpeg scales by 1/2, 1/4 or 1/8
            im.load()
            return phash_image(im)
        except UnsupportedModeError as e:
            raise DataError(f"{name}: {e}; convert it to 8-bit RGB or grayscale first") from None
        except Exception as e:  # truncated or corrupt data: OSError, SyntaxError, ValueError, ...
            raise DataError(f"{name} cannot be decoded ({type(e).__name__}: {e}); check the file") from None


def phash_file(path: str | PathLike[str], *, max_pixels: int = MAX_PIXELS) -> int:
    """`phash_bytes` of a file, named in any error."""
    try:
        # Capped as ingest caps a file (no image within max_pixels is bigger); a FIFO refused.
        data = read_capped(path, max_pixels * 8 + 64 * 2**20, what="an image")
    except TooLargeError as e:
        raise DataError(str(e)) from None
    except OSError as e:
        raise DataError(f"{path} cannot be read ({e.strerror or e}); check that it exists") from None
    return phash_bytes(data, max_pixels=max_pixels, name=str(path))


def to_hex(h: int) -> str:
    """A hash as 16 hex digits, for JSON (whose readers may keep only 53 bits of an integer)."""
    return f"{int(h) & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def from_hex(text: str) -> int:
    if len(text) != 16:
        raise ValueError(f"a pHash is 16 hex digits, e.g. 'c3a1f0e08c9c1e3f'; got {text!r}")
    return int(text, 16)


def as_hashes(values: Sequence[int] | npt.ArrayLike) -> HashArray:
    """Hashes as a 1-D uint64 array: from a uint64 array as is, from signed integers (a
    database's int64 column) by their two's-complement bits, from Python ints (any above
    2**63 included, which numpy alone would turn into floats)."""
    if not isinstance(values, np.ndarray):
        values = [int(v) & 0xFFFF_FFFF_FFFF_FFFF for v in np.asarray(values, dtype=object).reshape(-1)]
        return np.array(values, dtype=np.uint64)
    if values.dtype == np.int64:
        return values.reshape(-1).view(np.uint64)
    if values.dtype.kind not in "ui":
        raise ValueError(f"hashes must be 64-bit unsigned integers, got dtype {values.dtype}")
    return values.reshape(-1).astype(np.uint64, copy=False)


_POPCOUNT8 = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)


def _popcount(x: HashArray) -> npt.NDArray[np.uint8]:
    count = getattr(np, "bitwise_count", None)  # numpy >= 2.0: one instruction per element
    if count is not None:
        result: npt.NDArray[np.uint8] = count(x)
        return result
    as_bytes = np.ascontiguousarray(x).view(np.uint8).reshape(*x.shape, 8)
    counts: npt.NDArray[np.uint8] = _POPCOUNT8[as_bytes].sum(axis=-1, dtype=np.uint8)
    return counts


def hamming(a: Any, b: Any) -> npt.NDArray[np.uint8]:
    """Bits that differ between hashes, element-wise with broadcasting (a[:, None] vs b[None])."""
    return _popcount(np.bitwise_xor(np.asarray(a, dtype=np.uint64), np.asarray(b, dtype=np.uint64)))


@dataclass(frozen=True, slots=True)
class Duplicate:
    """Candidate `index` is within `distance` bits of reference `of` (`in_reference`) or of
    candidate `of`, an earlier candidate that was kept."""

    index: int
    of: int
    in_reference: bool
    distance: int


def near_duplicates(
    candidates: Sequence[int] | npt.ArrayLike,
    reference: Sequence[int] | npt.ArrayLike | None = None,
    *,
    max_distance: int = DEFAULT_MAX_DISTANCE,
    within: bool = True,
) -> list[Duplicate]:
    """The candidates to leave out, in candidate order: those within `max_distance` bits of a
    reference hash (the nearest one, the earliest among equals), then, with `within`, those
    within it of an earlier candidate that was kept. Candidates are thus kept greedily in the
    order given: pass them best first (e.g. most uncertain first) so each group of copies keeps
    its best member. A candidate left out never causes another to be left out."""
    if not 0 <= max_distance <= 64:
        raise ValueError(f"max_distance is a number of bits, 0 to 64; got {max_distance}")
    cand = as_hashes(candidates)
    ref = as_hashes(reference) if reference is not None else np.zeros(0, dtype=np.uint64)
    n = len(cand)
    found: dict[int, Duplicate] = {}

    if len(ref) and n:
        rows = max(1, _CHUNK_CELLS // len(ref))
        for start in range(0, n, rows):
            d = hamming(cand[start : start + rows, None], ref[None, :])
            nearest = d.argmin(axis=1)  # the first minimum: the earliest reference among equals
            best = d[np.arange(len(d)), nearest]
            for i in np.flatnonzero(best <= max_distance):
                found[start + int(i)] = Duplicate(start + int(i), int(nearest[i]), True, int(best[i]))

    if within and n > 1:
        alive = np.array([i for i in range(n) if i not in found], dtype=np.int64)
        for dropped, kept, dist in _resolve_within(cand[alive], max_distance):
            found[int(alive[dropped])] = Duplicate(int(alive[dropped]), int(alive[kept]), False, dist)
    return [found[i] for i in sorted(found)]


def _resolve_within(hashes: HashArray, max_distance: int) -> list[tuple[int, int, int]]:
    """(dropped, kept-it-copies, distance) for the greedy in-order pass over `hashes`: every
    pair (i < j) within `max_distance` is found in chunks of rows j against columns i < j;
    then j is dropped when any of its near earlier candidates was kept (the nearest of them,
    the earliest among equals, is named)."""
    n = len(hashes)
    if n < 2:
        return []
    near: dict[int, list[tuple[int, int]]] = {}  # j -> [(distance, i)] with i < j
    rows = max(1, _CHUNK_CELLS // n)
    for start in range(1, n, rows):
        stop = min(n, start + rows)
        d = hamming(hashes[start:stop, None], hashes[None, :stop])
        # Only earlier columns: i < j, i.e. strictly below the chunk's diagonal.
        earlier = np.arange(stop)[None, :] < np.arange(start, stop)[:, None]
        jj, ii = np.nonzero((d <= max_distance) & earlier)
        for j, i in zip(jj.tolist(), ii.tolist(), strict=True):
            near.setdefault(start + j, []).append((int(d[j, i]), i))
    dropped: set[int] = set()
    result = []
    for j in sorted(near):
        kept = [(dist, i) for dist, i in near[j] if i not in dropped]
        if kept:
            dist, i = min(kept)
            dropped.add(j)
            result.append((j, i, dist))
    return result
