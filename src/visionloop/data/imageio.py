"""Decode, check and normalise one image file: the work each ingest worker does.

`normalise_bytes` turns the bytes of any image Pillow reads into the bytes visionloop stores:
8-bit RGB, upright, at most `max_side` on its longest side, as PNG or JPEG. It never raises
for a bad file; it returns a `Rejection` with a reason code and a message saying what to do.

What is stored: the original bytes when they already are what a loader wants (a baseline
JPEG or an 8-bit RGB PNG, upright, no resize needed); otherwise a re-encode, PNG for lossless
sources and JPEG at the policy's quality for lossy ones (JPEG, lossy WebP), since storing a
lossy source losslessly only inflates it.

This module imports only Pillow, numpy, the manifest's policy model and `core.fsutil` (the
standard library), so that a freshly spawned worker process starts in a fraction of a second.
"""

from __future__ import annotations

import hashlib
import io
import signal
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

import numpy as np
import numpy.typing as npt
from PIL import ExifTags, Image, ImageFile, ImageOps, JpegImagePlugin, UnidentifiedImageError

from visionloop.core.fsutil import NotRegularFileError, TooLargeError, read_capped
from visionloop.data.manifest import ImagePolicy

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".jpe", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"}
    | {".ppm", ".pgm", ".pbm", ".pnm"}
)
# The decoders Pillow may use on an untrusted file: the formats of IMAGE_EXTENSIONS, no
# others. Pillow tries every plugin it has on bytes it does not recognise, and some of them
# (EPS runs Ghostscript, for one) are no decoder to hand a stranger's file.
DECODABLE_FORMATS = ("JPEG", "PNG", "BMP", "GIF", "WEBP", "TIFF", "PPM")  # JPEG covers MPO
# Formats whose pixels were already rounded by a lossy codec: re-encoding them losslessly
# would only inflate the dataset, so they are re-encoded as JPEG at the policy's quality.
_LOSSY_FORMATS = frozenset({"JPEG", "MPO", "WEBP"})
_JPEG_FORMATS = frozenset({"JPEG", "MPO"})
# EXIF orientations 2-8 need a flip or rotation to be upright; 5-8 also swap the axes.
_ROTATES = frozenset({2, 3, 4, 5, 6, 7, 8})
_SWAPS_AXES = frozenset({5, 6, 7, 8})
# Keep at least this many times the target size before the final Lanczos pass: Pillow's
# docs call 3.0 "indistinguishable from fair resampling", at a fraction of the cost.
_REDUCING_GAP = 3.0

RGBArray = npt.NDArray[np.uint8]
StoredAs = Literal["original", "png", "jpeg"]


class RejectReason(StrEnum):
    """Why an image was left out; written as `reason` in rejected.jsonl."""

    EMPTY_FILE = "empty_file"
    MISSING_FILE = "missing_file"
    UNREADABLE = "unreadable"
    NOT_AN_IMAGE = "not_an_image"
    TRUNCATED = "truncated"
    DECODE_ERROR = "decode_error"
    UNSUPPORTED_MODE = "unsupported_mode"
    TOO_LARGE = "too_large"
    TOO_SMALL = "too_small"
    BAD_ASPECT = "bad_aspect"
    CHANGED_DURING_INGEST = "changed_during_ingest"


@dataclass(frozen=True, slots=True)
class Rejection:
    reason: RejectReason
    message: str


@dataclass(frozen=True, slots=True)
class Normalised:
    """One image ready to store, with the small facts the manifest needs about it."""

    data: bytes
    stored_as: StoredAs
    width: int
    height: int
    sha256: str  # of the *source* bytes that were decoded
    # Per-channel sums of pixel values and of their squares (0..255 scale), exact integers, so
    # that the dataset's mean/std can be summed over millions of images without rounding.
    pixel_sum: tuple[int, int, int]
    pixel_sq_sum: tuple[int, int, int]

    @property
    def pixels(self) -> int:
        return self.width * self.height


class UnsupportedModeError(ValueError):
    """A Pillow mode with no faithful mapping to 8-bit RGB (e.g. 32-bit float, LAB)."""


def unreadable(e: OSError) -> Rejection:
    return Rejection(RejectReason.UNREADABLE, f"cannot be read ({e.strerror or e}); check its permissions")


def not_a_file(e: NotRegularFileError) -> Rejection:
    return Rejection(RejectReason.UNREADABLE, e.strerror or "is not a regular file; remove it")


def empty_file() -> Rejection:
    return Rejection(RejectReason.EMPTY_FILE, "is an empty (zero-byte) file; re-copy it or delete it")


def is_image_name(name: str) -> bool:
    dot = name.rfind(".")
    return dot >= 0 and name[dot:].lower() in IMAGE_EXTENSIONS


# ---------------------------------------------------------------------------------------------
# Conversion to 8-bit RGB


def _composite(
    color: npt.NDArray[np.uint8], alpha: npt.NDArray[np.uint8], bg: tuple[int, int, int]
) -> RGBArray:
    """out = color*a + bg*(1-a), rounded to nearest. `color` is (H, W) gray or (H, W, 3)."""
    if color.ndim == 2:
        color = np.repeat(color[:, :, None], 3, axis=2)
    c = color.astype(np.uint32)
    a = alpha.astype(np.uint32)[:, :, None]
    b = np.asarray(bg, dtype=np.uint32)[None, None, :]
    # (x + 127) // 255 is exactly round(x / 255): x / 255 is never a half for integer x.
    return ((c * a + b * (255 - a) + 127) // 255).astype(np.uint8)


def _gray_to_rgb(gray: npt.NDArray[np.uint8]) -> RGBArray:
    return np.ascontiguousarray(np.repeat(gray[:, :, None], 3, axis=2))


def _scale_16bit(values: npt.NDArray[np.integer]) -> npt.NDArray[np.uint8]:
    """Map 0..65535 onto 0..255 with rounding. Pillow's own I→L conversion clips instead,
    which turns every 16-bit image above 255 into solid white."""
    v = np.clip(values.astype(np.int64), 0, 65535)
    # round(v * 255 / 65535): as in _composite, the quotient is never exactly a half.
    return ((v * 255 + 32767) // 65535).astype(np.uint8)


def to_rgb(im: Image.Image, background: tuple[int, int, int] = (255, 255, 255)) -> RGBArray:
    """Pixels of a decoded image as contiguous 8-bit RGB, (H, W, 3).

    Transparency (alpha channels, palette or colour-key transparency) is composited onto
    `background`; 16-bit and 32-bit integer grayscale are scaled from 0..65535; 1-bit becomes
    0/255; CMYK and YCbCr use Pillow's conversion. Raises `UnsupportedModeError` otherwise.
    """
    mode = im.mode
    if mode.startswith("I;16") or mode == "I":
        # 32-bit "I" is how Pillow has long presented 16-bit PNG/TIFF; treat it as 16-bit.
        return _gray_to_rgb(_scale_16bit(np.asarray(im)))
    if mode == "1":
        return _gray_to_rgb(np.asarray(im.convert("L")))
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info
    if has_alpha:
        if mode not in ("RGBA", "LA"):
            im = im.convert("RGBA")  # applies palette / colour-key transparency
        arr = np.asarray(im)
        return _composite(arr[:, :, :-1] if arr.shape[2] == 4 else arr[:, :, 0], arr[:, :, -1], background)
    if mode == "RGB":
        return np.ascontiguousarray(np.asarray(im))
    if mode == "L":
        return _gray_to_rgb(np.asarray(im))
    if mode in ("P", "CMYK", "YCbCr", "HSV"):
        return np.ascontiguousarray(np.asarray(im.convert("RGB")))
    raise UnsupportedModeError(f"Pillow mode {mode!r} has no faithful 8-bit RGB conversion")


# ---------------------------------------------------------------------------------------------
# Helpers over the header


def target_size(width: int, height: int, max_side: int | None) -> tuple[int, int] | None:
    """Size after shrinking so the longest side is `max_side` (aspect kept); None if no
    resize is needed. Never upsamples."""
    if max_side is None or max(width, height) <= max_side:
        return None
    long, short = max(width, height), min(width, height)
    new_short = max(1, (short * max_side + long // 2) // long)
    return (max_side, new_short) if width >= height else (new_short, max_side)


def _jpeg_is_baseline(data: bytes) -> bool:
    """True for a sequential Huffman-coded JPEG (SOF0/SOF1): the kind every decoder handles,
    including the hardware JPEG decoders of data-centre GPUs, which refuse progressive and
    arithmetic-coded files. Walks the marker segments up to the frame header."""
    pos = 2  # after SOI
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return False
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0xC0, 0xC1):
            return True
        if 0xC2 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # other SOFn
            return False
        if marker == 0xDA:  # start of scan without a frame header: malformed
            return False
        pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    return False


def _webp_is_lossless(data: bytes) -> bool:
    """True when the WebP bitstream is VP8L (lossless). Walks the RIFF chunks, since an
    extended (VP8X) file puts ICC/animation/alpha chunks before the image chunk."""
    pos = 12
    while pos + 8 <= len(data):
        fourcc = data[pos : pos + 4]
        if fourcc == b"VP8L":
            return True
        if fourcc == b"VP8 ":
            return False
        size = int.from_bytes(data[pos + 4 : pos + 8], "little")
        pos += 8 + size + (size & 1)
    return False


def _orientation(im: Image.Image) -> object:
    try:
        return im.getexif().get(ExifTags.Base.Orientation, 1)
    except Exception:  # a malformed EXIF block says nothing reliable; the pixels are still fine
        return 1


def _check_header(width: int, height: int, policy: ImagePolicy) -> Rejection | None:
    if width * height > policy.max_pixels:
        return Rejection(
            RejectReason.TOO_LARGE,
            f"declares {width}x{height} = {width * height:,} pixels, over the limit of "
            f"{policy.max_pixels:,} (a decompression bomb or a scan); raise --max-pixels if it is real",
        )
    if min(width, height) < max(1, policy.min_side):
        return Rejection(
            RejectReason.TOO_SMALL,
            f"is {width}x{height}, smaller than --min-side {policy.min_side}; lower --min-side to keep it",
        )
    aspect = max(width, height) / min(width, height)
    if aspect > policy.max_aspect:
        return Rejection(
            RejectReason.BAD_ASPECT,
            f"is {width}x{height} (aspect {aspect:.0f}:1, limit {policy.max_aspect:g}:1), likely a "
            "sliver or a strip; raise --max-aspect to keep it",
        )
    return None


def _load_error(e: Exception) -> Rejection:
    text = str(e) or type(e).__name__
    if "truncated" in text.lower():
        return Rejection(
            RejectReason.TRUNCATED,
            f"ends before its image data does ({text}); re-copy it from its origin or delete it",
        )
    return Rejection(
        RejectReason.DECODE_ERROR,
        f"cannot be decoded ({type(e).__name__}: {text}); open it to check, or delete it",
    )


_VALUES = np.arange(256, dtype=np.int64)


def _channel_sums(rgb: Image.Image) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    # Pillow's C histogram (768 counts, R then G then B) is exact and ~3x faster than
    # np.bincount, which first widens every pixel to int64; on an original-bytes image it
    # used to cost more than the decode itself.
    hist = np.asarray(rgb.histogram(), dtype=np.int64).reshape(3, 256)
    sums = hist @ _VALUES
    sq_sums = hist @ (_VALUES * _VALUES)
    return (int(sums[0]), int(sums[1]), int(sums[2])), (int(sq_sums[0]), int(sq_sums[1]), int(sq_sums[2]))


def _encode(im: Image.Image, lossy: bool, quality: int, subsampling: int) -> tuple[bytes, StoredAs]:
    buf = io.BytesIO()
    if lossy:
        im.save(buf, "JPEG", quality=quality, subsampling=subsampling)
        return buf.getvalue(), "jpeg"
    im.save(buf, "PNG", compress_level=6)
    return buf.getvalue(), "png"


# ---------------------------------------------------------------------------------------------
# The worker's job


def normalise_bytes(data: bytes, policy: ImagePolicy) -> Normalised | Rejection:
    """Decode, check and normalise one image held in memory. Never raises for bad input."""
    if not data:
        return empty_file()
    sha = hashlib.sha256(data).hexdigest()
    try:
        # Pillow warns above MAX_IMAGE_PIXELS and raises above twice that, both at open();
        # our own limit below is the one that decides, checked before any pixel is allocated.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data), formats=DECODABLE_FORMATS)
    except Image.DecompressionBombError as e:
        # Only where Pillow's own limit is on (outside an ingest worker), and it is lower.
        return Rejection(
            RejectReason.TOO_LARGE, f"declares too many pixels ({e}); raise --max-pixels if real"
        )
    except UnidentifiedImageError:
        head = data[:16]
        return Rejection(
            RejectReason.NOT_AN_IMAGE,
            f"is not an image Pillow recognises (starts with {head!r}); remove it or fix its extension",
        )
    except Exception as e:  # one hostile header must never end the run
        return _load_error(e)

    try:
        return _normalise_open_image(im, data, sha, policy)
    except UnsupportedModeError as e:
        return Rejection(RejectReason.UNSUPPORTED_MODE, f"{e}; convert it to 8-bit RGB or grayscale first")
    except Exception as e:  # corrupt data surfaces as OSError, SyntaxError, ValueError, ...
        return _load_error(e)
    finally:
        im.close()


def _normalise_open_image(
    im: Image.Image, data: bytes, sha: str, policy: ImagePolicy
) -> Normalised | Rejection:
    width, height = im.size
    rejection = _check_header(width, height, policy)
    if rejection is not None:
        return rejection

    fmt = im.format or ""
    target = target_size(width, height, policy.max_side)
    # Only the PNG tile names the true bit depth: Pillow presents 16-bit RGB as "RGB" too.
    rawmode = im.tile[0].args if fmt == "PNG" and isinstance(im, ImageFile.ImageFile) and im.tile else None
    may_store_original = (
        target is None
        and im.mode == "RGB"
        and "transparency" not in im.info
        and (
            (fmt in _JPEG_FORMATS and getattr(im, "bits", 8) == 8 and _jpeg_is_baseline(data))
            or (fmt == "PNG" and rawmode == "RGB")
        )
    )
    if target is not None and fmt in _JPEG_FORMATS:
        # Let libjpeg decode at 1/2, 1/4 or 1/8 scale (DCT scaling): several times faster for
        # big photos, and still leaves >= _REDUCING_GAP x the target for the Lanczos pass.
        im.draft(im.mode, (int(target[0] * _REDUCING_GAP), int(target[1] * _REDUCING_GAP)))
    im.load()
    # Read after load(): a PNG may carry its eXIf chunk after the pixel data.
    orientation = _orientation(im)

    if may_store_original and orientation not in _ROTATES:
        pixel_sum, pixel_sq_sum = _channel_sums(im)
        return Normalised(data, "original", width, height, sha, pixel_sum, pixel_sq_sum)

    # Re-encode a JPEG with its own chroma subsampling: 4:2:0 on a 4:4:4 source would throw
    # away half the colour resolution on top of the requantisation. Otherwise Pillow's 4:2:0.
    sampling = JpegImagePlugin.get_sampling(im) if fmt in _JPEG_FORMATS else -1
    if orientation in _ROTATES:
        im = ImageOps.exif_transpose(im)
        if target is not None and orientation in _SWAPS_AXES:
            target = (target[1], target[0])

    rgb = Image.fromarray(to_rgb(im, policy.alpha_background))
    if target is not None and rgb.size != target:
        rgb = rgb.resize(target, Image.Resampling.LANCZOS, reducing_gap=_REDUCING_GAP)
    lossy = fmt in _LOSSY_FORMATS and not (fmt == "WEBP" and _webp_is_lossless(data))
    encoded, stored_as = _encode(rgb, lossy, policy.lossy_quality, sampling if sampling >= 0 else 2)
    pixel_sum, pixel_sq_sum = _channel_sums(rgb)
    return Normalised(encoded, stored_as, rgb.width, rgb.height, sha, pixel_sum, pixel_sq_sum)


def max_file_bytes(policy: ImagePolicy) -> int:
    """The largest file an image within `policy.max_pixels` can need: 8 bytes a pixel (16-bit
    RGBA stored raw, as a TIFF can) and 64 MiB for metadata. A bigger file is refused from its
    size before a byte is read: a stray video or disk image named .jpg would otherwise be read
    whole into a pool worker's memory before its header said what it is."""
    return policy.max_pixels * 8 + 64 * 2**20


def normalise_file(path: str, policy: ImagePolicy) -> Normalised | Rejection:
    """`normalise_bytes` over a file, opened read-only; the source is never touched."""
    limit = max_file_bytes(policy)
    try:
        data = read_capped(path, limit, what="an image")
    except NotRegularFileError as e:
        return not_a_file(e)
    except FileNotFoundError:
        return Rejection(RejectReason.MISSING_FILE, "does not exist (moved or deleted during ingest?)")
    except OSError as e:
        return unreadable(e)
    except TooLargeError as e:
        size = f"{e.size:,} bytes" if e.size is not None else "larger than that"
        return Rejection(
            RejectReason.TOO_LARGE,
            f"is {size}, more than an image of at most {policy.max_pixels:,} pixels can take "
            f"({limit:,} bytes); raise --max-pixels if it is real",
        )
    return normalise_bytes(data, policy)


def normalise_files(paths: Sequence[str], policy: ImagePolicy) -> list[Normalised | Rejection]:
    """The unit of work sent to a pool process: a small batch of paths, to amortise IPC."""
    return [normalise_file(p, policy) for p in paths]


def init_worker() -> None:
    """Pool initializer. Ctrl-C is the parent's to handle (it cancels the pool and cleans up);
    a worker dying of it mid-batch would only add noise and a broken pool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Our limit (`max_pixels`), checked on the parsed header before load(), is the one that
    # decides. Pillow's check runs at that same point, so turning it off here allocates
    # nothing more; it only stops Pillow from reporting a limit other than the user's.
    Image.MAX_IMAGE_PIXELS = None
