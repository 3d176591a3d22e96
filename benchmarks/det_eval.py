"""Detection mAP evaluation time: visionloop's `DetectionEvaluator` vs pycocotools.

Both evaluate the same synthetic validation split — by default 5,000 images of 640x640 with
COCO-like statistics: 80 classes, about 7 true boxes per image from 4 to 400 px on a side
(small, medium and large), and up to 100 detections per image as a detector keeps them
(jittered hits, wrong classes, background false positives; scores in [0, 1]).

- visionloop: `update()` per batch of 32 images with the model-output dicts (float32 tensors)
  and `compute()` — everything from the model's outputs to the metrics, COCO conversion and
  the ground truth's index included.
- baseline: pycocotools' `loadRes` + `evaluate` + `accumulate` + `summarize`, the way
  torchvision's references/detection evaluates. Its ground-truth `COCO` object and the result
  dicts are built before the clock starts, so the baseline pays for neither: the ratio is
  conservative.

Rounds alternate the two, so machine drift hits both alike; the ratio is of the medians.
Every round also checks that both gave the same 12 COCO statistics.

    python benchmarks/det_eval.py [--images 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import io
from typing import Any

import numpy as np
import torch

from _common import median, timed, write_result

TARGET = 0.5
BATCH = 32


def synthetic_split(
    n_images: int, n_classes: int, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rng = np.random.default_rng(seed)
    preds, targets = [], []
    for i in range(n_images):
        n_obj = int(rng.poisson(7.3)) if rng.random() > 0.01 else 0  # ~1% background images
        wh = np.exp(rng.uniform(np.log(4), np.log(400), (n_obj, 2)))
        xy = rng.uniform(0, 1, (n_obj, 2)) * (640 - wh)
        gt = np.concatenate([xy, xy + wh], axis=1)
        labels = rng.integers(0, n_classes, n_obj)
        # Each object found 0-3 times (jittered; 15% with a wrong class), then background noise,
        # then the 100 best kept, as torchvision's detectors do (detections_per_img=100).
        hits = rng.integers(0, 4, n_obj)
        src = np.repeat(np.arange(n_obj), hits)
        jitter = rng.normal(0, 0.12, (len(src), 4)) * np.tile(wh[src], 2)
        p_boxes = gt[src] + jitter
        p_labels = np.where(rng.random(len(src)) < 0.85, labels[src], rng.integers(0, n_classes, len(src)))
        p_scores = rng.beta(4, 2, len(src))
        n_noise = int(rng.integers(10, 90))
        nwh = np.exp(rng.uniform(np.log(4), np.log(300), (n_noise, 2)))
        nxy = rng.uniform(0, 1, (n_noise, 2)) * (640 - nwh)
        p_boxes = np.concatenate([p_boxes, np.concatenate([nxy, nxy + nwh], axis=1)])
        p_labels = np.concatenate([p_labels, rng.integers(0, n_classes, n_noise)])
        p_scores = np.concatenate([p_scores, rng.beta(1, 4, n_noise)])
        p_boxes[:, 2:] = np.maximum(p_boxes[:, 2:], p_boxes[:, :2] + 1.0)  # valid xyxy
        keep = np.argsort(-p_scores, kind="stable")[:100]
        targets.append(
            {
                "boxes": torch.from_numpy(gt.astype(np.float32)),
                "labels": torch.from_numpy(labels),
                "image_id": i,
                "size": (640, 640),
            }
        )
        preds.append(
            {
                "boxes": torch.from_numpy(p_boxes[keep].astype(np.float32)),
                "scores": torch.from_numpy(p_scores[keep].astype(np.float32)),
                "labels": torch.from_numpy(p_labels[keep]),
            }
        )
    return preds, targets


def coco_inputs(
    preds: list[dict[str, Any]], targets: list[dict[str, Any]], n_classes: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ground-truth dataset and result dicts pycocotools takes (xyxy → xywh, area w*h)."""
    images, annotations, results = [], [], []
    for i, (p, t) in enumerate(zip(preds, targets, strict=True)):
        images.append({"id": i, "height": 640, "width": 640})
        for (x1, y1, x2, y2), k in zip(t["boxes"].double().tolist(), t["labels"].tolist(), strict=True):
            box = [x1, y1, x2 - x1, y2 - y1]
            annotations.append(
                {"id": len(annotations) + 1, "image_id": i, "category_id": k, "bbox": box,
                 "area": box[2] * box[3], "iscrowd": 0}
            )  # fmt: skip
        for (x1, y1, x2, y2), s, k in zip(
            p["boxes"].double().tolist(), p["scores"].double().tolist(), p["labels"].tolist(), strict=True
        ):
            results.append({"image_id": i, "category_id": k, "bbox": [x1, y1, x2 - x1, y2 - y1], "score": s})
    categories = [{"id": k, "name": str(k)} for k in range(n_classes)]
    return {"images": images, "annotations": annotations, "categories": categories}, results


def run_ours(
    preds: list[dict[str, Any]], targets: list[dict[str, Any]], names: list[str]
) -> dict[str, float]:
    from visionloop.tasks.detection.metrics import DetectionEvaluator

    ev = DetectionEvaluator(names)
    for start in range(0, len(preds), BATCH):
        ev.update(preds[start : start + BATCH], targets[start : start + BATCH])
    return ev.compute()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--classes", type=int, default=80)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    from visionloop.tasks.detection.metrics import COCO_STAT_NAMES

    names = [f"class{k}" for k in range(args.classes)]
    preds, targets = synthetic_split(args.images, args.classes, seed=0)
    n_gt = sum(len(t["labels"]) for t in targets)
    n_dt = sum(len(p["labels"]) for p in preds)
    print(f"{args.images} images, {n_gt} true boxes, {n_dt} detections, {args.classes} classes")
    dataset, results = coco_inputs(preds, targets, args.classes)
    gt = COCO()
    gt.dataset = dataset
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()

    ours_s: list[float] = []
    base_s: list[float] = []
    ours_metrics: dict[str, float] = {}
    ref_stats: list[float] = []
    for r in range(args.rounds):
        base_results = [dict(d, bbox=list(d["bbox"])) for d in results]  # loadRes writes into them

        def baseline(res: list[dict[str, Any]] = base_results) -> None:
            with contextlib.redirect_stdout(io.StringIO()):
                coco = COCOeval(gt, gt.loadRes(res), "bbox")
                coco.evaluate()
                coco.accumulate()
                coco.summarize()
            ref_stats[:] = [float(v) for v in coco.stats]

        def ours() -> None:
            ours_metrics.clear()
            ours_metrics.update(run_ours(preds, targets, names))

        base_s.append(timed(baseline))
        ours_s.append(timed(ours))
        for name, expected in zip(COCO_STAT_NAMES, ref_stats, strict=True):
            got = ours_metrics.get(name, -1.0)
            if abs(got - expected) > 1e-12:
                raise SystemExit(f"round {r}: {name} {got} != pycocotools' {expected}")
        print(f"round {r}: pycocotools {base_s[-1]:6.2f} s   visionloop {ours_s[-1]:6.2f} s   "
              f"mAP {ours_metrics['mAP']:.4f} (equal to pycocotools')")  # fmt: skip
    ratio = median(ours_s) / median(base_s)
    print(f"median: pycocotools {median(base_s):.2f} s   visionloop {median(ours_s):.2f} s   "
          f"ratio {ratio:.3f}  (target <= {TARGET})")  # fmt: skip
    path = write_result(
        "det_eval",
        {
            "config": vars(args),
            "true_boxes": n_gt,
            "detections": n_dt,
            "pycocotools_s": base_s,
            "visionloop_s": ours_s,
            "ratio": ratio,
            "target": TARGET,
            "mAP": ours_metrics["mAP"],
            "stats_equal_to_pycocotools": True,
        },
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
