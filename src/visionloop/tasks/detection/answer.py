"""What a served detector answers, what its prediction log records, and how two detectors'
answers are compared (shadow): numpy only (the inference server runs without torch).

The exported detector's outputs (fixed shapes, so they batch): "boxes" (B, K, 4) float32 xyxy
in letterboxed-input pixels, "scores" (B, K) float32, "labels" (B, K) int64 0-based class
indices; rows past the model's detections are padding with score 0. Non-maximum suppression
is not in the graph: per image, `detections` keeps the rows scoring at least the threshold
(padding never counts), maps their boxes to the image as sent (divided by the letterbox
scale, clipped to the image; degenerate boxes dropped), suppresses per class at IoU 0.5 and
returns the best `top_k`, best first.

Defaults: a score threshold of 0.25 when the client gives none (`AnswerOptions.score_threshold`
None), the common choice for served detectors (YOLO's `conf=0.25`); the evaluators see every
row instead, since mAP needs the low-scoring ones. `top_k` caps the detections of one image
(`MAX_DETECTIONS`, 100, is the largest K the exported models give, so a cap of 100 returns
every detection).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from visionloop.models.card import letterbox_scale
from visionloop.tasks.drift_outputs import DriftOutputs, UncertaintyInputs
from visionloop.tasks.serving import Answer, AnswerOptions, Arrays, ImageContext

DEFAULT_SCORE_THRESHOLD = 0.25
NMS_IOU = 0.5
# Two detectors agree on an image when their detections pair up one to one at this IoU.
AGREEMENT_IOU = 0.5
MAX_DETECTIONS = 100
OUTPUT_NAMES = ("boxes", "scores", "labels")


def nms(
    boxes: npt.NDArray[Any], scores: npt.NDArray[Any], iou: float, labels: Any = None
) -> npt.NDArray[np.int64]:
    """Greedy non-maximum suppression: the indices kept, best score first (ties in index
    order). With `labels`, boxes of different classes never suppress each other (each class
    is shifted to its own region of the plane, torchvision's `batched_nms` trick)."""
    b = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if len(b) == 0:
        return np.zeros(0, dtype=np.int64)
    if labels is not None:
        lab = np.asarray(labels, dtype=np.float64).reshape(-1)
        # Offsets larger than any box's extent, so shifted classes can never overlap.
        span = float(np.abs(b).max()) * 2.0 + 1.0
        b = b + (lab * span)[:, None]
    x1, y1, x2, y2 = b[:, 0], b[:, 1], b[:, 2], b[:, 3]
    area = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    order = np.argsort(-s, kind="stable")
    keep: list[int] = []
    while order.size:
        i = int(order[0])
        keep.append(i)
        rest = order[1:]
        w = np.clip(np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]), 0, None)
        h = np.clip(np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]), 0, None)
        inter = w * h
        union = area[i] + area[rest] - inter
        overlap = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
        order = rest[overlap <= iou]
    return np.asarray(keep, dtype=np.int64)


def iou_matrix(a: npt.NDArray[Any], b: npt.NDArray[Any]) -> npt.NDArray[np.float64]:
    """Pairwise IoU of xyxy boxes a (N, 4) and b (M, 4): (N, M)."""
    a = np.asarray(a, dtype=np.float64).reshape(-1, 4)
    b = np.asarray(b, dtype=np.float64).reshape(-1, 4)
    w = np.clip(np.minimum(a[:, None, 2], b[None, :, 2]) - np.maximum(a[:, None, 0], b[None, :, 0]), 0, None)
    h = np.clip(np.minimum(a[:, None, 3], b[None, :, 3]) - np.maximum(a[:, None, 1], b[None, :, 1]), 0, None)
    inter = w * h
    area_a = np.clip(a[:, 2] - a[:, 0], 0, None) * np.clip(a[:, 3] - a[:, 1], 0, None)
    area_b = np.clip(b[:, 2] - b[:, 0], 0, None) * np.clip(b[:, 3] - b[:, 1], 0, None)
    union = area_a[:, None] + area_b[None, :] - inter
    out: npt.NDArray[np.float64] = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
    return out


def _arrays(outputs: Arrays) -> tuple[npt.NDArray[Any], npt.NDArray[Any], npt.NDArray[Any]]:
    missing = [n for n in OUTPUT_NAMES if n not in outputs]
    if missing:
        raise KeyError(f"a detector's outputs are {list(OUTPUT_NAMES)}; missing {missing}")
    boxes = np.asarray(outputs["boxes"], dtype=np.float32)
    scores = np.asarray(outputs["scores"], dtype=np.float32)
    labels = np.asarray(outputs["labels"]).astype(np.int64, copy=False)
    return boxes, scores, labels


def _kept(
    boxes: npt.NDArray[Any],
    scores: npt.NDArray[Any],
    labels: npt.NDArray[Any],
    threshold: float,
    image: ImageContext | None,
    top_k: int,
) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32], npt.NDArray[np.int64]]:
    """One image's rows → its detections (boxes, scores, labels), best first."""
    # Padding rows score 0: they never count, even at threshold 0.
    keep = (scores >= threshold) & (scores > 0) & np.isfinite(scores)
    bx, sc, lb = boxes[keep].astype(np.float32), scores[keep], labels[keep]
    if image is not None:
        scale = letterbox_scale(image.height, image.width, (image.input_height, image.input_width))
        bx = bx / np.float32(scale)
        bx[:, 0::2] = np.clip(bx[:, 0::2], 0, image.width)
        bx[:, 1::2] = np.clip(bx[:, 1::2], 0, image.height)
    valid = (bx[:, 2] > bx[:, 0]) & (bx[:, 3] > bx[:, 1]) & np.isfinite(bx).all(axis=1)
    bx, sc, lb = bx[valid], sc[valid], lb[valid]
    order = nms(bx, sc, NMS_IOU, lb)[: max(top_k, 0)]
    return bx[order], sc[order], lb[order]


def detections(
    outputs: Arrays,
    class_names: Sequence[str],
    *,
    options: AnswerOptions,
    image: ImageContext | None = None,
) -> list[Answer]:
    """Per image of the batch: its detections, best first, at most `options.top_k`, each
    {"label", "index", "score", "box": [x1, y1, x2, y2]} with the box in the pixels of the
    image as sent when `image` is given (else of the model's input)."""
    boxes, scores, labels = _arrays(outputs)
    threshold = DEFAULT_SCORE_THRESHOLD if options.score_threshold is None else options.score_threshold
    out: list[Answer] = []
    for i in range(scores.shape[0]):
        cap = MAX_DETECTIONS if options.top_k is None else options.top_k
        bx, sc, lb = _kept(boxes[i], scores[i], labels[i], threshold, image, cap)
        out.append(
            [
                {
                    "label": _name(class_names, int(k)),
                    "index": int(k),
                    "score": float(s),
                    "box": [round(float(v), 2) for v in b],
                }
                for b, s, k in zip(bx, sc, lb, strict=True)
            ]
        )
    return out


def served(
    outputs: Arrays,
    class_names: Sequence[str],
    *,
    options: AnswerOptions,
    image: ImageContext | None = None,
) -> dict[str, Any]:
    """The image endpoint's body for one image: {"detections": [...], "counts": {name: n}}."""
    found = detections(outputs, class_names, options=options, image=image)[0]
    return {"detections": found, "counts": _counts(d["label"] for d in found)}


def log_fields(outputs: Arrays, class_names: Sequence[str]) -> list[dict[str, Any]]:
    """Per image: {"detections": how many pass the default threshold, "counts": {name: n} of
    those, "max_score": the best row's score (0 when none), so drift shows even when nothing
    passes}. Boxes are not logged: a record stays small whatever the image holds."""
    boxes, scores, labels = _arrays(outputs)
    out = []
    for i in range(scores.shape[0]):
        _, sc, lb = _kept(boxes[i], scores[i], labels[i], DEFAULT_SCORE_THRESHOLD, None, MAX_DETECTIONS)
        row = scores[i][np.isfinite(scores[i])]
        out.append(
            {
                "detections": len(sc),
                "counts": _counts(_name(class_names, int(k)) for k in lb),
                "max_score": round(float(row.max()) if row.size else 0.0, 6),
            }
        )
    return out


def drift_outputs(outputs: Arrays) -> DriftOutputs:
    """Per image: how many detections pass the default threshold, the best score over all
    rows (0 when none) and the mean score of those that pass (0 when none). A detector has no
    one class or confidence per image: no label-shift test, no accuracy estimate."""
    boxes, scores, labels = _arrays(outputs)
    columns = np.zeros((scores.shape[0], 3), dtype=np.float32)
    for i in range(scores.shape[0]):
        _, sc, _ = _kept(boxes[i], scores[i], labels[i], DEFAULT_SCORE_THRESHOLD, None, MAX_DETECTIONS)
        row = scores[i][np.isfinite(scores[i])]
        columns[i] = (len(sc), float(row.max()) if row.size else 0.0, float(sc.mean()) if len(sc) else 0.0)
    return DriftOutputs(("detections", "max_score", "mean_score"), columns)


# Boxes under this score are background noise for selection (the floor mAP evaluation keeps).
SELECTION_SCORE_FLOOR = 0.05


def uncertainty_inputs(outputs: Arrays) -> UncertaintyInputs:
    """Per image: the scores of its boxes over `SELECTION_SCORE_FLOOR` after per-class NMS,
    best first (what the image's uncertainty is scored from); no one class per image."""
    boxes, scores, labels = _arrays(outputs)
    per_image = tuple(
        _kept(boxes[i], scores[i], labels[i], SELECTION_SCORE_FLOOR, None, MAX_DETECTIONS)[1]
        for i in range(scores.shape[0])
    )
    return UncertaintyInputs(box_scores=per_image)


def agreement(a: Arrays, b: Arrays) -> npt.NDArray[np.bool_]:
    """Per image: whether two detectors' answers (default threshold, NMS, input pixels) are
    the same detections one to one: as many, and each pairs with one of the other's of the
    same class at IoU >= 0.5 (greedy, best score first)."""
    ba, sa, la = _arrays(a)
    bb, sb, lb = _arrays(b)
    out = np.zeros(sa.shape[0], dtype=np.bool_)
    for i in range(sa.shape[0]):
        x = _kept(ba[i], sa[i], la[i], DEFAULT_SCORE_THRESHOLD, None, MAX_DETECTIONS)
        y = _kept(bb[i], sb[i], lb[i], DEFAULT_SCORE_THRESHOLD, None, MAX_DETECTIONS)
        out[i] = match_one_to_one(x[0], x[2], y[0], y[2], AGREEMENT_IOU)
    return out


def match_one_to_one(
    boxes_a: npt.NDArray[Any],
    labels_a: npt.NDArray[Any],
    boxes_b: npt.NDArray[Any],
    labels_b: npt.NDArray[Any],
    iou: float,
) -> bool:
    """Whether every detection of a pairs with a distinct one of b (same label, IoU >= `iou`)
    and none of b is left over; a's are taken in their order (best first), each with its
    best-overlapping free partner."""
    if len(boxes_a) != len(boxes_b):
        return False
    if len(boxes_a) == 0:
        return True
    overlap = iou_matrix(boxes_a, boxes_b)
    overlap[np.asarray(labels_a)[:, None] != np.asarray(labels_b)[None, :]] = -1.0
    free = np.ones(len(boxes_b), dtype=np.bool_)
    for r in range(len(boxes_a)):
        cand = np.where(free, overlap[r], -1.0)
        j = int(cand.argmax())
        if cand[j] < iou:
            return False
        free[j] = False
    return True


def _name(class_names: Sequence[str], k: int) -> str:
    return class_names[k] if 0 <= k < len(class_names) else str(k)


def _counts(labels: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in labels:
        counts[name] = counts.get(name, 0) + 1
    return counts
