"""Detection trainer overhead: visionloop's training throughput over a bare torchvision-style loop.

Same detector, same data (the same shard loader, `DetectionTask` train transform and collate),
same device (CPU), same batch size, measured alternately in one run. visionloop runs with
everything a real run has — MLflow tracking of every step, system metrics, the LR scheduler,
stop-signal checks, checkpoint policy — except evaluation, which the bare loop does not do
either. The bare loop is the textbook torchvision detection loop:

    loss = sum(model(list(images), targets_with_labels_plus_1).values()); loss.backward(); ...

Throughput is taken between step `--warmup` and the last step, from per-step timestamps on
both sides (each side syncs on the loss every step: the trainer logs every step, the bare loop
calls .item()).

Both sides train the *same model on the same batches*: the bare loop seeds as the trainer does
before building the model (`seed_everything(spec.seed)`), samples with the trainer's sampler
settings (seed, shuffle window) and loader seed, and uses the trainer's optimizer parameter
groups. That matters for two-stage detectors: a Faster R-CNN step's cost depends on its
weights and its batch (how many proposals survive the RPN's NMS), so two different models are
not a comparison of loops. The run checks it: the first losses of both sides must agree
(`losses_match` in the results); a mismatch is printed.

    python benchmarks/det_trainer_overhead.py [--steps 50] [--rounds 3] [--threads 1] [--workers 1]
                                              [--configs native_detector@96 ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, write_result

CONFIGS: dict[str, dict[str, Any]] = {
    "native_detector@96": {"arch": "native_detector", "image_size": 96, "batch": 32},
    "ssdlite320_mobilenet_v3_large@160": {
        "arch": "ssdlite320_mobilenet_v3_large",
        "image_size": 160,
        "batch": 8,
    },
    "fasterrcnn_mobilenet_v3_large_320_fpn@128": {
        "arch": "fasterrcnn_mobilenet_v3_large_320_fpn",
        "image_size": 128,
        "batch": 8,
    },
}
# Faster R-CNN is opt-in, to keep the default run under ~5 minutes on 2 cores (BENCHMARKS.md).
DEFAULT_CONFIGS = ["native_detector@96", "ssdlite320_mobilenet_v3_large@160"]


def build_dataset(root: Path, n_images: int) -> Path:
    """Synthetic digit scenes (96x96 PNG, COCO) ingested into shards, as the detection demo does."""
    from visionloop.data.ingest import IngestOptions, ingest
    from visionloop.tasks.detection.synthetic import generate_detection_dataset

    generate_detection_dataset(root / "source", n_images, image_size=96, seed=0)
    return ingest(root / "source", root / "ds", IngestOptions(seed=0, workers=2)).out


def spec_for(dataset: Path, cfg: dict[str, Any], steps: int, workers: int) -> Any:
    from visionloop.specs import validate_train_spec

    return validate_train_spec(
        {
            "task": "detection",
            "data": {
                "dataset": str(dataset),
                "batch_size": cfg["batch"],
                "workers": workers,
                "image_size": cfg["image_size"],
                "augment": {"random_resized_crop": False, "hflip": 0.0},
            },
            "model": {"arch": cfg["arch"]},
            "optimizer": {"name": "adamw", "lr": 1e-3},
            "steps": steps,
            "eval": {"every_epochs": 1_000_000},
            "tracking": {"experiment": "bench", "log_every_steps": 1},
        }
    )


def visionloop_run(spec: Any, run_dir: Path, warmup: int) -> tuple[float, list[float]]:
    """Images/s between step `warmup` and the last, and the loss of every step."""
    from visionloop.train.api import train
    from visionloop.train.report import Reporter

    stamps: dict[int, float] = {}
    losses: list[float] = []

    class Clock(Reporter):
        def step(self, step: int, loss: float | None, lr: float, images_per_s: float | None) -> None:
            stamps[step] = time.perf_counter()
            losses.append(float("nan") if loss is None else loss)

    train(spec, run_dir, reporter=Clock())
    last = max(stamps)
    return float((last - warmup) * spec.data.batch_size / (stamps[last] - stamps[warmup])), losses


def bare_run(spec: Any, warmup: int) -> tuple[float, list[float]]:
    """The textbook torchvision detection loop over the same loader, model and batches."""
    from visionloop.data.loader import make_loader
    from visionloop.data.manifest import read_manifest
    from visionloop.data.normalize import Normalizer
    from visionloop.data.sampler import ResumableBatchSampler
    from visionloop.data.shards import ShardReader
    from visionloop.tasks.detection.task import DetectionTask
    from visionloop.train.rng import seed_everything
    from visionloop.train.schedule import build_optimizer, build_scheduler

    seed_everything(spec.seed)  # as train() does before building: the same initial weights
    task = DetectionTask()
    m = read_manifest(spec.data.dataset)
    reader = ShardReader(spec.data.dataset / m.splits["train"].shard_dir)
    ds = task.train_dataset(reader, spec)
    sampler = ResumableBatchSampler(
        reader.chunk_sizes, spec.data.batch_size, seed=spec.seed, window=spec.data.shuffle_window
    )
    loader = make_loader(ds, sampler, workers=spec.data.workers, seed=spec.seed, collate_fn=task.collate)
    # The detectors normalise their own input: uint8 → [0, 1] float, as the trainer does.
    to_float = Normalizer((0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    model = task.build_model(spec.model.arch, m.classes, kwargs={}, image_size=spec.data.image_size)
    opt = build_optimizer(model, spec.optimizer)  # the same parameter groups (no decay on norms)
    # The same LR schedule, stepped every iteration as torchvision's detection reference does.
    steps_per_epoch = len(reader) // spec.data.batch_size
    schedule = build_scheduler(opt, spec.schedule, spec.steps, steps_per_epoch)
    model.train()
    stamps: dict[int, float] = {}
    losses: list[float] = []
    step, epoch = 0, 0
    while step < spec.steps:
        sampler.set_position(epoch, 0)
        for x, targets in loader:
            images = to_float(x)
            model_targets = [{"boxes": t["boxes"], "labels": t["labels"] + 1} for t in targets]
            loss = sum(model(list(images), model_targets).values())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            schedule.step()
            losses.append(loss.item())
            step += 1
            stamps[step] = time.perf_counter()
            if step >= spec.steps:
                break
        epoch += 1
    it = getattr(loader, "_iterator", None)
    if it is not None:
        it._shutdown_workers()
    return (step - warmup) * spec.data.batch_size / (stamps[step] - stamps[warmup]), losses


def same_losses(a: list[float], b: list[float], n: int = 5) -> bool:
    """The first `n` steps' losses agree: the two sides train the same model on the same data.
    (Later steps may drift apart by float rounding in a different summation order.)"""
    if len(a) < n or len(b) < n:
        return False
    return all(abs(x - y) <= 1e-4 * max(1.0, abs(x)) for x, y in zip(a[:n], b[:n], strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--images", type=int, default=800, help="synthetic training scenes to ingest")
    ap.add_argument("--configs", nargs="*", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    ap.add_argument("--workers", type=int, default=1, help="loader workers, both sides")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads, both sides (1: on 2 shared cores, 2 threads beside the loader "
        "worker oversubscribe them and a step gets several times slower)",
    )
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["VISIONLOOP_HOME"] = str(Path(tmp) / "home")  # a private MLflow store
        t0 = time.perf_counter()
        dataset = build_dataset(Path(tmp), args.images)
        print(f"dataset: {args.images} scenes generated and ingested in {time.perf_counter() - t0:.1f} s")
        for name in args.configs:
            cfg = CONFIGS[name]
            spec = spec_for(dataset, cfg, args.steps, args.workers)
            bare, ours, matches = [], [], []
            for r in range(args.rounds):  # alternate: machine drift hits both alike
                rate, bare_losses = bare_run(spec, args.warmup)
                bare.append(rate)
                rate, our_losses = visionloop_run(spec, Path(tmp) / f"run-{name}-{r}", args.warmup)
                ours.append(rate)
                matches.append(same_losses(bare_losses, our_losses))
                note = (
                    ""
                    if matches[-1]
                    else (f"  LOSSES DIFFER: bare {bare_losses[:3]} visionloop {our_losses[:3]}")
                )
                print(f"  {name} round {r + 1}: bare {bare[-1]:.1f}  visionloop {ours[-1]:.1f} img/s{note}")
            ratio = median(ours) / median(bare)
            results[name] = {
                **cfg,
                "bare_images_per_s": bare,
                "visionloop_images_per_s": ours,
                "ratio": ratio,
                "losses_match": matches,
            }
            print(f"{name:42s} bare {median(bare):7.1f} img/s   visionloop {median(ours):7.1f} img/s   "
                  f"ratio {ratio:.3f}  (target >= 0.97)")  # fmt: skip
    load_end = os.getloadavg()
    path = write_result(
        "det_trainer_overhead" + (f"_{args.tag}" if args.tag else ""),
        {
            "config": vars(args),
            "results": results,
            "target": 0.97,
            "load_average_start": load_start,
            "load_average_end": load_end,
        },
    )
    print(f"load average start {load_start}, end {load_end}")
    print(f"results: {path}")


if __name__ == "__main__":
    main()
