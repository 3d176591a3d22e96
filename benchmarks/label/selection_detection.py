"""Active-learning selection for detection: labels needed to reach random sampling's final mAP.

Pool: synthetic 64x64 detection scenes from the project's own generator
(`visionloop.tasks.detection.synthetic.render_image`, no download): zero to three handwritten
digits 0, 1 and 2 (the classes) pasted on textured backgrounds with clutter and occluders, ~8%
of the images empty. Per seed, `--pool` images drawn with the generator's "train" handwriting
are the pool, whose boxes are hidden from the strategies and revealed only for the images they
pick, and `--test` images drawn with the "holdout" handwriting are the test set. Every strategy
starts from the same `--start` random labelled images and acquires `--step` images a round,
through `visionloop.label.select.select`, until `--final` labels. Each round the project's
native detector (`build_detector("native_detector")`, widths 8-16-24-32, neck 16) is trained
from scratch on the labelled images (same initialisation, batches and `--train-steps` steps
for every strategy at a given seed and round, so the strategies differ only in which images
they labelled; CPU, one torch thread, deterministic), its test mAP computed by the detection
task's `DetectionEvaluator` (COCO's protocol), and its post-NMS box scores of each pool image
(`Pool.detection_scores`) and its embeddings (the neck's stride-4 map the heads read,
average-pooled: 16-d) of the pool and the labelled set handed to the next selection. A
training whose labelled set some strategy already trained on (every strategy's first round)
is reused, not repeated.

Strategies: random; entropy (margin and least_confidence rank a detector's images exactly as
entropy does under the default `--box-aggregate max`: all three are decreasing in a box's
|score - 0.5|, so they are left out of the default list); kcenter and hybrid on the pooled
embeddings. Balanced does not apply: it spreads picks over one class per image (a predicted
class or a classifier's probabilities), and a detection image holds several objects of
several classes, or none.

Headline, per seed: the labels a strategy needs to first reach the `--metric` (COCO mAP@[.5:.95]
by default; mAP50 is reported too) random sampling has at `--final` labels (the same
first-crossing rule applied to random itself, whose noisy curve may cross earlier); the ratio
to random's (target: <= 0.7, "30% fewer labels"), mean ± std over seeds, and the saving
against `--final` itself. A strategy that never reaches the target within `--final` is
reported as "> final" and counted as `--final` + `--step` in the means (so the means flatter
it). Also counted: the truly empty images each strategy labelled (uncertainty scores an image
without boxes as most uncertain). Near-duplicate filtering is off (generated scenes do not
repeat).

Cost: a round is one training (300 steps of 16 images: ~14 CPU-s on one core of a shared
2-core VM) and ~2 CPU-s of inference and COCO evaluation; the defaults (3 seeds, 4 strategies,
8 rounds) make 87 trainings, ~24 CPU-minutes in all.

    python benchmarks/label/selection_detection.py [--seeds 0,1,2] [--start 20] [--step 20]
        [--final 160] [--strategies random,entropy,kcenter,hybrid] [--pool 1000] [--test 500]
        [--train-steps 300] [--metric mAP] [--box-aggregate max]
"""

from __future__ import annotations

import os

# One torch thread (set before torch is imported): deterministic, and fair on a shared machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import write_result
from label._curves import Column, print_table, summarise
from visionloop.label.select import STRATEGIES, Pool, SelectOptions, select
from visionloop.tasks.detection.archs import build_detector
from visionloop.tasks.detection.metrics import DetectionEvaluator
from visionloop.tasks.detection.synthetic import Exemplars, render_image

SIZE = 64
DIGITS = (0, 1, 2)  # the classes
CLASS_NAMES = [str(d) for d in DIGITS]
MAX_OBJECTS, BACKGROUND_FRACTION, DIGIT_SIZE = 3, 0.08, (12, 28)  # per scene; digit side in pixels
WIDTHS, NECK = (8, 16, 24, 32), 16
BATCH = 16
LR, WEIGHT_DECAY = 4e-3, 1e-4  # AdamW, cosine to 0 over the steps (the detection demo's optimiser)
METRICS = ("mAP", "mAP50")
INFER_BATCH = 100


def scenes(n: int, seed: int, exemplars: Exemplars) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """n generated scenes; image i depends on (seed, i) only."""
    images, targets = [], []
    for i in range(n):
        r = render_image(
            np.random.default_rng([seed, i]),
            image_size=(SIZE, SIZE),
            classes=DIGITS,
            max_objects=MAX_OBJECTS,
            background_fraction=BACKGROUND_FRACTION,
            digit_size=DIGIT_SIZE,
            exemplars=exemplars,
        )
        images.append(torch.from_numpy(r.pixels).permute(2, 0, 1).float() / 255.0)
        targets.append(
            {
                "boxes": torch.tensor(r.boxes, dtype=torch.float32).reshape(-1, 4),
                "labels": torch.tensor(r.labels, dtype=torch.int64),  # 0-based
            }
        )
    return torch.stack(images), targets


def train(x: torch.Tensor, targets: list[dict[str, torch.Tensor]], seed: int, steps: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = build_detector("native_detector", len(CLASS_NAMES), image_size=SIZE, widths=WIDTHS, neck=NECK)
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    gen = torch.Generator().manual_seed(seed)
    net.train()
    for _ in range(steps):
        idx = torch.randint(len(x), (min(BATCH, len(x)),), generator=gen).tolist()
        # The model takes torchvision's 1-based labels (0 is background).
        batch = [{"boxes": targets[i]["boxes"], "labels": targets[i]["labels"] + 1} for i in idx]
        losses = net(list(x[idx]), batch)
        opt.zero_grad()
        sum(losses.values()).backward()
        opt.step()
        sched.step()
    return net.eval()


@torch.no_grad()
def infer(net: torch.nn.Module, x: torch.Tensor) -> tuple[list[dict[str, torch.Tensor]], np.ndarray]:
    """Post-NMS detections (0-based labels) and the average-pooled neck map, per image."""
    pooled: list[torch.Tensor] = []
    hook = net.smooth2.register_forward_hook(lambda _m, _i, out: pooled.append(out.mean(dim=(2, 3))))
    try:
        dets = []
        for s in range(0, len(x), INFER_BATCH):
            for d in net(list(x[s : s + INFER_BATCH])):
                dets.append({"boxes": d["boxes"], "scores": d["scores"], "labels": d["labels"] - 1})
    finally:
        hook.remove()
    return dets, torch.cat(pooled).double().numpy()


def evaluate(dets: list[dict[str, torch.Tensor]], targets: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    ev = DetectionEvaluator(CLASS_NAMES)
    ev.update(dets, targets)
    got = ev.compute()
    return {m: got.get(m, 0.0) for m in METRICS}


def run_strategy(
    strategy: str, data: dict[str, Any], seed: int, args: argparse.Namespace, trained: dict[Any, Any]
) -> tuple[list[int], dict[str, list[float]], float, list[int]]:
    x_pool, t_pool, x_test, t_test = data["x_pool"], data["t_pool"], data["x_test"], data["t_test"]
    options = SelectOptions(box_aggregate=args.box_aggregate)
    labelled = [int(i) for i in data["start"]]
    counts: list[int] = []
    maps: dict[str, list[float]] = {m: [] for m in METRICS}
    empties: list[int] = []  # labelled images without any object, per round
    select_s = 0.0
    for rnd in range(1 + (args.final - args.start) // args.step):
        last = len(labelled) >= args.final
        key = tuple(labelled)
        if key not in trained:  # the same labelled set (so the same round) trains the same nets
            nets = [
                train(
                    x_pool[labelled],
                    [t_pool[i] for i in labelled],
                    seed * 1000 + rnd * 10 + m,
                    args.train_steps,
                )
                for m in range(args.models)
            ]
            # mAP: the mean over --models initialisations; the selection uses the first, as it
            # would the one deployed model.
            per_net = [evaluate(infer(n, x_test)[0], t_test) for n in nets]
            got = {m: statistics.mean(p[m] for p in per_net) for m in METRICS}
            outputs = None
            if not last:
                taken = set(labelled)
                rest = [i for i in range(len(x_pool)) if i not in taken]
                dets, emb = infer(nets[0], x_pool[rest])
                _, lab_emb = infer(nets[0], x_pool[labelled])
                outputs = (rest, [d["scores"].double().numpy() for d in dets], emb, lab_emb)
            trained[key] = (got, outputs)
        got, outputs = trained[key]
        counts.append(len(labelled))
        for m in METRICS:
            maps[m].append(got[m])
        empties.append(sum(len(t_pool[i]["labels"]) == 0 for i in labelled))
        if last:
            break
        rest, scores, emb, lab_emb = outputs
        pool = Pool(ids=tuple(f"{i:05d}" for i in rest), detection_scores=scores, embeddings=emb)
        t0 = time.process_time()
        sel = select(
            pool, strategy, args.step, seed=seed * 1000 + rnd, labelled_embeddings=lab_emb, options=options
        )
        select_s += time.process_time() - t0
        labelled += [int(i) for i in sel.ids]
    return counts, maps, select_s, empties


def _empty_labelled(curve: dict[str, Any], budget: int) -> float:
    return float(curve["empty_labelled"][curve["labels"].index(budget)])


EMPTY: Column = ("empty_labelled", _empty_labelled)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--start", type=int, default=20)
    ap.add_argument("--step", type=int, default=20)
    ap.add_argument("--final", type=int, default=160)
    ap.add_argument("--also-at", default="80,120", help="smaller budgets to report from the same curves")
    ap.add_argument("--strategies", default="random,entropy,kcenter,hybrid")
    ap.add_argument("--pool", type=int, default=1000, help="unlabelled pool images per seed")
    ap.add_argument("--test", type=int, default=500, help="test images per seed")
    ap.add_argument("--train-steps", type=int, default=300, help="optimiser steps per training (batch 16)")
    ap.add_argument("--models", type=int, default=1, help="initialisations averaged per mAP point")
    ap.add_argument("--metric", choices=METRICS, default="mAP", help="the headline's metric")
    ap.add_argument("--box-aggregate", choices=("max", "mean", "sum"), default="max")
    ap.add_argument("--name", default="label_selection_detection")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    seeds = [int(s) for s in args.seeds.split(",")]
    strategies = ["random", *[s for s in args.strategies.split(",") if s != "random"]]
    if "balanced" in strategies:
        ap.error(
            "balanced does not apply to detection: it spreads picks over one class per image, and a "
            "detection image holds several objects of several classes, or none"
        )
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        ap.error(
            f"unknown strategies {unknown}; choose from {', '.join(s for s in STRATEGIES if s != 'balanced')}"
        )
    if (args.final - args.start) % args.step or not 0 < args.start < args.final:
        ap.error("--final must be --start plus a whole number of --step, and above --start")
    if args.pool <= args.final:
        ap.error("--pool must hold more images than --final")
    rounds = [args.start + i * args.step for i in range(1 + (args.final - args.start) // args.step)]
    budgets = [b for b in (int(x) for x in args.also_at.split(",") if x) if b in rounds and b < args.final]
    budgets.append(args.final)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    per_seed: list[dict[str, Any]] = []
    for seed in seeds:
        x_pool, t_pool = scenes(args.pool, seed * 2, "train")
        x_test, t_test = scenes(args.test, seed * 2 + 1, "holdout")
        data = {
            "x_pool": x_pool,
            "t_pool": t_pool,
            "x_test": x_test,
            "t_test": t_test,
            "start": np.random.default_rng(10_000 + seed).choice(args.pool, args.start, replace=False),
        }
        trained: dict[Any, Any] = {}
        curves: dict[str, dict[str, Any]] = {}
        for strategy in strategies:
            t0 = time.process_time()
            counts, maps, select_s, empties = run_strategy(strategy, data, seed, args, trained)
            curves[strategy] = {
                "labels": counts,
                **maps,
                "empty_labelled": empties,
                "cpu_s": round(time.process_time() - t0, 1),
                "select_cpu_s": round(select_s, 3),
            }
            print(
                f"seed {seed} {strategy:<10} "
                + " ".join(f"{v:.3f}" for v in maps[args.metric])
                + f"  ({curves[strategy]['cpu_s']:.0f} CPU-s, selection {select_s:.2f}, "
                + f"{empties[-1]} empty labelled)",
                flush=True,
            )
        per_seed.append(
            {
                "seed": seed,
                "pool": args.pool,
                "test": args.test,
                "pool_empty_images": sum(len(t["labels"]) == 0 for t in t_pool),
                "curves": curves,
            }
        )

    summaries = {
        metric: {
            b: summarise(per_seed, strategies, b, metric, final=args.final, step=args.step, columns=(EMPTY,))
            for b in budgets
        }
        for metric in METRICS
    }
    for b in budgets:
        print_table(summaries[args.metric][b], b, args.metric, args.final, ("empty_labelled",))
    other = next(m for m in METRICS if m != args.metric)
    print_table(summaries[other][args.final], args.final, other, args.final, ("empty_labelled",))
    head = summaries[args.metric][args.final]
    best = min(
        (s for s in strategies if s != "random"), key=lambda s: head[s]["ratio_mean"], default="random"
    )
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    print(
        f"\nbest at {args.final}: {best}, {head[best]['ratio_mean']:.3f} of random's labels (target <= 0.7, "
        f"{args.metric}); {cpu:.0f} CPU-s, {wall:.0f} s wall"
    )
    path = write_result(
        args.name,
        {
            "config": {
                "seeds": seeds,
                "start": args.start,
                "step": args.step,
                "final": args.final,
                "pool": args.pool,
                "test": args.test,
                "image_size": SIZE,
                "classes": CLASS_NAMES,
                "scene": {
                    "max_objects": MAX_OBJECTS,
                    "background_fraction": BACKGROUND_FRACTION,
                    "digit_size": list(DIGIT_SIZE),
                    "pool_exemplars": "train",
                    "test_exemplars": "holdout",
                },
                "detector": {"arch": "native_detector", "widths": list(WIDTHS), "neck": NECK},
                "train_steps": args.train_steps,
                "batch": BATCH,
                "models_per_map": args.models,
                "optimiser": f"AdamW lr {LR:g}, weight decay {WEIGHT_DECAY:g}, cosine to 0",
                "metric": args.metric,
                "box_aggregate": args.box_aggregate,
                "embeddings": f"neck stride-4 map (smooth2), average-pooled, {NECK}-d",
            },
            "headline": {"metric": args.metric, "budget": args.final, "best": best, **head},
            "by_budget": {str(b): summaries[args.metric][b] for b in budgets},
            "by_metric": {m: {str(b): summaries[m][b] for b in budgets} for m in METRICS},
            "per_seed": per_seed,
            "cpu_s": round(cpu, 1),
            "wall_s": round(wall, 1),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
