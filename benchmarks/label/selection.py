"""Active-learning selection: labels needed to reach random sampling's final accuracy.

Pool: scikit-learn's digits (8x8, 10 classes, no download); per seed, a random 30% is held
out as the test set and the rest is the pool, whose labels are hidden from the strategies
and revealed only for the images they pick. Every strategy starts from the same `--start`
random labelled images and acquires `--step` images a round, through
`visionloop.label.select.select`, until `--final` labels. Each round a small CNN is trained
from scratch on the labelled images (same initialisation, batches and steps for every
strategy at a given seed and round, so the strategies differ only in which images they
labelled; CPU, one torch thread, deterministic), its test accuracy recorded, and its softmax
and penultimate-layer embeddings (64-d) of the pool and the labelled set handed to the next
selection. Balanced counts the labelled images' true classes.

Headline, per seed: the labels a strategy needs to first reach the accuracy random sampling
has at `--final` labels (the same first-crossing rule applied to random itself, whose noisy
curve may cross earlier); the ratio to random's (target: <= 0.7, "30% fewer labels"), mean
± std over seeds, and the saving against `--final` itself. A strategy that never reaches the
target within `--final` is reported as "> final" and counted as `--final` + `--step` in the
means (so the means flatter it). Near-duplicate filtering is off here (pHash of 8x8 digits
says little; `phash_threshold.py` measures it).

    python benchmarks/label/selection.py [--seeds 0,1,2] [--start 20] [--step 20] [--final 300]
        [--strategies random,entropy,margin,kcenter,hybrid,balanced]
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
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import write_result
from label._curves import print_table, summarise
from visionloop.label.select import Pool, select

TEST_FRACTION = 0.3
STEPS = 200  # optimiser steps per training, whatever the labelled set's size
BATCH = 32


class Net(nn.Module):
    """cnn: two 3x3 convolutions, a 2x2 pool, a 64-d embedding, the classifier;
    mlp: 64 -> 128 -> 64 (the embedding) -> 10."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        if kind == "cnn":
            self.features = nn.Sequential(
                nn.Conv2d(1, 16, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(16, 32, 3, padding=1),
                nn.ReLU(),
                nn.MaxPool2d(2),
                nn.Flatten(),
                nn.Linear(32 * 4 * 4, 64),
                nn.ReLU(),
            )
        else:
            self.features = nn.Sequential(
                nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU()
            )
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        emb = self.features(x)
        return self.head(emb), emb


def train(x: torch.Tensor, y: torch.Tensor, seed: int, kind: str) -> Net:
    torch.manual_seed(seed)
    net = Net(kind)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=1e-2)
    gen = torch.Generator().manual_seed(seed)
    net.train()
    for _ in range(STEPS):
        idx = torch.randint(len(x), (min(BATCH, len(x)),), generator=gen)
        loss = nn.functional.cross_entropy(net(x[idx])[0], y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net.eval()


@torch.no_grad()
def infer(net: Net, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    logits, emb = net(x)
    return torch.softmax(logits.double(), dim=1).numpy(), emb.double().numpy()


def run_strategy(
    strategy: str, data: dict[str, Any], seed: int, args: argparse.Namespace
) -> tuple[list[int], list[float], float]:
    x_pool, y_pool, x_test, y_test = data["x_pool"], data["y_pool"], data["x_test"], data["y_test"]
    labelled = list(data["start"])
    counts: list[int] = []
    accs: list[float] = []
    select_s = 0.0
    for rnd in range(1 + (args.final - args.start) // args.step):
        idx = torch.as_tensor(labelled)
        # Accuracy: the mean over --models initialisations, to damp the init's noise (~1 point
        # at these sizes); the selection uses the first, as it would the one deployed model.
        nets = [
            train(x_pool[idx], y_pool[idx], seed * 1000 + rnd * 10 + m, args.model)
            for m in range(args.models)
        ]
        with torch.no_grad():
            acc = statistics.mean(float((n(x_test)[0].argmax(1) == y_test).double().mean()) for n in nets)
        net = nets[0]
        counts.append(len(labelled))
        accs.append(acc)
        if len(labelled) >= args.final:
            break
        taken = set(labelled)
        rest = [i for i in range(len(x_pool)) if i not in taken]
        probs, emb = infer(net, x_pool[torch.as_tensor(rest)])
        _, lab_emb = infer(net, x_pool[idx])
        pool = Pool(ids=tuple(f"{i:05d}" for i in rest), probabilities=probs, embeddings=emb)
        t0 = time.process_time()
        sel = select(
            pool,
            strategy,
            args.step,
            seed=seed * 1000 + rnd,
            labelled_embeddings=lab_emb,
            labelled_classes=y_pool[idx].numpy(),
        )
        select_s += time.process_time() - t0
        labelled += [int(i) for i in sel.ids]
    return counts, accs, select_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--start", type=int, default=20)
    ap.add_argument("--step", type=int, default=20)
    ap.add_argument("--final", type=int, default=300)
    ap.add_argument("--also-at", default="100,200", help="smaller budgets to report from the same curves")
    ap.add_argument("--strategies", default="random,entropy,margin,kcenter,hybrid,balanced")
    ap.add_argument("--model", choices=("cnn", "mlp"), default="cnn")
    ap.add_argument("--models", type=int, default=3, help="initialisations averaged per accuracy point")
    ap.add_argument("--name", default="label_selection")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    seeds = [int(s) for s in args.seeds.split(",")]
    strategies = ["random", *[s for s in args.strategies.split(",") if s != "random"]]
    rounds = [args.start + i * args.step for i in range(1 + (args.final - args.start) // args.step)]
    budgets = [b for b in (int(x) for x in args.also_at.split(",") if x) if b in rounds and b < args.final]
    budgets.append(args.final)

    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.as_tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    images = (images - 0.3) / 0.4
    targets = torch.as_tensor(digits.target, dtype=torch.int64)

    cpu0, wall0 = time.process_time(), time.perf_counter()
    per_seed: list[dict[str, Any]] = []
    for seed in seeds:
        perm = np.random.default_rng(seed).permutation(len(targets))
        n_test = round(TEST_FRACTION * len(targets))
        test, pool_idx = perm[:n_test], perm[n_test:]
        data = {
            "x_pool": images[pool_idx],
            "y_pool": targets[pool_idx],
            "x_test": images[test],
            "y_test": targets[test],
            "start": np.random.default_rng(10_000 + seed).choice(len(pool_idx), args.start, replace=False),
        }
        curves: dict[str, dict[str, Any]] = {}
        for strategy in strategies:
            t0 = time.process_time()
            counts, accs, select_s = run_strategy(strategy, data, seed, args)
            curves[strategy] = {
                "labels": counts,
                "accuracy": accs,
                "cpu_s": round(time.process_time() - t0, 1),
                "select_cpu_s": round(select_s, 3),
            }
            print(
                f"seed {seed} {strategy:<10} "
                + " ".join(f"{a:.3f}" for a in accs)
                + f"  ({curves[strategy]['cpu_s']:.0f} CPU-s, selection {select_s:.2f})",
                flush=True,
            )
        per_seed.append({"seed": seed, "pool": len(pool_idx), "test": n_test, "curves": curves})

    summaries = {
        b: summarise(per_seed, strategies, b, "accuracy", final=args.final, step=args.step) for b in budgets
    }
    for b in budgets:
        print_table(summaries[b], b, "accuracy", args.final)
    head = summaries[args.final]
    best = min((s for s in strategies if s != "random"), key=lambda s: head[s]["ratio_mean"])
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    print(
        f"\nbest at {args.final}: {best}, {head[best]['ratio_mean']:.3f} of random's labels (target <= 0.7); "
        f"{cpu:.0f} CPU-s, {wall:.0f} s wall"
    )
    path = write_result(
        args.name,
        {
            "config": {
                "seeds": seeds,
                "start": args.start,
                "step": args.step,
                "final": args.final,
                "test_fraction": TEST_FRACTION,
                "train_steps": STEPS,
                "batch": BATCH,
                "model": args.model,
                "models_per_accuracy": args.models,
                "optimiser": "AdamW lr 3e-3, weight decay 1e-2",
            },
            "headline": {"budget": args.final, "best": best, **{s: head[s] for s in strategies}},
            "by_budget": {str(b): summaries[b] for b in budgets},
            "per_seed": per_seed,
            "cpu_s": round(cpu, 1),
            "wall_s": round(wall, 1),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
