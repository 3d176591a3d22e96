"""The tasks' label judges (`Task.find_label_issues`) on out-of-fold results built by hand:
each planted mistake is found, with its kind and both labels, and nothing else is; boxes come
back in the stored image's pixels. cleanlab runs for real."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from visionloop.tasks import get_task
from visionloop.tasks.label_issues import summarize

NAMES = ["cat", "dog"]
SCALE = 2.0  # the letterbox scale of every image: results are in the scaled frame


def _scene(rng: np.random.Generator) -> tuple[list[list[float]], list[int]]:
    boxes, labels = [], []
    for _ in range(int(rng.integers(1, 3))):
        x, y, w = rng.uniform(0, 60), rng.uniform(0, 60), rng.uniform(15, 30)
        boxes.append([x, y, x + w, y + w])
        labels.append(int(rng.integers(0, 2)))
    return boxes, labels


def _result(
    pred: tuple[list[list[float]], list[int]], given: tuple[list[list[float]], list[int]], crowd: int = 0
) -> tuple[Any, Any]:
    pb, pl = pred
    gb, gl = given
    outputs = [
        {
            "boxes": torch.tensor(pb, dtype=torch.float32).reshape(-1, 4) * SCALE,
            "scores": torch.full((len(pl),), 0.99),
            "labels": torch.tensor(pl, dtype=torch.int64),
        }
    ]
    iscrowd = torch.zeros(len(gl), dtype=torch.bool)
    iscrowd[len(gl) - crowd :] = crowd > 0
    targets = [
        {
            "boxes": torch.tensor(gb, dtype=torch.float32).reshape(-1, 4) * SCALE,
            "labels": torch.tensor(gl, dtype=torch.int64),
            "iscrowd": iscrowd,
            "scale": SCALE,
            "image_id": 0,
            "orig_size": (100, 100),
        }
    ]
    return outputs, targets


def _dataset(plant: bool) -> tuple[list[tuple[Any, Any]], dict[int, str], dict[int, Any]]:
    """60 images whose predictions match their labels (0.5 px of noise, score 0.99), with
    (when `plant`) one swapped image, one with an unlabelled object and one with a box moved."""
    rng = np.random.default_rng(0)
    results, planted, scenes = [], {}, {}
    for i in range(60):
        boxes, labels = _scene(rng)
        noisy = (np.asarray(boxes) + rng.normal(0, 0.5, (len(boxes), 4))).tolist()
        scenes[i] = (boxes, labels)
        given_boxes, given_labels = boxes, labels
        if plant and i == 5:
            given_labels = [1 - c for c in labels]
            planted[i] = "swapped"
        if plant and i == 11:
            boxes.append([70.0, 10.0, 95.0, 35.0])
            labels.append(0)
            noisy.append([70.2, 10.1, 94.8, 35.3])
            given_boxes, given_labels = boxes[:-1], labels[:-1]
            planted[i] = "overlooked"
        if plant and i == 17:
            given_boxes = [[v + 12.0 for v in boxes[0]], *boxes[1:]]
            planted[i] = "badly located"
        results.append(_result((noisy, labels), (given_boxes, given_labels)))
    return results, planted, scenes


def test_each_planted_box_mistake_is_found_with_its_kind_and_both_labels() -> None:
    results, planted, scenes = _dataset(plant=True)
    issues = get_task("detection").find_label_issues(results, NAMES)
    assert {i.item: {f.kind for f in i.findings} for i in issues} == {k: {v} for k, v in planted.items()}
    assert [i.quality for i in issues] == sorted(i.quality for i in issues)  # least likely first
    by_item = {i.item: i for i in issues}

    swapped = by_item[5]
    boxes, labels = scenes[5]
    assert swapped.given == summarize([NAMES[1 - c] for c in labels])
    assert swapped.suggested == summarize([NAMES[c] for c in labels])
    for f in swapped.findings:  # every box of the image, each with the other class suggested
        assert f.given is not None and f.suggested == NAMES[1 - NAMES.index(f.given)]
        assert f.given_box is not None and f.suggested_box is not None
        assert min(np.abs(np.asarray(f.given_box) - np.asarray(b)).max() for b in boxes) < 0.01
    assert len(swapped.findings) == len(labels)

    (overlooked,) = by_item[11].findings
    assert overlooked.given is None and overlooked.given_box is None and overlooked.suggested == "cat"
    assert overlooked.suggested_box is not None
    # In the stored image's pixels (the results were in a frame twice as large).
    assert np.allclose(overlooked.suggested_box, (70.2, 10.1, 94.8, 35.3), atol=0.01)

    (moved,) = by_item[17].findings
    true_box = scenes[17][0][0]
    assert moved.given == moved.suggested == NAMES[scenes[17][1][0]]
    assert moved.given_box is not None and moved.suggested_box is not None
    assert np.allclose(moved.given_box, [v + 12.0 for v in true_box], atol=0.01)
    assert np.allclose(moved.suggested_box, true_box, atol=2.0)  # the prediction, 0.5 px noise
    for issue in issues:
        assert all(0.0 <= f.score <= 1.0 for f in issue.findings) and 0.0 <= issue.quality <= 1.0


def test_labels_that_agree_with_confident_predictions_are_not_flagged() -> None:
    results, planted, _ = _dataset(plant=False)
    assert planted == {} and get_task("detection").find_label_issues(results, NAMES) == []
    assert get_task("detection").find_label_issues([], NAMES) == []


def test_a_crowd_box_is_not_judged() -> None:
    """A crowd (ignored) region is neither a given label nor a place where the model may
    overlook an object: evaluation ignores both the box and the predictions on it, and so does
    the judge. The same box not marked crowd is a swapped label."""
    results, _, _ = _dataset(plant=False)
    pred = ([[10.0, 10.0, 40.0, 40.0], [50.5, 50.0, 89.5, 90.0]], [0, 0])
    given = ([[10.0, 10.0, 40.0, 40.0], [50.0, 50.0, 90.0, 90.0]], [0, 1])
    results[3] = _result(pred, given, crowd=1)
    assert get_task("detection").find_label_issues(results, NAMES) == []
    results[3] = _result(pred, given)
    (issue,) = get_task("detection").find_label_issues(results, NAMES)
    found = [(f.kind, f.given, f.suggested) for f in issue.findings]
    assert issue.item == 3 and found == [("swapped", "dog", "cat")]


def test_the_classification_judge_names_the_flipped_labels() -> None:
    rng = np.random.default_rng(1)
    y = rng.integers(0, 3, 90)
    logits = np.eye(3)[y] * 6.0 + rng.normal(0, 0.3, (90, 3))
    given = y.copy()
    flipped = sorted(int(np.flatnonzero(y == c)[3]) for c in range(3))  # one of each class: 0->1, 1->2, 2->0
    for i in flipped:
        given[i] = (y[i] + 1) % 3
    names = ["a", "b", "c", "unused"]  # a class with no image: renumbered away
    pad = np.full((90, 1), -9.0)
    results = [
        (torch.tensor(np.hstack([logits, pad])[i : i + 1]), torch.tensor(given[i : i + 1])) for i in range(90)
    ]
    issues = get_task("classification").find_label_issues(results, names)
    assert sorted(i.item for i in issues) == flipped
    for issue in issues:
        assert issue.given == names[given[issue.item]] and issue.suggested == names[y[issue.item]]
        (f,) = issue.findings
        assert f.kind == "wrong class" and f.score == issue.quality < 0.05


@pytest.mark.parametrize("task", ["classification", "detection"])
def test_every_task_has_a_judge(task: str) -> None:
    assert get_task(task).label_quality_module


def test_calibration_maps_each_class_scores_to_how_often_such_boxes_are_right() -> None:
    """`calibrate_scores`: per class, an isotonic fit of "this predicted box overlaps a given
    box of its class at IoU >= 0.5" on the scores. Class 0's boxes, by score: 0.1 wrong (no
    box there), 0.2 right, 0.3 wrong (IoU 0.4), 0.4 right, 0.5 right: pooled to 0, 0.5, 0.5,
    1, 1. Class 1 is predicted only on class-0 boxes: never right, 0. Class 2 has no
    prediction: left alone. Boxes are not moved and the input is not changed."""
    from visionloop.tasks.detection.label_quality import calibrate_scores

    def pred(*rows: tuple[int, list[float], float]) -> np.ndarray:
        per_class = np.empty(3, dtype=object)
        for c in range(3):
            per_class[c] = np.array([[*b, s] for k, b, s in rows if k == c], dtype=np.float32).reshape(-1, 5)
        return per_class

    labels = [
        {"bboxes": np.array([[0.0, 0.0, 10.0, 10.0]]), "labels": np.array([0])},
        {"bboxes": np.array([[20.0, 20.0, 40.0, 40.0]]), "labels": np.array([0])},
        {"bboxes": np.array([[0.0, 0.0, 10.0, 10.0]]), "labels": np.array([0])},
    ]
    predictions = [
        pred((0, [0, 0, 10, 10], 0.4), (0, [50, 50, 60, 60], 0.1), (1, [0, 0, 10, 10], 0.9)),
        pred((0, [21, 20, 40, 41], 0.2), (0, [20, 20, 40, 28], 0.3), (1, [20, 20, 40, 40], 0.6)),
        pred((0, [0, 0, 10, 10], 0.5)),
    ]
    out = calibrate_scores(labels, predictions)
    assert [out[i][0][:, 4].tolist() for i in range(3)] == [[1.0, 0.0], [0.5, 0.5], [1.0]]
    assert [out[i][1][:, 4].tolist() for i in range(3)] == [[0.0], [0.0], []]
    assert all(out[i][2].shape == (0, 5) for i in range(3))
    for i in range(3):
        for c in range(3):
            assert np.array_equal(out[i][c][:, :4], predictions[i][c][:, :4])
    assert predictions[0][0][:, 4].tolist() == pytest.approx([0.4, 0.1])  # not changed in place
    # Scores beyond those seen are clipped to the ends of the fit.
    out = calibrate_scores(labels[:1], [pred((0, [0, 0, 10, 10], 0.4), (0, [50, 50, 60, 60], 0.1))])
    assert out[0][0][:, 4].tolist() == [1.0, 0.0]


def test_a_review_budget_ranks_every_image_and_names_where_to_look_in_unflagged_ones() -> None:
    results, planted, _ = _dataset(plant=True)
    flagged = get_task("detection").find_label_issues(results, NAMES)
    budget = get_task("detection").find_label_issues(results, NAMES, top=6)
    assert len(budget) == 6 and [i.quality for i in budget] == sorted(i.quality for i in budget)
    assert {i.item for i in budget[:3]} == set(planted)  # the planted mistakes rank first
    assert [(i.item, i.findings) for i in budget[:3]] == [(i.item, i.findings) for i in flagged]
    for issue in budget[3:]:  # unflagged: their single least likely box, not a threshold's verdict
        assert issue.item not in planted and len(issue.findings) == 1
        assert issue.findings[0].score >= max(f.score for i in flagged for f in i.findings)
    clean, _, _ = _dataset(plant=False)
    assert len(get_task("detection").find_label_issues(clean, NAMES, top=4)) == 4


def test_a_classifiers_review_budget_puts_the_flips_first() -> None:
    rng = np.random.default_rng(1)
    y = rng.integers(0, 3, 90)
    logits = np.eye(3)[y] * 6.0 + rng.normal(0, 0.3, (90, 3))
    given = y.copy()
    flipped = sorted(int(np.flatnonzero(y == c)[3]) for c in range(3))
    for i in flipped:
        given[i] = (y[i] + 1) % 3
    results = [(torch.tensor(logits[i : i + 1]), torch.tensor(given[i : i + 1])) for i in range(90)]
    budget = get_task("classification").find_label_issues(results, ["a", "b", "c"], top=5)
    assert len(budget) == 5 and sorted(i.item for i in budget[:3]) == flipped
    assert [i.quality for i in budget] == sorted(i.quality for i in budget)
    assert all(i.given == i.suggested for i in budget[3:])  # right labels, merely the least sure
