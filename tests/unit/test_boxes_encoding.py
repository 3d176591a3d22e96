"""The shard encoding of a detection record's boxes (`tasks.detection.boxes`): the five-column
layout every dataset without ignored boxes keeps byte for byte, the flagged layout that
carries COCO's iscrowd / VOC's difficult, and the checks a decoder makes on untrusted bytes."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from visionloop.core.errors import DataError
from visionloop.tasks.detection.boxes import (
    FLAGGED_MAGIC,
    FLAGGED_ROW_BYTES,
    MAX_BOXES,
    ROW_BYTES,
    decode_boxes,
    encode_boxes,
)

BOXES = [[1.5, 2.0, 30.25, 40.0], [0.0, 0.0, 5.0, 6.0], [10.0, 10.0, 11.0, 12.0]]
LABELS = [2, 0, 1]


def test_without_an_ignored_box_the_bytes_are_the_five_column_rows() -> None:
    # Written out by hand: what every dataset ingested before the flag holds, and its version hashes.
    expected = b"".join(struct.pack("<5f", *box, label) for box, label in zip(BOXES, LABELS, strict=True))
    assert encode_boxes(BOXES, LABELS) == expected
    assert encode_boxes(BOXES, LABELS, [False, False, False]) == expected
    assert len(expected) == 3 * ROW_BYTES
    boxes, labels, ignore = decode_boxes(expected, 3)
    np.testing.assert_array_equal(boxes, np.asarray(BOXES, dtype=np.float32))
    assert labels.tolist() == LABELS and ignore.tolist() == [False, False, False]
    assert boxes.dtype == np.float32 and labels.dtype == np.int64 and ignore.dtype == np.bool_
    empty = decode_boxes(encode_boxes(np.zeros((0, 4)), [], []), 3)
    assert encode_boxes(np.zeros((0, 4)), []) == b""
    assert empty[0].shape == (0, 4) and empty[1].shape == (0,) and empty[2].shape == (0,)


def test_an_ignored_box_switches_to_the_flagged_layout_and_round_trips() -> None:
    data = encode_boxes(BOXES, LABELS, [False, True, False])
    flagged_rows = [(*box, label, flag) for box, label, flag in zip(BOXES, LABELS, (0, 1, 0), strict=True)]
    assert data == FLAGGED_MAGIC + b"".join(struct.pack("<6f", *row) for row in flagged_rows)
    assert len(data) == len(FLAGGED_MAGIC) + 3 * FLAGGED_ROW_BYTES
    # The magic is a float32 NaN: no valid five-column record starts with it.
    assert np.isnan(np.frombuffer(FLAGGED_MAGIC, dtype="<f4")[0])
    boxes, labels, ignore = decode_boxes(data, 3)
    np.testing.assert_array_equal(boxes, np.asarray(BOXES, dtype=np.float32))
    assert labels.tolist() == LABELS and ignore.tolist() == [False, True, False]
    # 4 + 24 * 5 == 124 bytes is no multiple of 20, but 4 + 24 * 4 == 100 is: the magic decides.
    four = encode_boxes([*BOXES, [1.0, 1, 2, 2]], [*LABELS, 0], [True, False, False, False])
    assert len(four) % ROW_BYTES == 0
    assert decode_boxes(four, 3)[2].tolist() == [True, False, False, False]


def _flagged(*rows: tuple[float, ...]) -> bytes:
    return FLAGGED_MAGIC + b"".join(struct.pack("<6f", *row) for row in rows)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            _flagged((0, 0, 5, 5, 0, 1))[:-4],
            "not a whole number of 24-byte rows after the ignore-flag header",
        ),
        (_flagged((0, 0, 5, 5, 0, 0.5)), "an ignore flag that is neither 0 nor 1"),
        (_flagged((0, 0, 5, 5, 0, 2)), "an ignore flag that is neither 0 nor 1"),
        (_flagged((0, 0, 5, 5, 0, float("nan"))), "not a finite number"),
        (_flagged((0, 0, 5, 5, 0, 1), (5, 5, 1, 9, 0, 0)), "x2 <= x1"),
        (_flagged((0, 0, 5, 5, 1.5, 1)), "not a whole number"),
        (_flagged((0, 0, 5, 5, 3, 1)), r"outside \[0, 3\)"),
        (_flagged((0, 0, 5, 5, -1, 1)), r"outside \[0, 3\)"),
        (struct.pack("<5f", 0, 0, 5, 5, 0)[:-1], "not a whole number of 20-byte rows"),
        (struct.pack("<5f", float("nan"), 0, 5, 5, 0), "not a finite number"),
        (struct.pack("<5f", 0, 0, 5, 5, 7), r"outside \[0, 3\)"),
    ],
    ids=[
        "truncated",
        "half-flag",
        "flag-2",
        "nan-flag",
        "inverted",
        "fractional-class",
        "class-too-big",
        "negative-class",
        "old-truncated",
        "old-nan",
        "old-class",
    ],
)
def test_damaged_bytes_are_refused(data: bytes, message: str) -> None:
    with pytest.raises(DataError, match=message):
        decode_boxes(data, 3, where="record 7")


def test_too_many_boxes_are_refused_in_both_layouts() -> None:
    row = struct.pack("<6f", 0, 0, 5, 5, 0, 1)
    with pytest.raises(DataError, match=f"more than the {MAX_BOXES}"):
        decode_boxes(FLAGGED_MAGIC + row * (MAX_BOXES + 1))
    with pytest.raises(DataError, match=f"more than the {MAX_BOXES}"):
        decode_boxes(struct.pack("<5f", 0, 0, 5, 5, 0) * (MAX_BOXES + 1))
    with pytest.raises(ValueError, match="one flag per box"):
        encode_boxes(BOXES, LABELS, [True])
