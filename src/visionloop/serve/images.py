"""The image endpoint's input: an image file (raw body or a multipart form's file part),
decoded and preprocessed exactly as the model card says (`card.eval_preprocess()`), so a
served image meets the same pixels an evaluation image did."""

from __future__ import annotations

import io
from collections.abc import Callable
from email.message import Message
from email.parser import BytesParser
from email.policy import HTTP
from typing import Any

import numpy as np
import numpy.typing as npt

from visionloop.models.card import ModelCard
from visionloop.serve.protocol import ProtocolError

# Decoding is bounded by pixels, not bytes: a tiny PNG can claim 100k x 100k pixels.
MAX_PIXELS = 64_000_000


def image_bytes(body: bytes, content_type: str) -> bytes:
    """The image in a request body: the body itself, or the first file part of a multipart form."""
    if not body:
        raise ProtocolError("the request body is empty; send an image file (JPEG or PNG)")
    if not content_type.lower().startswith("multipart/"):
        return body
    # python-multipart is not a dependency; the standard library's MIME parser reads
    # multipart/form-data bodies (RFC 7578 is MIME multipart).
    msg = BytesParser(policy=HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1") + b"\r\n\r\n" + body
    )
    if not msg.is_multipart():
        raise ProtocolError("the multipart body cannot be parsed; check its boundary and Content-Type header")
    parts: list[Message] = [p for p in msg.iter_parts() if isinstance(p, Message)]
    for part in parts:
        payload = part.get_payload(decode=True)
        field = part.get_param("name", header="content-disposition")
        # A file field (curl -F file=@x.jpg), or a plain field named file or image.
        if isinstance(payload, bytes) and payload and (part.get_filename() or field in ("file", "image")):
            return payload
    raise ProtocolError(
        'the multipart form has no file part; send the image as a file field, e.g. -F "file=@cat.jpg"'
    )


def preprocess(data: bytes, transform: Callable[[Any], Any], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """Image bytes → a (1, C, H, W) array of `dtype`, or a 400/415 naming the problem."""
    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(data))
        w, h = im.size
        if w * h > MAX_PIXELS:
            raise ProtocolError(
                f"the image is {w}x{h} pixels, more than the {MAX_PIXELS:,} the server decodes; "
                "resize it first",
                status=413,
            )
        im.load()
    except UnidentifiedImageError:
        raise ProtocolError(
            "the body is not an image the server can decode; send a JPEG or PNG file", status=415
        ) from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        raise ProtocolError(f"the image cannot be decoded ({e}); send an intact JPEG or PNG file") from None
    tensor = transform(im)
    return np.ascontiguousarray(tensor.numpy()[None], dtype=dtype)


def card_transform(card: ModelCard) -> Callable[[Any], Any]:
    return card.eval_preprocess().to_transform()
