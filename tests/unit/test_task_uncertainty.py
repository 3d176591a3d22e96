"""`Task.uncertainty_inputs`: what label selection reads from a batch of served outputs."""

from __future__ import annotations

import numpy as np

from visionloop.tasks import get_task


def test_a_classifier_gives_its_softmax_and_top_class() -> None:
    logits = np.array([[2.0, 0.0, 0.0], [0.0, 0.0, 0.0], [-1.0, 3.0, 1.0]], dtype=np.float32)
    u = get_task("classification").uncertainty_inputs({"logits": logits}, ["a", "b", "c"])
    assert u is not None and u.probabilities is not None and u.classes is not None and u.box_scores is None
    e = np.exp(logits.astype(np.float64))
    np.testing.assert_allclose(u.probabilities, e / e.sum(axis=1, keepdims=True), rtol=1e-12)
    assert u.classes.tolist() == [0, 0, 1]  # a tie goes to the first class, as argmax does


def test_a_detector_gives_each_images_box_scores_after_nms_above_the_floor() -> None:
    boxes = np.zeros((2, 5, 4), dtype=np.float32)
    scores = np.zeros((2, 5), dtype=np.float32)
    labels = np.zeros((2, 5), dtype=np.int64)
    # Image 0: two boxes on the same object (NMS keeps the better), one elsewhere, one under
    # the floor, one padding row (score 0).
    boxes[0, :4] = [
        [0.0, 0.0, 10.0, 10.0],
        [0.0, 0.0, 10.0, 10.5],
        [20.0, 20.0, 30.0, 30.0],
        [40.0, 40.0, 50.0, 50.0],
    ]
    scores[0, :4] = [0.9, 0.6, 0.3, 0.01]
    # Image 1: nothing but padding.
    u = get_task("detection").uncertainty_inputs(
        {"boxes": boxes, "scores": scores, "labels": labels}, ["thing"]
    )
    assert u is not None and u.box_scores is not None and u.probabilities is None and u.classes is None
    assert [s.tolist() for s in u.box_scores] == [[np.float32(0.9), np.float32(0.3)], []]
