"""The image endpoint's input: an image file (raw body or a multipart form's file part),
decoded and preprocessed exactly as the model card says (`card.eval_preprocess()`), so a
served image meets the same pixels an evaluation image did.

What one request can make the server allocate is bounded here: the multipart form by its
number of parts and header lines, the image by its pixel count (read from the header, before
any pixel is decoded), and a large image is decoded *reduced* to about twice what the model
card's resize needs (a JPEG's DCT scaling via `Image.draft`, then a box filter on the decoded
pixels) before it becomes a tensor. An image that needs no reduction takes exactly the path
it always did, so its pixels are unchanged.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from email.message import Message
from typing import Any

import numpy as np
import numpy.typing as npt

from visionloop.data.imageio import DECODABLE_FORMATS
from visionloop.models.card import EvalPreprocess, ModelCard
from visionloop.serve.protocol import ProtocolError

# Decoding is bounded by pixels, not bytes: a tiny PNG can claim 100k x 100k pixels.
# 24 Mpx is a 6000 x 4000 camera photo; `max_image_pixels` in the serving config changes it.
MAX_PIXELS = 24_000_000
# A form holding an image needs one part (two, with a caption); the standard library's MIME
# parser took 32 s for a 10 MB body of 200,000 parts, and nested multiparts recursed.
MAX_PARTS = 16
MAX_PART_HEADERS = 64
# Decode to at least this many times the size the card's resize needs: Image.thumbnail's
# default `reducing_gap`, whose result Pillow documents as indistinguishable from a full
# decode for the final antialiased resize.
REDUCING_GAP = 2.0


def image_bytes(
    body: bytes, content_type: str, max_parts: int = MAX_PARTS, max_headers: int = MAX_PART_HEADERS
) -> bytes:
    """The image in a request body: the body itself, or the first file part of a multipart form."""
    if not body:
        raise ProtocolError("the request body is empty; send an image file (JPEG or PNG)")
    if not content_type.lower().startswith("multipart/"):
        return body
    boundary = _boundary(content_type)
    for headers, payload in _parts(body, boundary, max_parts, max_headers):
        disposition = Message()
        disposition["content-disposition"] = headers.get("content-disposition", "")
        field = disposition.get_param("name", header="content-disposition")
        # A file field (curl -F file=@x.jpg), or a plain field named file or image.
        if payload and (disposition.get_filename() or field in ("file", "image")):
            return payload
    raise ProtocolError(
        'the multipart form has no file part; send the image as a file field, e.g. -F "file=@cat.jpg"'
    )


def _boundary(content_type: str) -> bytes:
    msg = Message()
    msg["content-type"] = content_type
    boundary = msg.get_param("boundary")
    if not isinstance(boundary, str) or not 1 <= len(boundary) <= 70:
        raise ProtocolError(
            "the multipart body cannot be parsed: its Content-Type header has no boundary of 1 to 70 "
            'characters, e.g. "multipart/form-data; boundary=X"'
        )
    return boundary.encode("latin-1")


def _parts(
    body: bytes, boundary: bytes, max_parts: int, max_headers: int
) -> Iterator[tuple[dict[str, str], bytes]]:
    """(headers, payload) of each part of a multipart body (RFC 2046 section 5.1.1), lazily:
    a caller that finds its part early stops there. Nested multiparts are not descended into
    (RFC 7578 forms have none). Every step is a `bytes.find`, so the work is linear in the body."""
    bad = "the multipart body cannot be parsed; check its boundary and Content-Type header"
    delimiter = b"--" + boundary
    start = body.find(delimiter)
    if start < 0 or (start > 0 and body[start - 2 : start] != b"\r\n"):
        raise ProtocolError(bad)
    pos = start + len(delimiter)
    count = 0
    while not body.startswith(b"--", pos):  # the close delimiter ends the body
        eol = body.find(b"\r\n", pos)
        if eol < 0 or body[pos:eol].strip(b" \t"):
            raise ProtocolError(bad)
        end = body.find(b"\r\n" + delimiter, eol + 2)
        if end < 0:
            raise ProtocolError(bad + " (the closing boundary is missing)")
        count += 1
        if count > max_parts:
            raise ProtocolError(
                f"the multipart form has more than {max_parts} parts, the server's limit; send the image "
                "as one file field",
                status=413,
            )
        yield _part(body[eol + 2 : end], max_headers)
        pos = end + 2 + len(delimiter)


def _part(part: bytes, max_headers: int) -> tuple[dict[str, str], bytes]:
    if part.startswith(b"\r\n"):  # no headers
        return {}, part[2:]
    split = part.find(b"\r\n\r\n")
    if split < 0:
        raise ProtocolError("a multipart part has no blank line after its headers")
    lines = part[:split].split(b"\r\n", max_headers)
    if len(lines) > max_headers:
        raise ProtocolError(f"a multipart part has more than {max_headers} header lines, the server's limit")
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(b":")
        if not colon:
            raise ProtocolError(f"a multipart part has a header line without a colon: {line[:80]!r}")
        headers[name.strip().decode("latin-1").lower()] = value.strip().decode("latin-1")
    return headers, part[split + 4 :]


def needed_side(pre: EvalPreprocess) -> int:
    """The fewest pixels the short side of a decoded image needs for the card's resize
    (orientation-free: EXIF rotation is applied after decoding)."""
    size = pre.resize_size
    return size if isinstance(size, int) else max(size)


# EXIF orientations that turn the picture a quarter (transpose, 90, transverse, 270): the
# upright image's width is the stored height.
_QUARTER_TURNS = frozenset({5, 6, 7, 8})
_ORIENTATION = 0x0112


def decode(data: bytes, need: int | None = None, max_pixels: int = MAX_PIXELS) -> Any:
    """The decoded PIL image, reduced while decoding when it is much larger than `need`
    (see the module docstring); a 413 past `max_pixels`, a 400/415 for what is not an image."""
    return decode_sized(data, need, max_pixels)[0]


def decode_sized(
    data: bytes, need: int | None = None, max_pixels: int = MAX_PIXELS
) -> tuple[Any, tuple[int, int]]:
    """`decode`, and the upright (width, height) of the image *as sent*: its stored size before
    any reduction, swapped when its EXIF orientation turns it a quarter. An answer in image
    pixels (a detector's boxes) is given in that frame, whatever the decoder reduced."""
    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(data), formats=DECODABLE_FORMATS)
        w, h = im.size
        if w * h > max_pixels:
            raise ProtocolError(
                f"the image is {w}x{h} pixels, more than the {max_pixels:,} the server decodes "
                "(max_image_pixels in the serving config); resize it first",
                status=413,
            )
        target = None if need is None else math.ceil(need * REDUCING_GAP)
        if target is not None and im.format == "JPEG" and min(w, h) >= 2 * target:
            im.draft("RGB", (target, target))  # the decoder scales by 1/2, 1/4 or 1/8
        im.load()
        if target is not None and min(im.size) >= 2 * target:
            im = _reduce(im, min(im.size) // target)
        # Read from the decoded image, which keeps the EXIF block through a reduction: the
        # transform applies this same orientation (ImageOps.exif_transpose).
        orientation = im.getexif().get(_ORIENTATION)
    except UnidentifiedImageError:
        raise ProtocolError(
            "the body is not an image the server can decode; send a JPEG or PNG file", status=415
        ) from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ProtocolError(f"the image cannot be decoded ({e}); send an intact JPEG or PNG file") from None
    return im, ((h, w) if orientation in _QUARTER_TURNS else (w, h))


def _reduce(im: Any, factor: int) -> Any:
    """`im` shrunk by about an integer factor (box average), in a mode `to_rgb` reads as it
    read the original: palettes, colour keys, 1-bit and 16-bit images are converted first."""
    from PIL import Image

    mode = im.mode
    if mode == "1":
        im = im.convert("L")
    elif mode.startswith("I;16"):
        im = im.convert("I")
    elif mode in ("P", "PA") or "transparency" in im.info:
        # Colour keys and palettes do not survive averaging: apply them first.
        transparent = mode == "PA" or "transparency" in im.info
        im = im.convert("RGBA" if transparent else "RGB")
    info = im.info
    # A box filter over the whole extent, not Image.reduce: reduce's last box is partial when
    # the side is not a multiple of `factor`, which stretches the picture by up to 1/target.
    w, h = im.size
    reduced = im.resize((round(w / factor), round(h / factor)), Image.Resampling.BOX)
    reduced.info = {k: v for k, v in info.items() if k != "transparency"}  # keeps the EXIF orientation
    return reduced


def preprocess(
    data: bytes,
    transform: Callable[[Any], Any],
    dtype: np.dtype[Any],
    need: int | None = None,
    max_pixels: int = MAX_PIXELS,
) -> npt.NDArray[Any]:
    """Image bytes → a (1, C, H, W) array of `dtype`, or a 400/413/415 naming the problem."""
    return decode_image(data, transform, dtype, need, max_pixels).input


@dataclass(frozen=True)
class DecodedImage:
    data: bytes  # the image file
    input: npt.NDArray[Any]  # the model's input, (1, C, H, W)
    size: tuple[int, int]  # upright (width, height) as sent
    stats: dict[str, float] | None = None  # `image_statistics`, when asked for


def decode_image(
    data: bytes,
    transform: Callable[[Any], Any],
    dtype: np.dtype[Any],
    need: int | None = None,
    max_pixels: int = MAX_PIXELS,
    stats: bool = False,
) -> DecodedImage:
    """`preprocess`, the upright (width, height) of the image as sent (`decode_sized`), and
    with `stats` the image's `image_statistics`."""
    im, size = decode_sized(data, need, max_pixels)
    tensor = transform(im)
    x = np.ascontiguousarray(tensor.numpy()[None], dtype=dtype)
    return DecodedImage(data, x, size, image_statistics(im, size) if stats else None)


def image_statistics(im: Any, size: tuple[int, int]) -> dict[str, float]:
    """`monitor.imagestats` of a decoded image (as `decode_sized` returns it, possibly reduced),
    with the width, height and aspect of the image as sent: what the prediction log records
    and a monitoring reference is built from, so both read an image the same way."""
    from visionloop.monitor.imagestats import image_stats

    rgb = im if im.mode == "RGB" else im.convert("RGB")
    stats = image_stats(np.asarray(rgb))
    stats.update(width=float(size[0]), height=float(size[1]), aspect=size[0] / max(size[1], 1))
    return stats


def card_transform(card: ModelCard) -> Callable[[Any], Any]:
    return card.eval_preprocess().to_transform()
