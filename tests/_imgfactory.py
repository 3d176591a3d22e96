"""Images made on the fly for ingest tests: ordinary ones and hostile ones.

Nothing is downloaded and no binary fixture is committed: every file is built by code, small,
and deterministic (same arguments, same bytes).
"""

from __future__ import annotations

import hashlib
import io
import os
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image


def noise(width: int, height: int, seed: int, channels: int = 3) -> np.ndarray:
    """Random 8-bit pixels, (H, W, C) or (H, W) for one channel; distinct per seed."""
    rng = np.random.default_rng(seed)
    shape = (height, width) if channels == 1 else (height, width, channels)
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def encode(im: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kwargs)
    return buf.getvalue()


def png(arr: np.ndarray) -> bytes:
    return encode(Image.fromarray(arr), "PNG")


def jpeg(arr: np.ndarray, quality: int = 90, **kwargs: object) -> bytes:
    return encode(Image.fromarray(arr), "JPEG", quality=quality, **kwargs)


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def truncate(data: bytes, keep: float = 0.6) -> bytes:
    """The first `keep` share of a file: an interrupted download or copy."""
    return data[: int(len(data) * keep)]


# -- hand-made PNGs, for what Pillow refuses to write (16-bit RGB, lying headers) ----------------


def _chunk(kind: bytes, body: bytes) -> bytes:
    return (
        struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    )


def raw_png(width: int, height: int, bit_depth: int, color_type: int, idat: bytes) -> bytes:
    """A PNG with the given IHDR and an IDAT holding `idat` (already zlib-compressed)."""
    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")


def bomb_png(width: int = 100_000, height: int = 100_000) -> bytes:
    """A decompression bomb's header: declares width x height pixels, is a few dozen bytes."""
    return raw_png(width, height, 8, 2, zlib.compress(b"\x00" * 64))


def rgb16_png(arr16: np.ndarray) -> bytes:
    """A 48-bit (16 bits per channel) RGB PNG from a (H, W, 3) uint16 array."""
    h, w, _ = arr16.shape
    rows = b"".join(b"\x00" + arr16[y].astype(">u2").tobytes() for y in range(h))
    return raw_png(w, h, 16, 2, zlib.compress(rows))


def gray16_png(arr16: np.ndarray) -> bytes:
    """A 16-bit grayscale PNG from a (H, W) uint16 array (Pillow opens it as mode I;16)."""
    return png(arr16.astype(np.uint16))


def exif_jpeg(arr: np.ndarray, orientation: int, quality: int = 95) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return encode(Image.fromarray(arr), "JPEG", quality=quality, exif=exif)


def cmyk_jpeg(width: int, height: int, cmyk: tuple[int, int, int, int]) -> bytes:
    return encode(Image.new("CMYK", (width, height), cmyk), "JPEG", quality=95)


# -- trees --------------------------------------------------------------------------------------


def image_folder(
    root: Path, counts: dict[str, int], size: int = 12, seed: int = 0, fmt: str = "png"
) -> list[Path]:
    """root/<class>/<class>_<i>.<fmt> with distinct noise images; returns the paths."""
    paths = []
    for c, (cls, n) in enumerate(sorted(counts.items())):
        for i in range(n):
            arr = noise(size, size, seed=seed * 1_000_003 + c * 10_007 + i)
            data = png(arr) if fmt == "png" else jpeg(arr)
            paths.append(write(root / cls / f"{cls}_{i:03d}.{fmt}", data))
    return paths


def tree_digest(root: Path) -> str:
    """sha256 over every file's relative path, bytes, mode and mtime under `root`: any write,
    rename, permission or timestamp change to the tree changes it."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath, name)
            st = p.stat()
            h.update(f"{p.relative_to(root).as_posix()}|{st.st_mode}|{st.st_mtime_ns}|".encode())
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()
