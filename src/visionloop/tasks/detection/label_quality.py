"""Likely label errors of a detection dataset: cleanlab's object detection module (ObjectLab)
over out-of-fold predicted boxes.

Each image's given boxes and its out-of-fold predictions (from a detector that never trained on
it) go to cleanlab in its format: labels as `{"bboxes": (L, 4), "labels": (L,)}`, predictions
as one `(M, 5)` array `[x1, y1, x2, y2, score]` per class. cleanlab flags an image when any of
its boxes looks overlooked, swapped or badly located, against per-class thresholds scaled by
the class's average precision on the same predictions. The image's flag comes from cleanlab's
`find_label_issues` itself; which of its boxes made it so is decided the same way
`find_label_issues` decides it internally (its per-box scores against the same thresholds), so
the boxes listed always account for the flag. Those internals are private to cleanlab: the
version is pinned below 3 in pyproject.toml, and the tests run them.

Boxes are scaled back from the letterboxed evaluation frame (top-left anchored, scale only) to
the stored image's pixels. Crowd and difficult boxes (`iscrowd`) are left out of the labels, and
the predictions on them out of the predictions, as COCO evaluation ignores both.

cleanlab reads a predicted box's score as the probability that it is an object of its class,
and its thresholds are absolute (overlooked and swapped boxes are looked for only among
predictions of at least 0.95, badly located among those of at least 0.5). A heatmap detector's
peak scores are not such probabilities (the native detector's sit far below 0.95 on boxes that
are right), so by default (`calibrate=True`) each class's scores are first mapped through an
isotonic fit of whether the predicted box matches a given box of its class (IoU >= 0.5), on
the same out-of-fold predictions (`calibrate_scores`). The map is monotone, so it only moves
scores onto cleanlab's scale; BENCHMARKS.md ("Label errors in a detection dataset") measures
both.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from visionloop.tasks.label_issues import Box, FindingKind, ImageLabelIssue, LabelFinding, summarize

# A predicted box weaker than this is not named as the model's suggestion for a given box.
_SUGGEST_MIN_SCORE = 0.3
# A predicted box counts as right, for the calibration, where it overlaps a given box of its
# class this much (IoU): COCO's mAP50 criterion.
CALIBRATION_IOU = 0.5
# A prediction this much inside a crowd region is a prediction of the crowd (COCO: IoU 0.5 over
# the detection's area), ignored like the region.
_CROWD_COVER = 0.5


def _as_cleanlab(
    results: Sequence[tuple[Any, Any]], n_classes: int
) -> tuple[list[dict[str, Any]], list[npt.NDArray[Any]]]:
    labels: list[dict[str, Any]] = []
    predictions: list[npt.NDArray[Any]] = []
    for outputs, targets in results:
        d, t = outputs[0], targets[0]
        scale = float(t["scale"]) or 1.0
        keep = ~np.asarray(t["iscrowd"], dtype=bool)
        labels.append(
            {
                "bboxes": np.asarray(t["boxes"], dtype=np.float64).reshape(-1, 4)[keep] / scale,
                "labels": np.asarray(t["labels"], dtype=np.int64).reshape(-1)[keep],
            }
        )
        boxes = np.asarray(d["boxes"], dtype=np.float64).reshape(-1, 4) / scale
        scores = np.asarray(d["scores"], dtype=np.float64).reshape(-1)
        classes = np.asarray(d["labels"], dtype=np.int64).reshape(-1)
        crowd = np.asarray(t["boxes"], dtype=np.float64).reshape(-1, 4)[~keep] / scale
        if len(crowd) and len(boxes):
            # COCO evaluation matches a prediction on a crowd region to it and ignores both.
            on_crowd = _inside(boxes, crowd).max(axis=1) >= _CROWD_COVER
            boxes, scores, classes = boxes[~on_crowd], scores[~on_crowd], classes[~on_crowd]
        per_class = np.empty(n_classes, dtype=object)
        for c in range(n_classes):
            m = classes == c
            per_class[c] = np.concatenate([boxes[m], scores[m, None]], axis=1).astype(np.float32)
        predictions.append(per_class)
    return labels, predictions


def _area(boxes: npt.NDArray[Any]) -> npt.NDArray[Any]:
    area: npt.NDArray[Any] = np.clip(boxes[:, 2] - boxes[:, 0], 0, None) * np.clip(
        boxes[:, 3] - boxes[:, 1], 0, None
    )
    return area


def _intersection(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """(M, L): the area each box of `a` shares with each box of `b` (xyxy)."""
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter: npt.NDArray[Any] = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    return inter


def _iou(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """(M, L): the IoU of each box of `a` with each box of `b` (xyxy)."""
    inter = _intersection(a, b)
    iou: npt.NDArray[Any] = inter / np.maximum(_area(a)[:, None] + _area(b)[None, :] - inter, 1e-9)
    return iou


def calibrate_scores(
    labels: Sequence[dict[str, Any]], predictions: Sequence[npt.NDArray[Any]], *, iou: float = CALIBRATION_IOU
) -> list[npt.NDArray[Any]]:
    """`predictions` (cleanlab's format) with each class's scores replaced by an estimate of
    P(the box is an object of that class): an isotonic (monotone, non-decreasing) fit, per
    class over every image, of whether each predicted box overlaps a given box of the same
    class by IoU >= `iou`. A class with no prediction is left as it is. The given labels hold
    the errors being looked for, but a few wrong labels among many only lower the estimates a
    little. The arrays passed in are not changed."""
    from sklearn.isotonic import IsotonicRegression

    n_classes = len(predictions[0]) if predictions else 0
    scores: list[list[npt.NDArray[Any]]] = [[] for _ in range(n_classes)]
    hits: list[list[npt.NDArray[Any]]] = [[] for _ in range(n_classes)]
    for lab, pred in zip(labels, predictions, strict=True):
        for c in range(n_classes):
            p = np.asarray(pred[c], dtype=np.float64).reshape(-1, 5)
            given = np.asarray(lab["bboxes"], dtype=np.float64).reshape(-1, 4)[np.asarray(lab["labels"]) == c]
            hit = np.zeros(len(p), dtype=bool)
            if len(given):
                hit = np.asarray((_iou(p[:, :4], given) >= iou).any(axis=1), dtype=bool)
            scores[c].append(p[:, 4])
            hits[c].append(hit)
    maps: list[IsotonicRegression | None] = []
    for c in range(n_classes):
        x, y = np.concatenate(scores[c]), np.concatenate(hits[c]).astype(np.float64)
        fit = IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip")
        maps.append(fit.fit(x, y) if len(x) else None)
    out: list[npt.NDArray[Any]] = []
    for pred in predictions:
        per_class = np.empty(n_classes, dtype=object)
        for c in range(n_classes):
            q = np.array(pred[c], dtype=np.float32).reshape(-1, 5)
            fit = maps[c]
            if fit is not None and len(q):
                q[:, 4] = fit.predict(q[:, 4].astype(np.float64))
            per_class[c] = q
        out.append(per_class)
    return out


def _inside(boxes: npt.NDArray[Any], regions: npt.NDArray[Any]) -> npt.NDArray[Any]:
    """(M, R): the share of each box's area inside each region (COCO's IoU against a crowd
    region is measured over the detection's own area)."""
    share: npt.NDArray[Any] = _intersection(boxes, regions) / np.maximum(_area(boxes)[:, None], 1e-9)
    return share


def _box(row: npt.NDArray[Any]) -> Box:
    return (
        round(float(row[0]), 2),
        round(float(row[1]), 2),
        round(float(row[2]), 2),
        round(float(row[3]), 2),
    )


def _per_box_flags(
    labels: list[dict[str, Any]], predictions: list[npt.NDArray[Any]]
) -> tuple[list[dict[str, Any]], dict[str, tuple[list[npt.NDArray[Any]], list[npt.NDArray[Any]]]]]:
    """cleanlab's per-box (scores, is-issue) for each kind, as `_find_label_issues` computes
    them: overlooked per predicted box, badly located and swapped per given box."""
    from cleanlab.internal.constants import (
        ALPHA,
        BADLOC_THRESHOLD_FACTOR,
        HIGH_PROBABILITY_THRESHOLD,
        LOW_PROBABILITY_THRESHOLD,
        OVERLOOKED_THRESHOLD_FACTOR,
        SWAP_THRESHOLD_FACTOR,
    )
    from cleanlab.object_detection import filter as clf
    from cleanlab.object_detection import rank

    aux = rank._get_valid_inputs_for_compute_scores(ALPHA, labels, predictions)
    per_class_ap = clf._get_per_class_ap(labels, predictions)
    pred_thresholds = clf._process_class_list([a["pred_labels"] for a in aux], per_class_ap)
    lab_thresholds = clf._process_class_list([a["lab_labels"] for a in aux], per_class_ap)
    over = rank.compute_overlooked_box_scores(
        alpha=ALPHA, high_probability_threshold=HIGH_PROBABILITY_THRESHOLD, auxiliary_inputs=aux
    )
    badloc = rank.compute_badloc_box_scores(
        alpha=ALPHA, low_probability_threshold=LOW_PROBABILITY_THRESHOLD, auxiliary_inputs=aux
    )
    swap = rank.compute_swap_box_scores(
        alpha=ALPHA,
        high_probability_threshold=HIGH_PROBABILITY_THRESHOLD,
        overlapping_label_check=True,
        auxiliary_inputs=aux,
    )

    def issues(scores: list[npt.NDArray[Any]], thresholds: Any, factor: float) -> list[npt.NDArray[Any]]:
        # `_find_label_issues_per_box` sets NaN scores to 1 in place: it gets copies.
        return clf._find_label_issues_per_box([s.copy() for s in scores], thresholds, factor)  # type: ignore[no-any-return]

    flags = {
        "overlooked": (over, issues(over, pred_thresholds, OVERLOOKED_THRESHOLD_FACTOR)),
        "badly located": (badloc, issues(badloc, lab_thresholds, BADLOC_THRESHOLD_FACTOR)),
        "swapped": (swap, issues(swap, lab_thresholds, SWAP_THRESHOLD_FACTOR)),
    }
    return aux, flags


def _best_match(aux: dict[str, Any], given: int) -> int | None:
    """The predicted box that overlaps given box `given` most among those the model is fairly
    sure of; None when none overlaps it."""
    iou = np.asarray(aux["iou_matrix"])
    if iou.size == 0:
        return None
    row = np.where(np.asarray(aux["pred_label_probs"]) >= _SUGGEST_MIN_SCORE, iou[given], 0.0)
    j = int(row.argmax())
    return j if row[j] > 0 else None


def _findings(
    aux: dict[str, Any], flags: dict[str, Any], i: int, names: Sequence[str], *, worst_only: bool = False
) -> list[LabelFinding]:
    """Image `i`'s boxes that cleanlab's thresholds flag, least likely first; with
    `worst_only` (an image in a review budget that no threshold flags), the one box whose
    score is lowest of any kind: where a reviewer should look first."""
    out: list[LabelFinding] = []
    lab_boxes, lab_labels = aux["lab_bboxes"], aux["lab_labels"]
    pred_boxes, pred_labels = aux["pred_bboxes"], aux["pred_labels"]

    def chosen(kind: str) -> list[int]:
        scores, issues = flags[kind]
        if worst_only:
            return list(range(len(scores[i])))
        return [int(b) for b in np.flatnonzero(issues[i][: len(scores[i])])]

    def score(kind: str, b: int) -> float:
        return round(float(np.nan_to_num(flags[kind][0][i][b], nan=1.0)), 6)

    kind: FindingKind
    for kind in ("swapped", "badly located"):
        for b in chosen(kind):
            match = _best_match(aux, b)
            out.append(
                LabelFinding(
                    kind=kind,
                    given=names[int(lab_labels[b])],
                    suggested=names[int(pred_labels[match])] if match is not None else None,
                    score=score(kind, b),
                    given_box=_box(lab_boxes[b]),
                    suggested_box=_box(pred_boxes[match]) if match is not None else None,
                )
            )
    for p in chosen("overlooked"):
        out.append(
            LabelFinding(
                kind="overlooked",
                given=None,
                suggested=names[int(pred_labels[p])],
                score=score("overlooked", p),
                suggested_box=_box(pred_boxes[p]),
            )
        )
    out.sort(key=lambda f: f.score)
    return out[:1] if worst_only else out


def find_label_issues(
    results: Sequence[tuple[Any, Any]],
    class_names: Sequence[str],
    *,
    top: int | None = None,
    calibrate: bool = True,
) -> list[ImageLabelIssue]:
    """The flagged images of `results` (one-image (outputs, targets) pairs, out of fold),
    lowest label quality first, each with its suspicious boxes; with `top`, the `top` images
    of lowest label quality instead, flagged or not (a review budget: on planted errors the
    ranking finds many more of them than the flags do, BENCHMARKS.md), an unflagged one with
    its least likely box. `calibrate`: the scores go through `calibrate_scores` first (the
    module's docstring says why)."""
    from cleanlab.object_detection.filter import find_label_issues as cl_find
    from cleanlab.object_detection.rank import get_label_quality_scores

    if not results:
        return []
    names = list(class_names)
    labels, predictions = _as_cleanlab(results, len(names))
    if calibrate:
        predictions = calibrate_scores(labels, predictions)
    # cleanlab prints its pruning to stdout, which is the CLI's (and `--json`'s): kept apart.
    with contextlib.redirect_stdout(io.StringIO()):
        # The mask, ranked here: cleanlab 2.9's own ranking calls `np.in1d`, gone in NumPy 2.4.
        flagged = np.asarray(cl_find(labels, predictions, return_indices_ranked_by_score=False))
        if top is None and not flagged.any():
            return []
        quality = np.asarray(get_label_quality_scores(labels, predictions))
        aux, flags = _per_box_flags(labels, predictions)
    chosen = np.flatnonzero(flagged) if top is None else np.arange(len(results))
    ranked = sorted(chosen, key=lambda k: (quality[k], k))[: len(chosen) if top is None else top]
    issues = []
    for i in (int(k) for k in ranked):
        given = summarize([names[int(c)] for c in aux[i]["lab_labels"]])
        sure = np.asarray(aux[i]["pred_label_probs"]) >= _SUGGEST_MIN_SCORE
        suggested = summarize([names[int(c)] for c in np.asarray(aux[i]["pred_labels"])[sure]])
        issues.append(
            ImageLabelIssue(
                item=i,
                quality=round(float(quality[i]), 6),
                given=given,
                suggested=suggested,
                findings=tuple(_findings(aux[i], flags, i, names, worst_only=not flagged[i])),
            )
        )
    return issues
