"""Label errors planted in a detection dataset, looked for by `visionloop label issues --refit`.

Data: the detection demo's scenes (`get_task("detection").demo_source`: handwritten digits 0-4
on textured, cluttered backgrounds, up to four a scene, 96x96, no download), ingested with the
real COCO ingest. A noisy copy of the train split is then written (same images, same record
ids, val split unchanged): in a seeded random `--noise` share of the images that hold a box,
one box a image is made wrong, the three kinds in turn:

- swapped: the box's class changed to another class;
- overlooked: the box removed;
- badly located: the box shifted (half of them) or grown about its centre (the other half) so
  that its IoU with the true box is drawn uniformly from 0.3-0.5.

The demo's train spec (native detector, AdamW, cosine; `--epochs`) is trained on the noisy
dataset and registered (one epoch: only its saved spec matters here), then
`visionloop.label.refit.refit_issues` trains that spec `--folds` times with each fold held out
(`--set epochs=E`) and judges every image by the fold that never saw it. The judge's input,
the out-of-fold (outputs, targets) pairs, is recorded on the way (by wrapping
`label_quality.find_label_issues`), and judged again with and without score calibration
(`calibrate_scores`), so both are measured on the same predictions.

Measured per kind of planted error: recall (the error's image is flagged) and kind recall (its
findings also include a finding of that kind); and the precision of the flagged images (the
share that hold a planted error; the generator's own labels count as right). Also the
distribution of each image's out-of-fold maximum score, raw and calibrated, against
cleanlab's 0.95 and 0.5 thresholds.

Cost on a 2-core VM shared with other work: 7 to 11 minutes at the defaults (four trainings:
one epoch of 2,400 images to register, then three folds of 8 epochs of 1,600); `--epochs 14`
about half as much again.

    python benchmarks/label/issues_detection.py [--train 2400] [--val 200] [--epochs 8]
        [--folds 3] [--noise 0.15] [--seed 0] [--work DIR] [--out label_issues_detection]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import write_result
from visionloop.core.settings import Settings
from visionloop.data.ingest import IngestOptions, ingest
from visionloop.data.manifest import SplitInfo, read_manifest, write_manifest
from visionloop.data.shards import ShardReader, ShardWriter, extra_fields, make_record
from visionloop.tasks import get_task
from visionloop.tasks.detection import label_quality
from visionloop.tasks.detection.boxes import decode_boxes, encode_boxes

KINDS = ("swapped", "overlooked", "badly located")
SIZE = 96
IOU_RANGE = (0.3, 0.5)


def _iou(a: Sequence[float], b: Sequence[float]) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def misplace(box: Sequence[float], rng: np.random.Generator, side: int) -> list[float] | None:
    """`box` moved or grown, inside the image, to an IoU with itself in IOU_RANGE; None when
    no such box fits."""
    x1, y1, x2, y2 = (float(v) for v in box)
    w, h = x2 - x1, y2 - y1
    for _ in range(50):
        t = rng.uniform(*IOU_RANGE)
        if rng.random() < 0.5:  # shift along one axis: IoU = (w - d) / (w + d)
            axis = int(rng.integers(2))
            d = (w if axis == 0 else h) * (1 - t) / (1 + t) * rng.choice([-1.0, 1.0])
            new = [x1 + d, y1, x2 + d, y2] if axis == 0 else [x1, y1 + d, x2, y2 + d]
        else:  # grow about the centre by s per side: IoU = 1 / s^2
            s = 1 / np.sqrt(t)
            cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
            new = [cx - w * s / 2, cy - h * s / 2, cx + w * s / 2, cy + h * s / 2]
        new = [float(np.clip(v, 0, side)) for v in new]
        if (
            new[2] - new[0] > 1
            and new[3] - new[1] > 1
            and IOU_RANGE[0] - 0.02 <= _iou(new, box) <= IOU_RANGE[1]
        ):
            return new
    return None


def plant(clean: Path, noisy: Path, share: float, seed: int) -> dict[int, dict[str, Any]]:
    """Copy dataset `clean` to `noisy` with one wrong box in a `share` of its train images that
    hold a box; return the planted errors by train position."""
    if noisy.exists():
        shutil.rmtree(noisy)
    shutil.copytree(clean, noisy)
    m = read_manifest(clean)
    n_classes = len(m.classes)
    info = m.splits["train"]
    reader = ShardReader(clean / info.shard_dir)
    records = [reader[p] for p in range(len(reader))]
    decoded = [decode_boxes(r["boxes"], n_classes) for r in records]  # type: ignore[typeddict-item]
    with_boxes = [p for p, (b, _, _) in enumerate(decoded) if len(b)]
    rng = np.random.default_rng(seed)
    chosen = rng.choice(with_boxes, size=round(share * len(with_boxes)), replace=False)
    planted: dict[int, dict[str, Any]] = {}
    for k, pos in enumerate(sorted(int(p) for p in chosen)):
        boxes, labels, _ = decoded[pos]
        boxes, labels = boxes.astype(np.float64).copy(), labels.copy()
        kind = KINDS[k % len(KINDS)]
        b = int(rng.integers(len(boxes)))
        entry: dict[str, Any] = {
            "kind": kind,
            "box": [round(float(v), 2) for v in boxes[b]],
            "class": int(labels[b]),
        }
        if kind == "swapped":
            labels[b] = (labels[b] + rng.integers(1, n_classes)) % n_classes
            entry["given_class"] = int(labels[b])
        elif kind == "overlooked":
            boxes, labels = np.delete(boxes, b, axis=0), np.delete(labels, b)
        else:
            moved = misplace(boxes[b], rng, SIZE)
            if moved is None:
                continue
            entry["given_box"] = [round(v, 2) for v in moved]
            entry["iou"] = round(_iou(moved, boxes[b]), 3)
            boxes[b] = moved
        decoded[pos] = (boxes.astype(np.float32), labels, np.zeros(len(labels), dtype=bool))
        planted[pos] = entry
    shutil.rmtree(noisy / info.shard_dir)
    writer = ShardWriter(noisy / info.shard_dir)
    per_class = dict.fromkeys(m.classes, 0)
    for r, (boxes, labels, _) in zip(records, decoded, strict=True):
        for c in labels:
            per_class[m.classes[int(c)]] += 1
        fields = {**extra_fields(r), "boxes": encode_boxes(boxes, labels)}
        writer.add(make_record(r["image"], len(labels), r["index"], **fields))
    writer.close()
    split = SplitInfo(count=len(records), per_class=per_class, shard_dir=info.shard_dir, bytes=writer.bytes)
    # task_stats (object counts and sizes) are the clean split's: left out rather than stale.
    write_manifest(
        noisy,
        m.model_copy(
            update={
                "version": f"{m.version[:16]}-noisy{seed}",
                "splits": {**m.splits, "train": split},
                "task_stats": None,
            }
        ),
    )
    return planted


SPEC = {
    "task": "detection",
    "data": {
        "batch_size": 32,
        "workers": 1,
        "image_size": SIZE,
        "augment": {"random_resized_crop": False, "hflip": 0.0},
    },
    "model": {"arch": "native_detector"},
    "optimizer": {"name": "adamw", "lr": 0.004, "weight_decay": 0.0001},
    "schedule": {"name": "cosine", "warmup_epochs": 0.3},
    "seed": 0,
    "deterministic": True,
    "checkpoint": {"every_steps": 200, "keep_last": 1, "keep_best": 1},
    "tracking": {"enabled": False},
}  # the detection demo's spec (cli/demo_detection.py), tracking off


def score_stats(max_scores: Sequence[float]) -> dict[str, float]:
    x = np.asarray(max_scores, dtype=np.float64)
    q = np.percentile(x, [10, 25, 50, 75, 90]) if len(x) else [0.0] * 5
    return {
        "p10": round(float(q[0]), 4),
        "p25": round(float(q[1]), 4),
        "median": round(float(q[2]), 4),
        "p75": round(float(q[3]), 4),
        "p90": round(float(q[4]), 4),
        "max": round(float(x.max()), 4) if len(x) else 0.0,
        "share_ge_0.5": round(float((x >= 0.5).mean()), 4) if len(x) else 0.0,
        "share_ge_0.95": round(float((x >= 0.95).mean()), 4) if len(x) else 0.0,
    }


def measure(found: Sequence[Any], planted: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Recall per planted kind and precision of the flagged images; `found` are the judge's
    ImageLabelIssues, whose `item` is the train position (refit predicts every position)."""
    flagged = {int(f.item): {x.kind for x in f.findings} for f in found}
    per_kind: dict[str, Any] = {}
    for kind in KINDS:
        mine = [p for p, e in planted.items() if e["kind"] == kind]
        hit = [p for p in mine if p in flagged]
        right = [p for p in hit if kind in flagged[p]]
        per_kind[kind] = {
            "planted": len(mine),
            "flagged": len(hit),
            "recall": round(len(hit) / max(len(mine), 1), 4),
            "kind_recall": round(len(right) / max(len(mine), 1), 4),
        }
    true = [p for p in flagged if p in planted]
    kinds_seen: dict[str, int] = {}
    for p, ks in flagged.items():
        if p not in planted:
            for k in ks:
                kinds_seen[k] = kinds_seen.get(k, 0) + 1
    return {
        "flagged_images": len(flagged),
        "flagged_with_planted": len(true),
        "precision": round(len(true) / max(len(flagged), 1), 4),
        "recall": round(len(true) / max(len(planted), 1), 4),
        "per_kind": per_kind,
        "false_flag_findings_by_kind": kinds_seen,
    }


def ranking(
    labels: Sequence[dict[str, Any]], predictions: Sequence[Any], planted: dict[int, dict[str, Any]]
) -> dict[str, Any]:
    """The review-budget view: every image ranked by cleanlab's label quality score (lowest
    first, what `label issues --top N` hands a reviewer), and the share of planted errors among
    the first k, for k = the number planted and twice that, plus the ranking's average
    precision (random ranking: the share of images with an error)."""
    import contextlib
    import io

    from cleanlab.object_detection.rank import get_label_quality_scores

    with contextlib.redirect_stdout(io.StringIO()):
        quality = np.asarray(get_label_quality_scores(list(labels), list(predictions)))
    order = np.argsort(quality, kind="stable")
    hit = np.asarray([int(p) in planted for p in order], dtype=float)
    n = len(planted)
    out: dict[str, Any] = {"base_rate": round(n / len(order), 4)}
    for k in (n, 2 * n):
        out[f"precision_at_{k}"] = round(float(hit[:k].mean()), 4)
        out[f"recall_at_{k}"] = round(float(hit[:k].sum() / max(n, 1)), 4)
    ranks = np.flatnonzero(hit) + 1
    out["average_precision"] = round(float(np.mean(np.arange(1, len(ranks) + 1) / ranks)), 4) if n else 0.0
    for kind in KINDS:
        mine = {p for p, e in planted.items() if e["kind"] == kind}
        out[f"recall_at_{n}_{kind}"] = round(sum(int(p) in mine for p in order[:n]) / max(len(mine), 1), 4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=int, default=2400)
    ap.add_argument("--val", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=8, help="of each fold's training")
    ap.add_argument("--folds", type=int, default=3)
    ap.add_argument(
        "--noise", type=float, default=0.15, help="share of the train images with a box given one error"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--work", type=Path, default=None, help="keep the datasets and folds here (default: a temp dir)"
    )
    ap.add_argument("--out", default="label_issues_detection")
    args = ap.parse_args()

    from visionloop.label.refit import refit_issues
    from visionloop.registry import register
    from visionloop.specs import load_train_spec
    from visionloop.train.api import train

    started = time.monotonic()
    tmp = None if args.work else tempfile.TemporaryDirectory(prefix="vl-issues-det-")
    root = args.work or Path(tmp.name)  # type: ignore[union-attr]
    root.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    t0 = time.monotonic()
    get_task("detection").demo_source(root / "source", args.train, args.val, image_size=SIZE)
    ingest(root / "source", root / "clean", IngestOptions(seed=0, overwrite=True, workers=2))
    planted = plant(root / "clean", root / "noisy", args.noise, args.seed)
    timings["data_s"] = round(time.monotonic() - t0, 1)
    counts = {k: sum(e["kind"] == k for e in planted.values()) for k in KINDS}
    print(f"{args.train} train images, {len(planted)} with a planted error: {counts}", flush=True)

    home = root / "home"
    settings = Settings(home=home, tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    doc = json.loads(json.dumps(SPEC))
    doc["data"]["dataset"] = str(root / "noisy")
    doc["epochs"] = 1
    (root / "spec.yaml").write_text(yaml.safe_dump(doc))
    t0 = time.monotonic()
    run = root / "run"
    if not (run / "model_card.json").exists():
        spec, resolved = load_train_spec(root / "spec.yaml")
        result = train(spec, run, resolved=resolved, settings=settings, track=False)
        assert result.exit_code == 0, result
    info = register(run, name="digit-det-noisy", settings=settings)
    timings["register_s"] = round(time.monotonic() - t0, 1)

    captured: list[Any] = []
    judge = label_quality.find_label_issues

    def recording(results: Sequence[tuple[Any, Any]], class_names: Sequence[str], **kw: Any) -> Any:
        captured.append((list(results), list(class_names)))
        return judge(results, class_names, **kw)

    t0 = time.monotonic()
    label_quality.find_label_issues = recording  # type: ignore[assignment]
    try:
        report, runs = refit_issues(
            info.ref,
            settings,
            work_dir=root / "folds",
            folds=args.folds,
            seed=args.seed,
            overrides=[f"epochs={args.epochs}"],
            progress=lambda what, k, n: print(
                f"  {what}: {k}/{n} ({time.monotonic() - t0:.0f} s)", flush=True
            ),
        )
    finally:
        label_quality.find_label_issues = judge  # type: ignore[assignment]
    timings["refit_s"] = round(time.monotonic() - t0, 1)
    pairs, names = captured[0]
    assert len(pairs) == report.images

    raw_max = [float(np.max(np.asarray(o[0]["scores"]), initial=0.0)) for o, _ in pairs]
    labels, preds = label_quality._as_cleanlab(pairs, len(names))
    cal = label_quality.calibrate_scores(labels, preds)
    cal_max = [
        max((float(np.max(p[:, 4], initial=0.0)) for p in per_class), default=0.0) for per_class in cal
    ]

    results: dict[str, Any] = {}
    for mode, flag in (("raw", False), ("calibrated", True)):
        t0 = time.monotonic()
        found = judge(pairs, names, calibrate=flag)
        results[mode] = {**measure(found, planted), "judge_s": round(time.monotonic() - t0, 2)}
        results[mode]["ranking"] = ranking(labels, cal if flag else preds, planted)

    print(
        f"\nout-of-fold: {report.oof_metrics}; max score per image raw {score_stats(raw_max)}; "
        f"calibrated {score_stats(cal_max)}"
    )
    print(f"\n{'scores':<11} {'kind':<14} {'planted':>7} {'flagged':>7} {'recall':>7} {'kind recall':>11}")
    for mode, r in results.items():
        for kind, k in r["per_kind"].items():
            print(
                f"{mode:<11} {kind:<14} {k['planted']:>7} {k['flagged']:>7} {k['recall']:>7.3f} "
                f"{k['kind_recall']:>11.3f}"
            )
        print(
            f"{mode:<11} {'all':<14} {len(planted):>7} {r['flagged_with_planted']:>7} {r['recall']:>7.3f}"
            f"   flagged images {r['flagged_images']}, precision {r['precision']:.3f}"
        )
        print(f"{mode:<11} ranked by label quality: {r['ranking']}")
    timings["total_s"] = round(time.monotonic() - started, 1)
    path = write_result(
        args.out,
        {
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "images": {
                "train": args.train,
                "val": args.val,
                "planted": len(planted),
                "planted_by_kind": counts,
            },
            "oof_metrics": report.oof_metrics,
            "refit_flagged_images": len(report.issues),
            "folds": [
                {"fold": r.fold, "trained_images": r.trained_images, "held_out": r.held_out} for r in runs
            ],
            "oof_max_score": {"raw": score_stats(raw_max), "calibrated": score_stats(cal_max)},
            "results": results,
            "baseline": "raw scores (calibrate=False): cleanlab on the detector's own scores",
            "ratio_recall_calibrated_to_raw": (
                round(results["calibrated"]["recall"] / results["raw"]["recall"], 3)
                if results["raw"]["recall"]
                else None
            ),
            "timings": timings,
        },
    )
    print(f"\n{timings}\nwrote {path}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
