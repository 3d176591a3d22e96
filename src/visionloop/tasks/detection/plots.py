"""Detection plots as PNGs: precision-recall curves per class, the confusion matrix with a
background class, and a grid of validation images with true and predicted boxes.

Drawn with matplotlib's object API on an Agg canvas — never `pyplot` — so they need no
display, keep no global figure state between calls, and are safe from a trainer's thread.
Every file is written atomically.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from visionloop.core.fsutil import atomic_write_bytes
from visionloop.tasks.classification.plots import plot_confusion_matrix
from visionloop.tasks.detection.metrics import DetectionEvaluator, DetectionReport

MAX_PR_PANELS = 36  # above this, the classes with the most ground-truth boxes are drawn
MAX_GRID_IMAGES = 16
TRUE_COLOUR = "#1db954"  # green
PRED_COLOUR = "#e53935"  # red


def _save(fig: Figure, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(Path(path), buf.getvalue())
    return Path(path)


def plot_pr_curves(report: DetectionReport, path: Path, *, max_panels: int = MAX_PR_PANELS) -> Path:
    """One panel per class with ground truth: COCO's interpolated precision at IoU 0.5 over its
    101 recall thresholds (the curve whose mean is the class's AP50). With more classes than
    `max_panels`, the ones with the most ground-truth boxes are drawn."""
    has_gt = [k for k in range(len(report.class_names)) if not np.isnan(report.precision50[k]).all()]
    has_gt.sort(key=lambda k: -int(report.per_class[k]["num_gt"]))
    shown = sorted(has_gt[:max_panels])
    cols = max(1, math.ceil(math.sqrt(len(shown))))
    rows = max(1, math.ceil(len(shown) / cols))
    fig = Figure(figsize=(2.6 * cols + 0.4, 2.3 * rows + 0.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    title = f"precision-recall at IoU 0.5 — {report.num_images} images"
    if len(has_gt) > len(shown):
        title += f", {len(shown)} of {len(has_gt)} classes (most boxes)"
    fig.suptitle(title)
    if not shown:
        ax = fig.add_subplot()
        ax.text(0.5, 0.5, "no ground-truth boxes", ha="center", va="center")
        ax.set_axis_off()
        return _save(fig, path)
    axes = fig.subplots(rows, cols, squeeze=False)
    recall = report.recall_thresholds
    for ax, k in zip(axes.flat, shown, strict=False):
        precision = report.precision50[k]
        ax.plot(recall, precision, color="#1f77b4", linewidth=1.5)
        ax.fill_between(recall, precision, alpha=0.15, color="#1f77b4")
        ap50 = report.per_class[k]["AP50"]
        ax.set_title(f"{report.class_names[k][:24]}  AP50 {ap50:.3f}", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1.02)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(shown) :]:
        ax.set_axis_off()
    for ax in axes[-1]:
        ax.set_xlabel("recall", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel("precision", fontsize=8)
    return _save(fig, path)


def plot_detection_confusion_matrix(
    matrix: np.ndarray | Sequence[Sequence[int]], class_names: Sequence[str], path: Path
) -> Path:
    """Counts of `DetectionEvaluator.confusion_matrix()`: rows true, columns predicted, the
    last of each "background" (column: missed boxes; row: false alarms). Ignored (crowd,
    difficult) boxes are in neither."""
    m = np.asarray(matrix, dtype=np.int64)
    names = [*class_names, "background"]
    missed = int(m[:-1, -1].sum())
    false_alarms = int(m[-1, :-1].sum())
    title = f"detections — {int(np.trace(m))} right, {missed} missed, {false_alarms} false alarms"
    return plot_confusion_matrix(m, names, path, normalize=False, title=title)


def _hwc_uint8(image: Any) -> np.ndarray:
    a = image.detach().cpu().numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if a.ndim == 3 and a.shape[0] in (1, 3) and a.shape[2] not in (1, 3):
        a = a.transpose(1, 2, 0)  # CHW → HWC
    if a.ndim == 3 and a.shape[2] == 1:
        a = a[:, :, 0]
    if a.dtype != np.uint8:
        # Floats in [0, 1], as torchvision's to_dtype(scale=True) gives them.
        a = (np.clip(a.astype(np.float64), 0.0, 1.0) * 255).round().astype(np.uint8)
    return a


def _as_rows(value: Any) -> list[list[float]]:
    a = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    return np.asarray(a, dtype=np.float64).reshape(-1, 4).tolist()


def _as_list(value: Any) -> list[float]:
    a = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    return np.asarray(a, dtype=np.float64).reshape(-1).tolist()


def plot_detection_grid(
    images: Sequence[Any],
    predictions: Sequence[Mapping[str, Any]],
    targets: Sequence[Mapping[str, Any]],
    class_names: Sequence[str],
    path: Path,
    *,
    score_threshold: float = 0.25,
    max_images: int = MAX_GRID_IMAGES,
) -> Path:
    """A grid of up to `max_images` images with their true boxes (green; ignored ones —
    a target's `iscrowd` — dotted, their class marked "ignored") and the predictions scoring
    at least `score_threshold` (red, dashed, with class and score). Images are uint8 or
    [0, 1] float, CHW tensors or HWC arrays, un-normalised; boxes are xyxy in their pixels and
    the dicts are those `DetectionEvaluator.update` takes."""
    n = min(len(images), max_images)
    if len(predictions) < n or len(targets) < n:
        raise ValueError(f"{n} images need as many predictions and targets")
    cols = min(4, max(1, n))
    rows = max(1, math.ceil(n / cols))
    fig = Figure(figsize=(3.6 * cols, 3.6 * rows + 0.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(f"true (green, ignored dotted) and predicted (red, score ≥ {score_threshold:g}) boxes")
    axes = fig.subplots(rows, cols, squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.set_axis_off()
        if i >= n:
            continue
        ax.imshow(_hwc_uint8(images[i]), cmap="gray")
        boxes, labels = _as_rows(targets[i]["boxes"]), _as_list(targets[i]["labels"])
        crowd = targets[i].get("iscrowd")
        ignored = [bool(v) for v in _as_list(crowd)] if crowd is not None else [False] * len(labels)
        for (x1, y1, x2, y2), k, ignore in zip(boxes, labels, ignored, strict=True):
            ax.add_patch(
                Rectangle(
                    (x1, y1),
                    x2 - x1,
                    y2 - y1,
                    fill=False,
                    color=TRUE_COLOUR,
                    linewidth=1.0 if ignore else 1.5,
                    linestyle=":" if ignore else "-",
                )
            )
            ax.text(
                x1,
                y2,
                class_names[int(k)][:16] + (" (ignored)" if ignore else ""),
                color="white",
                fontsize=6,
                va="top",
                clip_on=True,
                bbox={"facecolor": TRUE_COLOUR, "pad": 1, "linewidth": 0},
            )
        pred = predictions[i]
        for (x1, y1, x2, y2), k, s in zip(
            _as_rows(pred["boxes"]), _as_list(pred["labels"]), _as_list(pred["scores"]), strict=True
        ):
            if s < score_threshold:
                continue
            ax.add_patch(
                Rectangle(
                    (x1, y1), x2 - x1, y2 - y1, fill=False, color=PRED_COLOUR, linewidth=1.2, linestyle="--"
                )
            )
            ax.text(
                x1,
                y1,
                f"{class_names[int(k)][:16]} {s:.2f}",
                color="white",
                fontsize=6,
                va="bottom",
                clip_on=True,
                bbox={"facecolor": PRED_COLOUR, "pad": 1, "linewidth": 0},
            )
        title = targets[i].get("image_id")
        if title is not None:
            ax.set_title(f"image {int(title)}", fontsize=8)
    return _save(fig, path)


def write_plots(
    evaluator: DetectionEvaluator,
    report: DetectionReport,
    out_dir: Path,
    *,
    iou_threshold: float = 0.5,
    score_threshold: float = 0.25,
) -> list[Path]:
    """The PR curves and the confusion matrix of one evaluation pass; what was written.
    (The image grid needs the images themselves: the task draws it with
    `plot_detection_grid`.)"""
    out_dir.mkdir(parents=True, exist_ok=True)
    matrix = evaluator.confusion_matrix(iou_threshold=iou_threshold, score_threshold=score_threshold)
    return [
        plot_pr_curves(report, out_dir / "pr_curves.png"),
        plot_detection_confusion_matrix(matrix, report.class_names, out_dir / "confusion_matrix.png"),
    ]
