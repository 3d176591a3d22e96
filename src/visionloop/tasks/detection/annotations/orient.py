"""EXIF orientation: the size of the upright image and where a box lands on it.

A stored (raw) pixel array of size `W x H` with EXIF orientation `o` is shown upright after
the transform Pillow's `ImageOps.exif_transpose` applies (and ingest stores). In continuous
pixel coordinates (edges, not centres), a raw point `(x, y)` lands at:

| o | transform          | upright point    | upright size |
|---|--------------------|------------------|--------------|
| 1 | none               | (x, y)           | W x H        |
| 2 | mirror horizontal  | (W - x, y)       | W x H        |
| 3 | rotate 180         | (W - x, H - y)   | W x H        |
| 4 | mirror vertical    | (x, H - y)       | W x H        |
| 5 | transpose          | (y, x)           | H x W        |
| 6 | rotate 90 clockwise| (H - y, x)       | H x W        |
| 7 | transverse         | (H - y, W - x)   | H x W        |
| 8 | rotate 90 counter- | (y, W - x)       | H x W        |

A box maps corner by corner, then takes min/max. The inverse of every orientation is itself,
except 6 and 8, which undo each other; the inverse is applied with the size of the upright frame.
Any other value (0, 9, garbage) means "as stored", as Pillow treats it.
"""

from __future__ import annotations

from visionloop.tasks.detection.annotations.model import Box

ROTATES = frozenset({2, 3, 4, 5, 6, 7, 8})
SWAPS_AXES = frozenset({5, 6, 7, 8})


def normal(orientation: object) -> int:
    """The orientation as 1..8; anything else is 1 (shown as stored)."""
    return orientation if isinstance(orientation, int) and orientation in ROTATES else 1


def upright_size(width: int, height: int, orientation: int) -> tuple[int, int]:
    return (height, width) if orientation in SWAPS_AXES else (width, height)


def inverse(orientation: int) -> int:
    return {6: 8, 8: 6}.get(orientation, orientation)


def _point(x: float, y: float, o: int, w: float, h: float) -> tuple[float, float]:
    if o == 2:
        return w - x, y
    if o == 3:
        return w - x, h - y
    if o == 4:
        return x, h - y
    if o == 5:
        return y, x
    if o == 6:
        return h - y, x
    if o == 7:
        return h - y, w - x
    if o == 8:
        return y, w - x
    return x, y


def to_upright(box: Box, orientation: int, width: int, height: int) -> Box:
    """`box` on a raw image of `width x height` with `orientation`, moved onto the upright image."""
    if orientation not in ROTATES:
        return box
    x1, y1, x2, y2 = box
    ax, ay = _point(x1, y1, orientation, width, height)
    bx, by = _point(x2, y2, orientation, width, height)
    return min(ax, bx), min(ay, by), max(ax, bx), max(ay, by)


def to_raw(box: Box, orientation: int, upright_width: int, upright_height: int) -> Box:
    """`box` on the upright image (`upright_width x upright_height`), moved back onto the raw
    pixel array of an image with `orientation`: the inverse of `to_upright`."""
    return to_upright(box, inverse(orientation), upright_width, upright_height)
