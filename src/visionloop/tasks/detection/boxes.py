"""A detection record's boxes, as bytes in a shard: the one encoding ingest writes and every
reader decodes.

`encode_boxes(boxes, labels, ignore)` → little-endian float32 rows, one per object, in one of
two layouts:

- no ignored box (the usual case, and every dataset ingested before the flag existed): rows
  of five numbers, x1, y1, x2, y2 in pixels of the *stored* image (after ingest's EXIF
  rotation and `--max-side`) and the 0-based class index (exact in float32 up to 2**24
  classes). No header: the length says how many objects (an image with none stores b"");
- at least one ignored box (COCO's `iscrowd: 1`, VOC's `<difficult>1</difficult>`):
  `FLAGGED_MAGIC`, then rows of six numbers, the five above and the ignore flag (0 or 1).

Why two layouts rather than a sixth column everywhere: the bytes of a dataset without
ignored boxes stay what they were, so its version (a hash of these bytes) does not move and
its old shards keep reading; only a dataset whose content really changed gets a new one.
The magic is a float32 NaN, which no valid five-column record can start with (its first
value is a finite x1), so the two layouts can never be mistaken for each other whatever the
length.

`decode_boxes(data, num_classes)` checks what it reads (a shard is untrusted: it may not have
come from our ingest): a length that is a whole number of rows, finite coordinates, x2 > x1,
y2 > y1, integral class indices inside [0, num_classes), flags of exactly 0 or 1, and at most
`MAX_BOXES` rows. No pickle, in either layout.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from visionloop.core.errors import DataError

_ROW = np.dtype("<f4")
ROW_VALUES = 5
ROW_BYTES = ROW_VALUES * _ROW.itemsize
FLAGGED_ROW_VALUES = 6
FLAGGED_ROW_BYTES = FLAGGED_ROW_VALUES * _ROW.itemsize
# A quiet NaN as a little-endian float32 (0x7FC14C56, "VL" in its low bytes).
FLAGGED_MAGIC = b"VL\xc1\x7f"
# COCO's most crowded image has under 100 objects; 10,000 bounds one record's decode.
MAX_BOXES = 10_000


def encode_boxes(boxes: npt.ArrayLike, labels: npt.ArrayLike, ignore: npt.ArrayLike | None = None) -> bytes:
    """(N, 4) xyxy pixels, (N,) 0-based class indices and, optionally, (N,) ignore flags
    (truthy: a crowd or difficult box that training leaves out and evaluation ignores) →
    the shard's bytes."""
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    lab = np.asarray(labels, dtype=np.int64).reshape(-1)
    if len(b) != len(lab):
        raise ValueError(f"{len(b)} boxes but {len(lab)} labels: one label per box")
    if len(b) > MAX_BOXES:
        raise ValueError(f"{len(b)} boxes in one image; at most {MAX_BOXES} are stored")
    flags = np.zeros(len(b), dtype=bool) if ignore is None else np.asarray(ignore, dtype=bool).reshape(-1)
    if len(flags) != len(b):
        raise ValueError(f"{len(b)} boxes but {len(flags)} ignore flags: one flag per box")
    columns = [b, lab[:, None].astype(np.float64)]
    if not flags.any():
        return np.concatenate(columns, axis=1).astype(_ROW).tobytes()
    columns.append(flags[:, None].astype(np.float64))
    return FLAGGED_MAGIC + np.concatenate(columns, axis=1).astype(_ROW).tobytes()


def decode_boxes(
    data: bytes, num_classes: int | None = None, *, where: str = "a shard record"
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """The shard's bytes → boxes (N, 4) float32 xyxy, labels (N,) int64 and ignore flags
    (N,) bool (all False for the five-column layout), checked."""
    flagged = data[: len(FLAGGED_MAGIC)] == FLAGGED_MAGIC
    body = memoryview(data)[len(FLAGGED_MAGIC) :] if flagged else memoryview(data)
    values, row_bytes = (FLAGGED_ROW_VALUES, FLAGGED_ROW_BYTES) if flagged else (ROW_VALUES, ROW_BYTES)
    if len(body) % row_bytes:
        layout = f"{row_bytes}-byte rows" + (" after the ignore-flag header" if flagged else "")
        raise DataError(
            f"{where} holds {len(data)} bytes of boxes, not a whole number of {layout}; "
            "the dataset is damaged. Re-ingest it with `visionloop data ingest`."
        )
    n = len(body) // row_bytes
    if n > MAX_BOXES:
        raise DataError(f"{where} holds {n} boxes, more than the {MAX_BOXES} one image may have")
    rows = np.frombuffer(body, dtype=_ROW).reshape(n, values)
    boxes = np.array(rows[:, :4], dtype=np.float32)
    raw_labels = rows[:, 4]
    raw_flags = rows[:, 5] if flagged else np.zeros(n, dtype=_ROW)
    problem = None
    if not np.isfinite(rows).all():
        problem = "a coordinate, class or flag that is not a finite number"
    elif n and not ((boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])).all():
        problem = "a box whose x2 <= x1 or y2 <= y1"
    elif n and (raw_labels != np.round(raw_labels)).any():
        problem = "a class index that is not a whole number"
    elif n and (raw_labels.min() < 0 or (num_classes is not None and raw_labels.max() >= num_classes)):
        problem = f"a class index outside [0, {num_classes})"
    elif ((raw_flags != 0) & (raw_flags != 1)).any():
        problem = "an ignore flag that is neither 0 nor 1"
    if problem is not None:
        raise DataError(f"{where} holds {problem}; the dataset is damaged. Re-ingest it.")
    return boxes, raw_labels.astype(np.int64), raw_flags == 1
