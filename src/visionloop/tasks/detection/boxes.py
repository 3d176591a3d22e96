"""A detection record's boxes, as bytes in a shard: the one encoding ingest writes and every
reader decodes.

`encode_boxes(boxes, labels)` → little-endian float32 rows of five numbers per object:
x1, y1, x2, y2 in pixels of the *stored* image (after ingest's EXIF rotation and
`--max-side`), and the 0-based class index (exact in float32 up to 2**24 classes). No pickle,
no header: the length says how many objects (an image with none stores b"").

`decode_boxes(data, num_classes)` checks what it reads (a shard is untrusted: it may not have
come from our ingest): a length that is a whole number of rows, finite coordinates, x2 > x1,
y2 > y1, integral class indices inside [0, num_classes), and at most `MAX_BOXES` rows.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from visionloop.core.errors import DataError

_ROW = np.dtype("<f4")
ROW_VALUES = 5
ROW_BYTES = ROW_VALUES * _ROW.itemsize
# COCO's most crowded image has under 100 objects; 10,000 bounds one record's decode.
MAX_BOXES = 10_000


def encode_boxes(boxes: npt.ArrayLike, labels: npt.ArrayLike) -> bytes:
    """(N, 4) xyxy pixels and (N,) 0-based class indices → the shard's bytes."""
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    lab = np.asarray(labels, dtype=np.int64).reshape(-1)
    if len(b) != len(lab):
        raise ValueError(f"{len(b)} boxes but {len(lab)} labels: one label per box")
    if len(b) > MAX_BOXES:
        raise ValueError(f"{len(b)} boxes in one image; at most {MAX_BOXES} are stored")
    rows = np.concatenate([b, lab[:, None].astype(np.float64)], axis=1).astype(_ROW)
    return rows.tobytes()


def decode_boxes(
    data: bytes, num_classes: int | None = None, *, where: str = "a shard record"
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """The shard's bytes → boxes (N, 4) float32 xyxy and labels (N,) int64, checked."""
    if len(data) % ROW_BYTES:
        raise DataError(
            f"{where} holds {len(data)} bytes of boxes, not a whole number of {ROW_BYTES}-byte rows; "
            "the dataset is damaged. Re-ingest it with `visionloop data ingest`."
        )
    n = len(data) // ROW_BYTES
    if n > MAX_BOXES:
        raise DataError(f"{where} holds {n} boxes, more than the {MAX_BOXES} one image may have")
    rows = np.frombuffer(data, dtype=_ROW).reshape(n, ROW_VALUES)
    boxes = np.array(rows[:, :4], dtype=np.float32)
    raw_labels = rows[:, 4]
    problem = None
    if not np.isfinite(rows).all():
        problem = "a coordinate or class that is not a finite number"
    elif n and not ((boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])).all():
        problem = "a box whose x2 <= x1 or y2 <= y1"
    elif n and (raw_labels != np.round(raw_labels)).any():
        problem = "a class index that is not a whole number"
    elif n and (raw_labels.min() < 0 or (num_classes is not None and raw_labels.max() >= num_classes)):
        problem = f"a class index outside [0, {num_classes})"
    if problem is not None:
        raise DataError(f"{where} holds {problem}; the dataset is damaged. Re-ingest it.")
    return boxes, raw_labels.astype(np.int64)
