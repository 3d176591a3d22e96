"""A detector's confidence calibration: is a detection scored 0.8 right 80% of the time?

Each detection is a binary event, right (a true positive: it matches an unmatched ground-truth
box of its class at IoU >= 0.5, greedily in score order, as COCO matches) or wrong. Its score s
becomes the two-class logits [0, logit(s)] with the label 1 when right, so the calibration
measures and the temperature fit of `eval.calibration` (written for softmax classifiers) apply
unchanged: softmax([0, z / T]) = [1 - sigmoid(z / T), sigmoid(z / T)]. This is the detection
calibration error of Küppers et al. ("Multivariate Confidence Calibration for Object
Detection", CVPR Workshops 2020) on the confidence alone. Detections matching a crowd region
are neither right nor wrong and are left out, as COCO ignores them.

Served, the temperature maps each score to sigmoid(logit(s) / T): the ranking, so mAP, is
unchanged; a padding row's score 0 stays 0. The score threshold then reads as a calibrated
probability, so after calibration a different number of boxes may pass it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

MATCH_IOU = 0.5
_EPS = 1e-6


def _iou(a: npt.NDArray[np.float64], b: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    lo = np.maximum(a[:, None, :2], b[None, :, :2])
    hi = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(hi - lo, 0, None), axis=2)
    area_a = np.prod(np.clip(a[:, 2:] - a[:, :2], 0, None), axis=1)
    area_b = np.prod(np.clip(b[:, 2:] - b[:, :2], 0, None), axis=1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-12), 0.0)


def _np(x: Any) -> npt.NDArray[Any]:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def right_or_wrong(
    outputs: Sequence[dict[str, Any]], targets: Sequence[dict[str, Any]], iou: float = MATCH_IOU
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.int64]]:
    """Per detection of a batch (crowd matches left out): its score, and 1 if it is a true
    positive at `iou`, else 0."""
    scores: list[float] = []
    right: list[int] = []
    for pred, target in zip(outputs, targets, strict=True):
        boxes = _np(pred["boxes"]).astype(np.float64).reshape(-1, 4)
        sc = _np(pred["scores"]).astype(np.float64).reshape(-1)
        lb = _np(pred["labels"]).astype(np.int64).reshape(-1)
        gt = _np(target["boxes"]).astype(np.float64).reshape(-1, 4)
        gl = _np(target["labels"]).astype(np.int64).reshape(-1)
        crowd = _np(target["iscrowd"]).astype(bool).reshape(-1) if target.get("iscrowd") is not None else None
        if crowd is None or crowd.shape != gl.shape:
            crowd = np.zeros(len(gl), dtype=bool)
        overlap = _iou(boxes, gt) if len(boxes) and len(gt) else np.zeros((len(boxes), len(gt)))
        taken = np.zeros(len(gt), dtype=bool)
        for d in np.argsort(-sc, kind="stable"):
            same = gl == lb[d]
            free = same & ~crowd & ~taken & (overlap[d] >= iou)
            if free.any():
                taken[np.flatnonzero(free)[np.argmax(overlap[d][free])]] = True
                hit = 1
            elif (same & crowd & (overlap[d] >= iou)).any():
                continue  # a crowd region: ignored, as COCO ignores it
            else:
                hit = 0
            scores.append(float(sc[d]))
            right.append(hit)
    return np.asarray(scores, dtype=np.float64), np.asarray(right, dtype=np.int64)


def calibration_pairs(
    outputs: Sequence[dict[str, Any]], targets: Sequence[dict[str, Any]]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(two-class logits [0, logit(score)] per detection, 1 if right), or None for a batch
    without detections."""
    import torch  # here: the server imports this module for `scaled_scores` alone

    scores, right = right_or_wrong(outputs, targets)
    if len(scores) == 0:
        return None
    p = np.clip(scores, _EPS, 1.0 - _EPS)
    z = np.log(p) - np.log1p(-p)
    logits = np.stack([np.zeros_like(z), z], axis=1)
    return torch.from_numpy(logits.astype(np.float32)), torch.from_numpy(right)


def scaled_scores(scores: npt.NDArray[Any], temperature: float) -> npt.NDArray[np.float32]:
    """sigmoid(logit(s) / T) for each score; 0 (padding) stays 0, non-finite stays as it is."""
    s = np.asarray(scores, dtype=np.float64)
    out = s.copy()
    live = np.isfinite(s) & (s > 0)
    p = np.clip(s[live], _EPS, 1.0 - _EPS)
    z = (np.log(p) - np.log1p(-p)) / temperature
    out[live] = 1.0 / (1.0 + np.exp(-z))
    return out.astype(np.float32)
