"""COCO box metrics for a detection evaluation pass, streamed image by image.

`DetectionEvaluator` keeps every prediction and ground-truth box it is given (mAP is not a
sum of per-batch numbers: it ranks all detections of a class across the whole split) and,
at `compute()`, converts them to COCO's format in memory and runs faster-coco-eval's
`COCOeval_faster` — the COCO protocol with its matching and accumulation in C++, giving the
same numbers as pycocotools (tests/unit/test_det_metrics.py checks every statistic).

Choices COCO leaves to the caller, made here:
- Boxes come in `xyxy`, absolute pixels; COCO's `bbox` is `[x, y, w, h]` with `w = x2 - x1`.
  The small / medium / large buckets (area below 32², up to 96², above) are in those pixels,
  so boxes must be in the original image's coordinates for the buckets to mean what COCO's do.
- `area` is the box's `w * h`. COCO's own ground truth uses the segmentation's area; we have
  boxes only, so an object's bucket can differ from what COCO's json would say for it.
- A ground-truth box may be flagged `iscrowd` (COCO's crowd regions; the detection task
  maps VOC's difficult objects onto it too): COCO ignores it, exactly as pycocotools does —
  a detection that matches it (IoU measured over the detection's own area, and several may)
  is neither a true nor a false positive, and it is never counted as missed. A class whose
  only boxes are ignored has no AP.
- COCO's default detection budget: at most 100 detections per image and class count.
- A value COCO cannot define — AP of a class without ground truth, `mAP_small` when no box
  is small, anything on a split without boxes — is left out of the metrics dict rather than
  reported as 0 (which would read as "the model found none of them") or as COCO's -1.
  Predictions of such a class still count nowhere, as in COCO.

State for checkpoints and DDP is one flat float64 tensor of self-delimiting blocks (integers
and float32 values are exact in float64), so the states of several ranks concatenated are a
valid state too: gather them with `gather_state` and `load_state` the result — or, for a
trainer that sum-reduces evaluator states, place each in its own slot with
`slot_state_for_sum`, whose sum over ranks is the concatenation.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from visionloop.core.errors import DataError

log = logging.getLogger(__name__)

STATE_MAGIC = float(0x56444554)  # "VDET": marks the start of each block
STATE_VERSION = 2.0
_HEADER = 6  # magic, version, num_classes, images, ground-truth boxes, predictions
_IMG_COLS = 3  # image_id (-1: none given), height, width (0: unknown)
_GT_COLS = 7  # image index within the block, label, x1, y1, x2, y2, iscrowd (0 or 1)
# Version 1 blocks (before iscrowd) still load, with no box ignored.
_GT_COLS_V1 = 6
_DT_COLS = 7  # image index within the block, label, score, x1, y1, x2, y2

# COCOeval_faster.stats, in order (bbox, default area ranges and maxDets [1, 10, 100]).
COCO_STAT_NAMES: tuple[str, ...] = (
    "mAP",
    "mAP50",
    "mAP75",
    "mAP_small",
    "mAP_medium",
    "mAP_large",
    "AR1",
    "AR10",
    "AR100",
    "AR_small",
    "AR_medium",
    "AR_large",
)


def _quiet(*args: Any, **kwargs: Any) -> None:
    """COCOeval prints its summary table through this; the report carries the numbers."""


def _metric_key(prefix: str, name: str) -> str:
    # A "/" inside a class name must not open a new level of the metric hierarchy.
    return f"{prefix}/{name.replace('/', '_')}"


def _array(value: Any, what: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        # One host copy per image: COCO evaluation runs on the CPU anyway.
        return value.detach().to(device="cpu", dtype=torch.float64).numpy()
    try:
        return np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise DataError(f"{what} must be a tensor or an array of numbers: {e}") from e


def _boxes(value: Any, what: str) -> np.ndarray:
    a = _array(value, what)
    if a.size == 0:
        return a.reshape(0, 4)
    if a.ndim != 2 or a.shape[1] != 4:
        raise DataError(f"{what} must have shape (N, 4) (x1, y1, x2, y2), got {a.shape}")
    if not np.isfinite(a).all():
        raise DataError(f"{what} holds NaN or infinite coordinates")
    if (a[:, 2] < a[:, 0]).any() or (a[:, 3] < a[:, 1]).any():
        raise DataError(
            f"{what} has a box with x2 < x1 or y2 < y1: boxes must be xyxy in absolute pixels, "
            "e.g. [10, 20, 50, 80]; convert xywh or cxcywh boxes first (torchvision.ops.box_convert)"
        )
    return a


def _vector(value: Any, what: str, n: int) -> np.ndarray:
    a = _array(value, what).reshape(-1)
    if a.shape[0] != n:
        raise DataError(f"{what} has {a.shape[0]} values for {n} boxes")
    if not np.isfinite(a).all():
        raise DataError(f"{what} holds NaN or infinite values")
    return a


def _labels(value: Any, what: str, n: int, num_classes: int) -> np.ndarray:
    a = _vector(value, what, n)
    if ((a != np.round(a)) | (a < 0) | (a >= num_classes)).any():
        bad = sorted({float(v) for v in a[(a != np.round(a)) | (a < 0) | (a >= num_classes)]})[:5]
        raise DataError(
            f"{what} {bad} outside the class indices [0, {num_classes}): labels index the dataset's "
            "class names, with no background entry; shift a model's 1-based labels down by one"
        )
    return a


def _flags(value: Any, what: str, n: int) -> np.ndarray:
    a = _vector(value, what, n)
    if ((a != 0) & (a != 1)).any():
        raise DataError(f"{what} must be 0 or 1 (or booleans) per box, got {sorted(set(a.tolist()))[:5]}")
    return a


def _scalar_id(value: Any) -> float:
    v = float(value.item()) if isinstance(value, torch.Tensor) else float(value)
    if v != round(v) or not 0 <= v < 2**53:
        raise DataError(f"image_id must be an integer in [0, 2**53), got {value!r}")
    return v


@dataclass(frozen=True)
class DetectionReport:
    """One evaluation pass. `precision50[k]` is class k's interpolated precision at IoU 0.5 at
    each of COCO's 101 `recall_thresholds`, NaN where the class has no ground truth.
    A row of `per_class` counts its ground-truth boxes (`num_gt`, the ones evaluated) apart
    from the ignored ones (`num_ignored`, iscrowd)."""

    class_names: list[str]
    num_images: int
    metrics: dict[str, float]
    per_class: list[dict[str, Any]]
    recall_thresholds: np.ndarray = field(repr=False)
    precision50: np.ndarray = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: absent values are None, never NaN."""
        return {
            "num_images": self.num_images,
            "metrics": dict(self.metrics),
            "per_class": [dict(row) for row in self.per_class],
            "class_names": list(self.class_names),
        }


class DetectionEvaluator:
    """Streams (predictions, targets) per image; `compute()` gives COCO box metrics.

    `update(predictions, targets)` takes one dict per image, in the same order:
    predictions `{"boxes": (N, 4) xyxy, "scores": (N,), "labels": (N,)}`; targets
    `{"boxes": (M, 4) xyxy, "labels": (M,)}` plus, optionally, `"iscrowd"` ((M,) 0/1 or
    bool: boxes COCO ignores; none when absent), `"image_id"` (an int, unique over the
    split: a repeat is an error, so no image is counted twice) and `"size"` (height, width).
    Tensors on any device, numpy arrays or lists. An image without boxes is a background
    image: its predictions are all false positives.
    """

    def __init__(self, class_names: Sequence[str]) -> None:
        if not class_names:
            raise ValueError("a detection evaluator needs at least one class name")
        self.class_names = [str(n) for n in class_names]
        self.num_classes = len(self.class_names)
        self.reset()

    def reset(self) -> None:
        self._images: list[np.ndarray] = []
        self._gt: list[np.ndarray] = []
        self._dt: list[np.ndarray] = []
        self._num_images = 0
        self._seen_ids: set[float] = set()

    @property
    def num_images(self) -> int:
        return self._num_images

    # ----------------------------------------------------------------- accumulate

    def update(self, predictions: Sequence[Mapping[str, Any]], targets: Sequence[Mapping[str, Any]]) -> None:
        if len(predictions) != len(targets):
            raise DataError(f"{len(predictions)} predictions for {len(targets)} targets: one dict per image")
        c = self.num_classes
        images, gts, dts = [], [], []
        batch_ids: set[float] = set()  # committed only when the whole batch is accepted
        for i, (pred, target) in enumerate(zip(predictions, targets, strict=True)):
            index = self._num_images + i
            gt_boxes = _boxes(target["boxes"], f"image {index}: target boxes")
            gt_labels = _labels(target["labels"], f"image {index}: target labels", len(gt_boxes), c)
            gt_crowd = np.zeros(len(gt_boxes))
            if target.get("iscrowd") is not None:
                gt_crowd = _flags(target["iscrowd"], f"image {index}: target iscrowd", len(gt_boxes))
            dt_boxes = _boxes(pred["boxes"], f"image {index}: predicted boxes")
            n = len(dt_boxes)
            dt_scores = _vector(pred["scores"], f"image {index}: predicted scores", n)
            dt_labels = _labels(pred["labels"], f"image {index}: predicted labels", n, c)
            image_id = -1.0
            if target.get("image_id") is not None:
                image_id = _scalar_id(target["image_id"])
                if image_id in self._seen_ids or image_id in batch_ids:
                    raise DataError(
                        f"image_id {int(image_id)} evaluated twice: each image of the split must be "
                        "given once (a distributed sampler that pads the split repeats images)"
                    )
                batch_ids.add(image_id)
            height, width = (0.0, 0.0)
            if target.get("size") is not None:
                height, width = (float(v) for v in _vector(target["size"], f"image {index}: size", 2))
            images.append([image_id, height, width])
            gts.append(np.column_stack([np.full(len(gt_boxes), index), gt_labels, gt_boxes, gt_crowd]))
            dts.append(np.column_stack([np.full(n, index), dt_labels, dt_scores, dt_boxes]))
        if images:
            self._images.append(np.asarray(images, dtype=np.float64).reshape(-1, _IMG_COLS))
            self._gt.append(np.concatenate(gts).reshape(-1, _GT_COLS))
            self._dt.append(np.concatenate(dts).reshape(-1, _DT_COLS))
            self._num_images += len(images)
            self._seen_ids |= batch_ids

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(images, ground truth, predictions), consolidated in place into one chunk each."""
        self._images = [np.concatenate(self._images)] if self._images else [np.zeros((0, _IMG_COLS))]
        self._gt = [np.concatenate(self._gt)] if self._gt else [np.zeros((0, _GT_COLS))]
        self._dt = [np.concatenate(self._dt)] if self._dt else [np.zeros((0, _DT_COLS))]
        return self._images[0], self._gt[0], self._dt[0]

    # ----------------------------------------------------------------- state

    def state(self) -> torch.Tensor:
        """Everything accumulated, as one float64 CPU tensor (one block)."""
        images, gt, dt = self._arrays()
        header = np.array(
            [STATE_MAGIC, STATE_VERSION, self.num_classes, len(images), len(gt), len(dt)], dtype=np.float64
        )
        flat = np.concatenate([header, images.ravel(), gt.ravel(), dt.ravel()])
        return torch.from_numpy(flat)

    def load_state(self, state: torch.Tensor) -> None:
        """Replace what was accumulated with `state`: one `state()`, or several concatenated
        (e.g. every rank's, from `gather_state`), merged in order."""
        self.reset()
        self.merge_state(state)

    def merge_state(self, state: torch.Tensor) -> None:
        """Add the images held by `state` (one or more concatenated blocks) to this one's."""
        flat = state.detach().to(device="cpu", dtype=torch.float64).numpy()
        blocks = list(self._blocks(flat))  # parse everything before changing anything
        ids = [float(v) for images, _, _ in blocks for v in images[:, 0] if v >= 0]
        unique, counts = np.unique(np.asarray(ids, dtype=np.float64), return_counts=True)
        repeated = (set(ids) & self._seen_ids) | {float(v) for v in unique[counts > 1]}
        if repeated:
            raise DataError(
                f"image_id {int(min(repeated))} is in two merged states: each image of the split "
                "must be evaluated on one rank only"
            )
        self._seen_ids.update(ids)
        for images, gt, dt in blocks:
            gt, dt = gt.copy(), dt.copy()
            gt[:, 0] += self._num_images  # block-local image index → this evaluator's
            dt[:, 0] += self._num_images
            self._images.append(images.copy())
            self._gt.append(gt)
            self._dt.append(dt)
            self._num_images += len(images)

    def _blocks(self, flat: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        pos = 0
        while pos < len(flat):
            if len(flat) - pos < _HEADER or flat[pos] != STATE_MAGIC or flat[pos + 1] not in (1.0, 2.0):
                raise DataError(
                    f"not a detection evaluator state at offset {pos} (version {STATE_VERSION:g} "
                    "expected): save it with DetectionEvaluator.state()"
                )
            gt_cols = _GT_COLS if flat[pos + 1] == STATE_VERSION else _GT_COLS_V1
            _, _, classes, n_img, n_gt, n_dt = (int(v) for v in flat[pos : pos + _HEADER])
            if classes != self.num_classes:
                raise DataError(
                    f"a state of {classes} classes cannot be loaded into a {self.num_classes}-class evaluator"
                )
            pos += _HEADER
            sizes = (n_img * _IMG_COLS, n_gt * gt_cols, n_dt * _DT_COLS)
            if pos + sum(sizes) > len(flat):
                raise DataError("detection evaluator state is truncated")
            parts = []
            for size, cols in zip(sizes, (_IMG_COLS, gt_cols, _DT_COLS), strict=True):
                parts.append(flat[pos : pos + size].reshape(-1, cols))
                pos += size
            gt = parts[1]
            if gt_cols == _GT_COLS_V1:
                gt = np.column_stack([gt, np.zeros(len(gt))])
            elif ((gt[:, 6] != 0) & (gt[:, 6] != 1)).any():
                raise DataError("detection evaluator state holds an iscrowd flag that is neither 0 nor 1")
            yield parts[0], gt, parts[2]

    # ----------------------------------------------------------------- report

    def compute(self) -> dict[str, float]:
        """Scalar metrics: `mAP` (IoU .50:.95), `mAP50`, `mAP75`, `mAP_small|medium|large`,
        `AR1`, `AR10`, `AR100`, `AR_small|medium|large`, and `AP/<class>` for each class
        with ground truth. Undefined values are absent (see the module docstring)."""
        return self.report().metrics

    def report(self) -> DetectionReport:
        images, gt, dt = self._arrays()
        c = self.num_classes
        recall_thresholds = np.linspace(0.0, 1.0, 101)
        precision50 = np.full((c, len(recall_thresholds)), np.nan)
        crowd = gt[:, 6] == 1
        num_gt = np.bincount(gt[~crowd, 1].astype(np.int64), minlength=c)
        num_ignored = np.bincount(gt[crowd, 1].astype(np.int64), minlength=c)
        num_pred = np.bincount(dt[:, 1].astype(np.int64), minlength=c)
        metrics: dict[str, float] = {}
        ap = np.full((c, 3), np.nan)  # AP@[.5:.95], AP50, AP75 per class
        if (~crowd).any():  # without ground truth to find every COCO number is undefined
            coco = _run_cocoeval(images, gt, dt, c)
            stats = np.asarray(coco.stats, dtype=np.float64)
            metrics = {name: float(v) for name, v in zip(COCO_STAT_NAMES, stats, strict=False) if v >= 0}
            # precision: [IoU thresholds T, recall thresholds R, classes K, areas A, maxDets M];
            # area "all" is index 0 and maxDets=100 the last, as in COCO's summary.
            precision = np.asarray(coco.eval["precision"])[:, :, :, 0, -1]
            recall_thresholds = np.asarray(coco.params.recThrs, dtype=np.float64)
            iou = np.asarray(coco.params.iouThrs)
            rows = {0: slice(None), 1: np.isclose(iou, 0.5), 2: np.isclose(iou, 0.75)}
            for k in range(c):
                for col, sel in rows.items():
                    p = precision[sel, :, k]
                    p = p[p > -1]
                    if p.size:
                        ap[k, col] = float(np.mean(p))
                p50 = precision[np.isclose(iou, 0.5), :, k][0]
                if (p50 > -1).any():
                    precision50[k] = p50
        per_class = []
        for k, name in enumerate(self.class_names):
            values = [None if np.isnan(v) else float(v) for v in ap[k]]
            if values[0] is not None:
                metrics[_metric_key("AP", name)] = values[0]
            per_class.append(
                {
                    "name": name,
                    "AP": values[0],
                    "AP50": values[1],
                    "AP75": values[2],
                    "num_gt": int(num_gt[k]),
                    "num_ignored": int(num_ignored[k]),
                    "num_pred": int(num_pred[k]),
                }
            )
        return DetectionReport(
            class_names=list(self.class_names),
            num_images=len(images),
            metrics=metrics,
            per_class=per_class,
            recall_thresholds=recall_thresholds,
            precision50=precision50,
        )

    def _per_image(
        self, score_threshold: float, *, best_first: bool
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per image seen: its counted ground-truth rows, its ignored (crowd) ones, and its
        detection rows scoring at least `score_threshold` (in input order, or best first)."""
        images, gt, dt = self._arrays()
        dt = dt[dt[:, 2] >= score_threshold]
        gt = gt[np.argsort(gt[:, 0], kind="stable")]
        order = np.lexsort((-dt[:, 2], dt[:, 0])) if best_first else np.argsort(dt[:, 0], kind="stable")
        dt = dt[order]
        n = len(images)
        g_cuts = np.searchsorted(gt[:, 0], np.arange(n + 1))
        d_cuts = np.searchsorted(dt[:, 0], np.arange(n + 1))
        for i in range(n):
            g = gt[g_cuts[i] : g_cuts[i + 1]]
            yield g[g[:, 6] == 0], g[g[:, 6] == 1], dt[d_cuts[i] : d_cuts[i + 1]]

    def error_kinds(
        self, score_threshold: float = 0.25, fg_iou: float = 0.5, bg_iou: float = 0.1
    ) -> dict[str, int]:
        """Counts of each kind of error (`ERROR_KINDS`) and of true positives, after TIDE
        (Bolya et al., ECCV 2020), counted rather than weighed in AP: in each image, the
        detections scoring at least `score_threshold`, best first, are each given one kind by
        their best overlaps with the ground truth, and the ground-truth boxes no true positive
        found and no classification or localisation error points at are missed. Ignored
        (crowd) boxes are matched by nothing; a detection on one is neither right nor wrong."""
        counts = dict.fromkeys(("true_positive", *ERROR_KINDS), 0)
        for g, crowd, d in self._per_image(score_threshold, best_first=True):
            g_cls = g[:, 1].astype(np.int64)
            found = np.zeros(len(g), dtype=bool)  # by a true positive
            explained = np.zeros(len(g), dtype=bool)  # by a classification or localisation error
            iou = box_iou(g[:, 2:6], d[:, 3:7]) if len(g) and len(d) else np.zeros((len(g), len(d)))
            on_crowd: np.ndarray = np.zeros(len(d), dtype=bool)
            if len(crowd) and len(d):
                on_crowd = np.asarray((crowd_iou(crowd[:, 2:6], d[:, 3:7]) >= fg_iou).any(axis=0))
            for j in range(len(d)):
                overlap = iou[:, j]
                same = g_cls == int(d[j, 1])
                free = same & ~found & (overlap >= fg_iou)
                if free.any():
                    found[np.flatnonzero(free)[np.argmax(overlap[free])]] = True
                    counts["true_positive"] += 1
                elif (same & (overlap >= fg_iou)).any():
                    counts["duplicate"] += 1
                elif (~same & (overlap >= fg_iou)).any():
                    counts["classification"] += 1
                    explained[np.flatnonzero(~same & (overlap >= fg_iou))] = True
                elif (same & (overlap >= bg_iou)).any():
                    counts["localisation"] += 1
                    explained[np.flatnonzero(same & (overlap >= bg_iou))] = True
                elif (overlap >= bg_iou).any():
                    counts["both"] += 1
                elif not on_crowd[j]:
                    counts["background"] += 1
            counts["missed"] += int((~found & ~explained).sum())
        return counts

    def confusion_matrix(self, iou_threshold: float = 0.5, score_threshold: float = 0.25) -> np.ndarray:
        """Counts `m[true, predicted]` over classes + background (the last row and column).

        Predictions below `score_threshold` are dropped (the COCO evaluation above keeps them
        all; a confusion matrix describes the decisions a deployed model makes). In each image,
        ground-truth and predicted boxes are matched one to one, class-agnostically, greedily by
        descending IoU, pairs with IoU >= `iou_threshold` only. A matched pair counts at
        (its true class, its predicted class) — the diagonal when the class is right; an
        unmatched ground-truth box at (its class, background): missed; an unmatched prediction
        at (background, its class): a false alarm. (background, background) stays 0: the
        negatives of detection are not countable.

        Ignored (iscrowd) boxes are matched by nothing and never counted as missed; a
        prediction left unmatched that lies on one (at least `iou_threshold` of its own area
        inside it, COCO's measure for crowd regions) is not counted as a false alarm either.
        """
        c = self.num_classes
        m = np.zeros((c + 1, c + 1), dtype=np.int64)
        for g, crowd, d in self._per_image(score_threshold, best_first=False):
            g_cls = g[:, 1].astype(np.int64)
            d_cls = d[:, 1].astype(np.int64)
            g_used = np.zeros(len(g), dtype=bool)
            d_used = np.zeros(len(d), dtype=bool)
            if len(g) and len(d):
                iou = box_iou(g[:, 2:6], d[:, 3:7])
                gi, di = np.nonzero(iou >= iou_threshold)
                # Ties in IoU go to the higher-scoring prediction, then to input order.
                order = np.lexsort((di, -d[di, 2], -iou[gi, di]))
                for a, b in zip(gi[order].tolist(), di[order].tolist(), strict=True):
                    if not g_used[a] and not d_used[b]:
                        g_used[a] = d_used[b] = True
                        m[g_cls[a], d_cls[b]] += 1
            if len(crowd) and len(d):
                on_crowd = (crowd_iou(crowd[:, 2:6], d[:, 3:7]) >= iou_threshold).any(axis=0)
                d_used |= on_crowd
            m[:c, c] += np.bincount(g_cls[~g_used], minlength=c)
            m[c, :c] += np.bincount(d_cls[~d_used], minlength=c)
        return m


# The kinds of error `DetectionEvaluator.error_kinds` counts, with what each means.
ERROR_KINDS: dict[str, str] = {
    "classification": "the right place (IoU >= 0.5 with a box) but the wrong class",
    "localisation": "the right class but a loose box (0.1 <= IoU < 0.5)",
    "both": "the wrong class and a loose box (0.1 <= IoU < 0.5 with a box of another class)",
    "duplicate": "a second detection of a box already found",
    "background": "a detection where there is nothing (IoU < 0.1 with every box)",
    "missed": "a box no detection found, not even wrongly",
}


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every xyxy box in `a` (N, 4) with every one in `b` (M, 4): (N, M); 0 where both
    boxes have no area."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=2)
    area_a = np.prod(a[:, 2:] - a[:, :2], axis=1)
    area_b = np.prod(b[:, 2:] - b[:, :2], axis=1)
    union = area_a[:, None] + area_b[None, :] - inter
    iou: np.ndarray = np.zeros(inter.shape, dtype=np.float64)
    np.divide(inter, union, out=iou, where=union > 0)
    return iou


def crowd_iou(crowd: np.ndarray, b: np.ndarray) -> np.ndarray:
    """COCO's overlap of a crowd region with a detection: their intersection over the
    detection's own area (a detection wholly inside a crowd scores 1). `crowd` (N, 4) and `b`
    (M, 4) xyxy → (N, M); 0 for a detection without area."""
    lt = np.maximum(crowd[:, None, :2], b[None, :, :2])
    rb = np.minimum(crowd[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(rb - lt, 0, None), axis=2)
    area_b = np.broadcast_to(np.prod(b[:, 2:] - b[:, :2], axis=1)[None, :], inter.shape)
    out: np.ndarray = np.zeros(inter.shape, dtype=np.float64)
    np.divide(inter, area_b, out=out, where=area_b > 0)
    return out


def to_coco(
    images: np.ndarray, gt: np.ndarray, dt: np.ndarray, num_classes: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """COCO ground-truth dataset and detection results (xyxy → xywh, area w*h; a
    ground-truth box's iscrowd from its flag, a detection's 0).

    Image ids are the row indices of `images` — unique even when callers gave none — and
    annotation ids start at 1 (COCOeval reads id 0 as "unmatched").
    """
    coco_images = [
        {"id": i, "height": int(h), "width": int(w)} for i, (h, w) in enumerate(images[:, 1:3].tolist())
    ]
    categories = [{"id": k, "name": str(k)} for k in range(num_classes)]

    def xywh(boxes: np.ndarray) -> tuple[list[list[float]], list[float]]:
        wh = boxes[:, 2:4] - boxes[:, 0:2]
        return np.column_stack([boxes[:, 0:2], wh]).tolist(), (wh[:, 0] * wh[:, 1]).tolist()

    g_boxes, g_area = xywh(gt[:, 2:6])
    annotations = [
        {"id": j + 1, "image_id": im, "category_id": k, "bbox": b, "area": ar, "iscrowd": crowd}
        for j, (im, k, b, ar, crowd) in enumerate(
            zip(
                gt[:, 0].astype(np.int64).tolist(),
                gt[:, 1].astype(np.int64).tolist(),
                g_boxes,
                g_area,
                gt[:, 6].astype(np.int64).tolist(),
                strict=True,
            )
        )
    ]
    d_boxes, d_area = xywh(dt[:, 3:7])
    results = [
        {"id": j + 1, "image_id": im, "category_id": k, "bbox": b, "score": s, "area": ar, "iscrowd": 0}
        for j, (im, k, s, b, ar) in enumerate(
            zip(
                dt[:, 0].astype(np.int64).tolist(),
                dt[:, 1].astype(np.int64).tolist(),
                dt[:, 2].tolist(),
                d_boxes,
                d_area,
                strict=True,
            )
        )
    ]
    return {"images": coco_images, "annotations": annotations, "categories": categories}, results


def _run_cocoeval(images: np.ndarray, gt: np.ndarray, dt: np.ndarray, num_classes: int) -> Any:
    from faster_coco_eval import COCO, COCOeval_faster

    dataset, results = to_coco(images, gt, dt, num_classes)
    coco_gt = COCO()
    coco_gt.dataset = dataset
    coco_gt.createIndex()
    # The results object is built the way `loadRes` builds it, minus loadRes' copies and the
    # polygon it makes up for every box (bbox evaluation never reads it).
    coco_dt = COCO()
    coco_dt.dataset = {
        "images": dataset["images"],
        "annotations": results,
        "categories": dataset["categories"],
    }
    coco_dt.createIndex()
    coco = COCOeval_faster(coco_gt, coco_dt, iouType="bbox", print_function=_quiet)
    coco.evaluate()
    coco.accumulate()
    coco.summarize()
    return coco


def gather_state(state: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Every rank's `state()` concatenated in rank order, on every rank (the state itself
    without an initialised process group). States differ in length, so lengths go first and
    each is padded to the longest for one `all_gather`. Works with gloo and NCCL: move the
    state to the rank's device first for NCCL."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return state
    world = dist.get_world_size(group)
    length = torch.tensor([state.numel()], dtype=torch.int64, device=state.device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(x.item()) for x in lengths]
    padded = torch.zeros(max(sizes), dtype=state.dtype, device=state.device)
    padded[: state.numel()] = state
    parts = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return torch.cat([p[:s] for p, s in zip(parts, sizes, strict=True)])


def slot_state_for_sum(state: torch.Tensor, group: Any = None) -> torch.Tensor:
    """This rank's `state()` placed in its own slot of a zero tensor as long as all ranks'
    states together, so that an `all_reduce(SUM)` of the slots *is* the concatenation
    (x + 0.0 == x exactly): the shape the trainer's sum-reduced `Evaluator.state()` needs.
    A collective: every rank must call it at the same point. Lengths are exchanged on the
    state's device (a CUDA tensor under NCCL). Without a process group, the state itself."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return state
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    length = torch.tensor([state.numel()], dtype=torch.int64, device=state.device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(x.item()) for x in lengths]
    out = torch.zeros(sum(sizes), dtype=state.dtype, device=state.device)
    start = sum(sizes[:rank])
    out[start : start + state.numel()] = state
    return out
