"""Streaming evaluation of a detector (COCO mAP through `metrics.DetectionEvaluator`), and the
export gate's comparison of an exported detector with eager PyTorch.

Frames: models see letterboxed S x S inputs, so predictions and the dataset's targets are in
input pixels; every target carries its letterbox `scale`. Both are divided by it before
they reach COCO, so that the small / medium / large buckets are measured in the stored
image's pixels, as COCO's are.

Ignored boxes: a target's `iscrowd` flags (crowd regions, difficult objects; see `data`)
travel with its boxes to COCO, which ignores them — in the trainer's evaluation, the export
gate's comparison and a benchmark's mAP alike, since all three go through `to_image_frame`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from visionloop.tasks.detection.metrics import DetectionEvaluator, DetectionReport, slot_state_for_sum
from visionloop.tasks.evaluation import ErrorAnalysis, EvalResult, Evaluator
from visionloop.tasks.export_seams import ExportComparison, GateMeasurement, OutputScorer

# Post-processing of raw (fixed-shape, pre-NMS) outputs before mAP: COCO's evaluation wants
# low-scoring detections too (they add recall), so the threshold is low.
MAP_SCORE_THRESHOLD = 0.05
MAX_DETECTIONS = 100
# An export "agrees" with eager PyTorch on an image when the detections a client would be
# served pair up one to one with the same label and nearly the same box (a shadow model is
# compared more loosely, at answer.AGREEMENT_IOU).
AGREEMENT_IOU = 0.99
GRID_IMAGES = 16  # validation images kept (input frame) for the artifacts' image grid

SCALARS = ("mAP", "mAP50", "mAP75", "mAP_small", "mAP_medium", "mAP_large", "AR100")


def to_image_frame(
    pred: Mapping[str, Any], target: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One image's prediction and target, from input pixels to stored-image pixels (the
    boxes divided by the target's letterbox `scale`); the target's `iscrowd` flags, when it
    has them, come along."""
    scale = float(target.get("scale", 1.0))
    t: dict[str, Any] = {"boxes": _f32(target["boxes"]) / scale, "labels": target["labels"]}
    if target.get("iscrowd") is not None:
        t["iscrowd"] = _cpu(target["iscrowd"])
    if target.get("image_id") is not None:
        t["image_id"] = target["image_id"]
    if target.get("orig_size") is not None:
        t["size"] = tuple(target["orig_size"])
    p = {"boxes": _f32(pred["boxes"]) / scale, "scores": pred["scores"], "labels": pred["labels"]}
    return p, t


def _f32(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", dtype=torch.float32).reshape(-1, 4)
    return torch.as_tensor(np.asarray(x, dtype=np.float32)).reshape(-1, 4)


def _cpu(x: Any) -> Any:
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def _state_device() -> torch.device:
    # NCCL exchanges CUDA tensors only; gloo (and no process group) CPU ones.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class DetectionTaskEvaluator(Evaluator):
    """The trainer's evaluator: `update(outputs, targets, loss_sum)` with the task's eval
    outputs (one {"boxes", "scores", "labels"} dict per image, input pixels, 0-based labels;
    an optional "image" entry, the input image, is kept for the first few images to draw) and
    the dataset's targets."""

    def __init__(self, class_names: Sequence[str]) -> None:
        self.class_names = list(class_names)
        self.inner = DetectionEvaluator(self.class_names)
        self.reset()

    def reset(self) -> None:
        self.inner.reset()
        self.loss_sum = 0.0
        self.grid: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]] = []
        self.report: DetectionReport | None = None  # the last compute()'s, for the plots

    def update(self, outputs: Any, targets: Any, loss_sum: float) -> None:
        preds, tgts = [], []
        for pred, target in zip(outputs, targets, strict=True):
            p, t = to_image_frame(pred, target)
            preds.append(p)
            tgts.append(t)
            if len(self.grid) < GRID_IMAGES and pred.get("image") is not None:
                keep = {k: v.detach().cpu() for k, v in pred.items() if k in ("boxes", "scores", "labels")}
                shown = {"boxes": _f32(target["boxes"]), "labels": target["labels"].detach().cpu()}
                if target.get("iscrowd") is not None:
                    shown["iscrowd"] = _cpu(target["iscrowd"])
                shown["image_id"] = target.get("image_id")
                self.grid.append((pred["image"].detach().cpu(), keep, shown))
        self.inner.update(preds, tgts)
        self.loss_sum += loss_sum

    def state(self) -> torch.Tensor:
        # A collective under DDP: every rank's block in its own slot, so that the trainer's
        # sum over ranks is their concatenation (metrics.slot_state_for_sum).
        return slot_state_for_sum(self.inner.state().to(_state_device()))

    def load_state(self, state: torch.Tensor) -> None:
        self.inner.load_state(state.cpu())

    def compute(self) -> EvalResult:
        report = self.inner.report()
        self.report = report
        metrics = dict(report.metrics)
        # The scalars the trainer logs and compares; a split without boxes defines none of
        # them, and the best checkpoint then stays unchosen (see DetectionEvaluator).
        ordered = {k: metrics[k] for k in SCALARS if k in metrics}
        per_class = {k: v for k, v in metrics.items() if k.startswith("AP/")}
        rest = {k: v for k, v in metrics.items() if k not in ordered and k not in per_class}
        out = {**ordered, **rest, **per_class}
        summary = "  ".join(
            f"{k} {ordered[k]:.3f}" for k in ("mAP", "mAP50", "mAP75", "AR100") if k in ordered
        )
        return EvalResult(
            metrics=out, report=report.to_dict(), summary=summary or f"no boxes in {report.num_images} images"
        )

    def error_analysis(self, limit: int = 10) -> ErrorAnalysis:
        from visionloop.tasks.detection.metrics import ERROR_KINDS
        from visionloop.tasks.evaluation import top_confused

        kinds = self.inner.error_kinds()
        return ErrorAnalysis(
            confused=top_confused(self.inner.confusion_matrix().tolist(), self.class_names, limit),
            kinds=kinds,
            definitions=ERROR_KINDS,
        )

    def write_artifacts(self, result: EvalResult, out_dir: Path) -> list[Path]:
        from visionloop.tasks.detection.plots import plot_detection_grid, write_plots

        report = self.report or self.inner.report()
        written = write_plots(self.inner, report, out_dir)
        if self.grid:
            images, preds, targets = zip(*self.grid, strict=True)
            written.append(
                plot_detection_grid(images, preds, targets, self.class_names, out_dir / "predictions.png")
            )
        return written


# ---------------------------------------------------------------------- export and bench


def postprocess(
    boxes: torch.Tensor,
    scores: torch.Tensor,
    labels: torch.Tensor,
    *,
    score_threshold: float = MAP_SCORE_THRESHOLD,
    max_detections: int = MAX_DETECTIONS,
) -> list[dict[str, torch.Tensor]]:
    """Raw fixed-shape outputs (B, K, 4), (B, K), (B, K) → per image, the detections scoring
    at least `score_threshold` (padding rows, score 0, never) after the server's per-class
    NMS (`answer.nms`), best first; input pixels, 0-based labels."""
    from visionloop.tasks.detection.answer import NMS_IOU, nms

    out = []
    for b, s, lab in zip(
        boxes.detach().cpu().float().numpy(),
        scores.detach().cpu().float().numpy(),
        labels.detach().cpu().long().numpy(),
        strict=True,
    ):
        keep = (s >= score_threshold) & (s > 0) & np.isfinite(s)
        keep &= (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1]) & np.isfinite(b).all(axis=1)
        b, s, lab = b[keep], s[keep], lab[keep]
        order = nms(b, s, NMS_IOU, lab)[:max_detections]
        out.append(
            {
                "boxes": torch.from_numpy(np.ascontiguousarray(b[order])).reshape(-1, 4),
                "scores": torch.from_numpy(np.ascontiguousarray(s[order])),
                "labels": torch.from_numpy(np.ascontiguousarray(lab[order])),
            }
        )
    return out


def row_difference(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """The largest difference between a row of `a` scoring at least MAP_SCORE_THRESHOLD and
    the nearest row of `b` of the same class (nearest by the larger of its largest box
    coordinate difference and its score difference, which it also measures).

    Not row i against row i: the raw rows are a top-K by score, and two peaks of nearly equal
    score (an untrained heatmap is full of them) may come out in either order from two
    runtimes, which would read as a box moved by tens of pixels. Rows below the threshold
    never reach mAP or an answer, so they are only candidates for pairing."""
    boxes_a, scores_a, labels_a = (t.detach().cpu() for t in a[:3])
    boxes_b, scores_b, labels_b = (t.detach().cpu() for t in b[:3])
    worst = 0.0
    for i in range(scores_a.shape[0]):
        keep = scores_a[i].float() >= MAP_SCORE_THRESHOLD
        if not bool(keep.any()):
            continue
        ba, sa, la = boxes_a[i][keep].double(), scores_a[i][keep].double(), labels_a[i][keep]
        bb, sb, lb = boxes_b[i].double(), scores_b[i].double(), labels_b[i]
        d = (ba[:, None, :] - bb[None, :, :]).abs().amax(dim=2)
        d = torch.maximum(d, (sa[:, None] - sb[None, :]).abs())
        d[la[:, None] != lb[None, :]] = float("inf")
        worst = max(worst, float(d.amin(dim=1).max()))
    return worst


def same_detections(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Whether two images' detections that a client would be served (the server's default
    score threshold) pair up one to one with the same label at IoU >= AGREEMENT_IOU."""
    from visionloop.tasks.detection.answer import DEFAULT_SCORE_THRESHOLD, match_one_to_one

    ka, kb = a["scores"] >= DEFAULT_SCORE_THRESHOLD, b["scores"] >= DEFAULT_SCORE_THRESHOLD
    return match_one_to_one(
        a["boxes"][ka].numpy(),
        a["labels"][ka].numpy(),
        b["boxes"][kb].numpy(),
        b["labels"][kb].numpy(),
        AGREEMENT_IOU,
    )


def _map(preds: list[dict[str, Any]], targets: list[dict[str, Any]], class_names: list[str] | None) -> float:
    """COCO mAP of image-frame predictions against targets; 0 where undefined (no boxes)."""
    if not targets:
        return 0.0
    # Without the class names, the classes are those up to the largest label of a target:
    # COCO averages over classes with ground truth only, and a prediction of a class with
    # none counts nowhere, so dropping those predictions leaves mAP unchanged.
    n = len(class_names) if class_names is not None else _num_classes(targets)
    names = class_names or [str(k) for k in range(n)]
    kept = [{k: v[torch.as_tensor(p["labels"]) < n] for k, v in p.items()} for p in preds]
    evaluator = DetectionEvaluator(names)
    evaluator.update(kept, targets)
    return float(evaluator.compute().get("mAP", 0.0))


class DetectionComparison(ExportComparison):
    """mAP of both models after the same post-processing, the fraction of images where their
    post-processed detections agree, and the largest raw difference of boxes and scores.
    Without `class_names` (the contract's `export_comparison()` takes none), the classes are
    inferred from the targets' labels, which leaves mAP unchanged (see `_map`)."""

    def __init__(self, class_names: Sequence[str] | None = None) -> None:
        self.class_names = list(class_names) if class_names is not None else None
        self.reference: list[dict[str, Any]] = []
        self.exported: list[dict[str, Any]] = []
        self.targets: list[dict[str, Any]] = []
        self.agree = 0
        self.max_abs_diff = 0.0

    def update(
        self, reference: Sequence[torch.Tensor], exported: Sequence[torch.Tensor], targets: Any
    ) -> None:
        ref_raw = [torch.as_tensor(t).cpu() for t in reference[:3]]
        got_raw = [torch.as_tensor(t).cpu() for t in exported[:3]]
        self.max_abs_diff = max(
            self.max_abs_diff, row_difference(ref_raw, got_raw), row_difference(got_raw, ref_raw)
        )
        ref, got = postprocess(*ref_raw), postprocess(*got_raw)
        for p, q, t in zip(ref, got, targets, strict=True):
            a, ta = to_image_frame(p, t)
            b, _ = to_image_frame(q, t)
            self.reference.append(a)
            self.exported.append(b)
            self.targets.append(ta)
            self.agree += same_detections(p, q)

    def result(self) -> GateMeasurement:
        n = len(self.targets)
        return GateMeasurement(
            metric="mAP",
            samples=n,
            score=_map(self.exported, self.targets, self.class_names),
            reference_score=_map(self.reference, self.targets, self.class_names),
            agreement=self.agree / max(n, 1),
            max_abs_diff=self.max_abs_diff,
        )


def _num_classes(targets: Sequence[Mapping[str, Any]]) -> int:
    top = [int(torch.as_tensor(t["labels"]).max()) for t in targets if len(t["labels"])]
    return max(top, default=0) + 1


class MapScorer(OutputScorer):
    """mAP of host outputs (boxes, scores, labels: raw, before NMS, input pixels) against the
    task's record targets, after the export comparison's post-processing."""

    def __init__(self, class_names: Sequence[str] | None = None) -> None:
        self.class_names = list(class_names) if class_names is not None else None
        self.preds: list[dict[str, Any]] = []
        self.targets: list[dict[str, Any]] = []

    def update(self, outputs: Sequence[Any], targets: Any) -> None:
        tensors = [torch.from_numpy(np.ascontiguousarray(o)) for o in outputs[:3]]
        for p, t in zip(postprocess(*tensors), targets, strict=True):
            a, ta = to_image_frame(p, t)
            self.preds.append(a)
            self.targets.append(ta)

    def compute(self) -> float:
        return _map(self.preds, self.targets, self.class_names)
