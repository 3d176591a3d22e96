"""Trainer overhead: visionloop's training throughput over a bare PyTorch loop.

Same model, same data (the same shard loader, transforms and normalisation), same device,
same batch size, measured alternately in one run. visionloop runs with everything a real run
has — MLflow tracking of every step, system metrics, the LR scheduler, stop-signal checks,
checkpoint policy — except evaluation, which the bare loop does not do either. Throughput is
taken between step `--warmup` and the last step, from per-step timestamps on both sides
(each side syncs on the loss every step: the trainer logs every step, the bare loop calls
.item()).

    python benchmarks/trainer_overhead.py [--steps 80] [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from _common import median, write_result

CONFIGS = {
    "small_cnn@32": {"arch": "small_cnn", "image_size": 32, "batch": 64},
    "resnet18@64": {"arch": "resnet18", "image_size": 64, "batch": 32},
}


def build_dataset(root: Path) -> Path:
    from visionloop.cli.demo import write_digits_imagefolder
    from visionloop.data.ingest import IngestOptions, ingest

    write_digits_imagefolder(root / "images", scale=4)
    return ingest(root / "images", root / "ds", IngestOptions(val_fraction=0.1, workers=2)).out


def spec_for(dataset: Path, cfg: dict[str, Any], steps: int) -> Any:
    from visionloop.specs import validate_train_spec

    data = {
        "dataset": str(dataset),
        "batch_size": cfg["batch"],
        "workers": 2,
        "image_size": cfg["image_size"],
        "augment": {"hflip": 0.0},
    }
    return validate_train_spec(
        {
            "data": data,
            "model": {"arch": cfg["arch"]},
            "optimizer": {"name": "adamw", "lr": 1e-3},
            "steps": steps,
            "eval": {"every_epochs": 1_000_000},
            "tracking": {"experiment": "bench", "log_every_steps": 1},
        }
    )


def visionloop_run(spec: Any, run_dir: Path, warmup: int) -> float:
    from visionloop.train.api import train
    from visionloop.train.report import Reporter

    stamps: dict[int, float] = {}

    class Clock(Reporter):
        def step(self, step: int, loss: float | None, lr: float, images_per_s: float | None) -> None:
            stamps[step] = time.perf_counter()

    train(spec, run_dir, reporter=Clock())
    last = max(stamps)
    return (last - warmup) * spec.data.batch_size / (stamps[last] - stamps[warmup])


def bare_run(spec: Any, warmup: int) -> float:
    """The textbook loop over the same loader, model and optimizer family."""
    from visionloop.data.loader import make_loader
    from visionloop.data.manifest import read_manifest
    from visionloop.data.normalize import Normalizer
    from visionloop.data.sampler import ResumableBatchSampler
    from visionloop.data.shards import ShardReader
    from visionloop.models import create_model
    from visionloop.tasks.classification.task import ClassificationTask
    from visionloop.train.setup import normalization

    torch.manual_seed(0)
    m = read_manifest(spec.data.dataset)
    reader = ShardReader(spec.data.dataset / m.splits["train"].shard_dir)
    ds = ClassificationTask().train_dataset(reader, spec)
    sampler = ResumableBatchSampler(reader.chunk_sizes, spec.data.batch_size, seed=0)
    loader = make_loader(ds, sampler, workers=spec.data.workers)
    norm = Normalizer(*normalization(spec, m))
    model = create_model(spec.model.arch, m.num_classes)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.optimizer.lr)
    loss_fn = torch.nn.CrossEntropyLoss()
    model.train()
    stamps: dict[int, float] = {}
    step, epoch = 0, 0
    while step < spec.steps:
        sampler.set_position(epoch, 0)
        for x, y in loader:
            loss = loss_fn(model(norm(x)), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss.item()
            step += 1
            stamps[step] = time.perf_counter()
            if step >= spec.steps:
                break
        epoch += 1
    it = getattr(loader, "_iterator", None)
    if it is not None:
        it._shutdown_workers()
    return (step - warmup) * spec.data.batch_size / (stamps[step] - stamps[warmup])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    args = ap.parse_args()

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        import os

        os.environ["VISIONLOOP_HOME"] = str(Path(tmp) / "home")  # a private MLflow store
        dataset = build_dataset(Path(tmp))
        for name in args.configs:
            spec = spec_for(dataset, CONFIGS[name], args.steps)
            bare, ours = [], []
            for r in range(args.rounds):  # alternate: machine drift hits both alike
                bare.append(bare_run(spec, args.warmup))
                ours.append(visionloop_run(spec, Path(tmp) / f"run-{name}-{r}", args.warmup))
            ratio = median(ours) / median(bare)
            results[name] = {"bare_images_per_s": bare, "visionloop_images_per_s": ours, "ratio": ratio}
            print(f"{name:14s} bare {median(bare):7.0f} img/s   visionloop {median(ours):7.0f} img/s   "
                  f"ratio {ratio:.3f}  (target >= 0.97)")  # fmt: skip
    path = write_result("trainer_overhead", {"config": vars(args), "results": results, "target": 0.97})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
