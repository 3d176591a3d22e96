"""The served detector's answer (numpy only): NMS per class, the score threshold, boxes mapped
back to the image by the letterbox scale and clipped, counts, the log fields, and the shadow
agreement."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from visionloop.tasks.detection import answer
from visionloop.tasks.serving import AnswerOptions, ImageContext

NAMES = ["cat", "dog", "bird"]


def _outputs(rows: list[tuple[list[float], float, int]], k: int = 6, batch: int = 1) -> dict[str, np.ndarray]:
    """One image's rows (box, score, label), padded to k rows of score 0, repeated `batch` times."""
    boxes = np.zeros((batch, k, 4), np.float32)
    scores = np.zeros((batch, k), np.float32)
    labels = np.zeros((batch, k), np.int64)
    for i, (box, score, label) in enumerate(rows):
        boxes[:, i] = box
        scores[:, i] = score
        labels[:, i] = label
    return {"boxes": boxes, "scores": scores, "labels": labels}


def test_nms_suppresses_within_a_class_only() -> None:
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11], [0, 0, 10, 10], [20, 20, 30, 30]], np.float32)
    scores = np.array([0.9, 0.8, 0.7, 0.6], np.float32)
    # IoU of the first two: 81 / 119 = 0.68 > 0.5.
    assert answer.nms(boxes, scores, 0.5).tolist() == [0, 3]
    assert answer.nms(boxes, scores, 0.5, labels=np.array([0, 0, 1, 0])).tolist() == [0, 2, 3]
    # At IoU 0.7 the second box (0.68) stays; the third, the first's twin, still goes.
    assert answer.nms(boxes, scores, 0.7).tolist() == [0, 1, 3]
    assert answer.nms(np.zeros((0, 4)), np.zeros(0), 0.5).tolist() == []


def test_threshold_sort_cap_and_padding() -> None:
    out = _outputs(
        [
            ([0, 0, 10, 10], 0.3, 0),
            ([20, 0, 30, 10], 0.9, 1),
            ([40, 0, 50, 10], 0.2, 2),
            ([0, 20, 9, 30], 0.5, 0),
        ]
    )
    dets = answer.detections(out, NAMES, options=AnswerOptions(top_k=100))[0]
    # Default threshold 0.25: the 0.2 row and the padding rows are gone; best first.
    assert [(d["label"], d["score"]) for d in dets] == [
        ("dog", pytest.approx(0.9)),
        ("cat", pytest.approx(0.5)),
        ("cat", pytest.approx(0.3)),
    ]
    assert dets[0] == {
        "label": "dog",
        "index": 1,
        "score": pytest.approx(0.9),
        "box": [20.0, 0.0, 30.0, 10.0],
    }
    low = answer.detections(out, NAMES, options=AnswerOptions(top_k=100, score_threshold=0.0))[0]
    assert len(low) == 4  # threshold 0 still drops the six-minus-four padding rows (score 0)
    high = answer.detections(out, NAMES, options=AnswerOptions(top_k=100, score_threshold=0.6))[0]
    assert [d["index"] for d in high] == [1]
    capped = answer.detections(out, NAMES, options=AnswerOptions(top_k=2))[0]
    assert [d["score"] for d in capped] == pytest.approx([0.9, 0.5])


def test_boxes_map_back_to_the_image_by_the_letterbox_scale_and_are_clipped() -> None:
    # A 200 x 100 (w x h) image letterboxed into 64 x 64: scale 64 / 200 = 0.32.
    image = ImageContext(width=200, height=100, input_height=64, input_width=64)
    out = _outputs(
        [
            ([3.2, 6.4, 32.0, 16.0], 0.9, 0),  # → (10, 20, 100, 50)
            ([48.0, 20.0, 70.0, 40.0], 0.8, 1),  # x2 past the input: clipped to the image's 200
            ([10.0, 40.0, 20.0, 60.0], 0.7, 2),  # in the padding below the image: y clipped to 100 → empty
        ]
    )
    dets = answer.detections(out, NAMES, options=AnswerOptions(top_k=10), image=image)[0]
    assert [d["box"] for d in dets] == [
        pytest.approx([10.0, 20.0, 100.0, 50.0]),
        pytest.approx([150.0, 62.5, 200.0, 100.0]),
    ]
    # Without the image, boxes stay in input pixels.
    raw = answer.detections(out, NAMES, options=AnswerOptions(top_k=10))[0]
    assert raw[0]["box"] == pytest.approx([3.2, 6.4, 32.0, 16.0])
    assert len(raw) == 3


def test_served_counts_log_fields_and_batches() -> None:
    out = _outputs([([0, 0, 10, 10], 0.9, 0), ([20, 0, 30, 10], 0.8, 0), ([40, 0, 50, 10], 0.7, 2)], batch=2)
    out["scores"][1] = 0.0
    out["scores"][1, 0] = 0.1
    body = answer.served({k: v[:1] for k, v in out.items()}, NAMES, options=AnswerOptions(top_k=100))
    assert body["counts"] == {"cat": 2, "bird": 1}
    assert len(body["detections"]) == 3
    fields = answer.log_fields(out, NAMES)
    assert fields == [
        {"detections": 3, "counts": {"cat": 2, "bird": 1}, "max_score": pytest.approx(0.9)},
        {"detections": 0, "counts": {}, "max_score": pytest.approx(0.1)},
    ]
    assert [len(d) for d in answer.detections(out, NAMES, options=AnswerOptions(top_k=100))] == [3, 0]


def test_agreement_pairs_detections_one_to_one() -> None:
    a = _outputs([([0, 0, 10, 10], 0.9, 0), ([20, 0, 30, 10], 0.8, 1)], batch=4)
    b = {k: v.copy() for k, v in a.items()}
    b["boxes"][1, 0] = [1, 1, 11, 11]  # IoU 0.68 with a's: still the same detection
    b["labels"][2, 1] = 2  # another class
    b["scores"][3, 1] = 0.1  # below the threshold: one detection fewer
    assert answer.agreement(a, b).tolist() == [True, True, False, False]
    b["boxes"][1, 0] = [5, 5, 15, 15]  # IoU 25 / 175: a different detection
    assert answer.agreement(a, b).tolist()[1] is False
    # Two boxes of a cannot both pair with the same box of b.
    assert not answer.match_one_to_one(
        np.array([[0, 0, 10, 10], [0, 0, 10, 10]]),
        np.array([0, 0]),
        np.array([[0, 0, 10, 10], [50, 50, 60, 60]]),
        np.array([0, 0]),
        0.5,
    )


def test_the_answer_module_imports_no_torch() -> None:
    code = "import sys, visionloop.tasks.detection.answer; print('torch' in sys.modules)"
    assert (
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "False"
    )
