"""Scaling of one training run: images/s with 2 DDP processes over 1 process, on this machine.

The same spec (same global batch, same steps) is trained by `visionloop train` as a user runs
it: once as one process, once with `--nproc-per-node 2` (gloo on CPU, NCCL on GPU), rounds
alternating; the throughput is the trainer's own figure for its training steps (the "done:
... img/s" line: evaluation and start-up are not in it). Reported: the median images/s of
each side and the median of the rounds' ratios (2.0 would be perfect scaling).

On the CPU the single process is measured twice: as a user runs it (the trainer gives torch
the cores the loader leaves: 2 threads on a 2-core box) and with OMP_NUM_THREADS=1, the
threads each of the 2 DDP processes gets from the launcher; the second ratio is the one
that says what DDP itself costs or buys. The 8-GPU efficiency target of issue 11 needs a GPU
machine: run with `--device cuda` there.

    python benchmarks/train/scaling.py [--config small_cnn@32] [--steps 60] [--rounds 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml

from _common import median, write_result

CONFIGS = {
    "small_cnn@32": {"arch": "small_cnn", "image_size": 32, "batch": 64},
    "resnet18@64": {"arch": "resnet18", "image_size": 64, "batch": 32},
}
DONE = re.compile(r"done\W+(\d+) steps in ([\d.]+) s \(([\d,]+) img/s\)")


def build_dataset(root: Path) -> Path:
    """The digits at 32 px, ingested by the CLI in a process of its own: this process only
    starts trainers, so nothing the ingest leaves behind (its decode pool, the variables its
    imports set) can weigh on one side of the comparison."""
    from visionloop.cli.demo import write_digits_imagefolder

    write_digits_imagefolder(root / "images", scale=4)
    cmd = [
        sys.executable,
        "-m",
        "visionloop",
        "data",
        "ingest",
        str(root / "images"),
        "--out",
        str(root / "ds"),
    ]
    done = subprocess.run([*cmd, "--val-fraction", "0.1", "--workers", "2"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"ingest failed:\n{done.stdout}\n{done.stderr}")
    return root / "ds"


def write_spec(path: Path, dataset: Path, cfg: dict[str, Any], steps: int, device: str) -> Path:
    doc = {
        "data": {
            "dataset": str(dataset),
            "batch_size": cfg["batch"],
            "workers": 0,  # no loader processes: the comparison is of the trainer processes
            "image_size": cfg["image_size"],
            "augment": {"hflip": 0.0},
        },
        "model": {"arch": cfg["arch"]},
        "steps": steps,
        "device": device,
        "eval": {"every_epochs": 1000},
        "checkpoint": {"every_steps": steps},
    }
    path.write_text(yaml.safe_dump(doc))
    return path


def images_per_s(spec: Path, run_dir: Path, nproc: int, home: Path, threads: int | None = None) -> float:
    cmd = [sys.executable, "-m", "visionloop", "train", str(spec), "--run-dir", str(run_dir), "--no-track"]
    if nproc > 1:
        cmd += ["--nproc-per-node", str(nproc)]
    done = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, "VISIONLOOP_HOME": str(home)}
    )
    m = DONE.search(done.stdout)
    if done.returncode != 0 or m is None:
        raise SystemExit(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return float(m.group(3).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small_cnn@32")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    cfg = CONFIGS[args.config]
    with tempfile.TemporaryDirectory(prefix="vl-scaling-") as tmp:
        root = Path(tmp)
        spec = write_spec(root / "spec.yaml", build_dataset(root), cfg, args.steps, args.device)
        one: list[float] = []
        one_thread: list[float] = []
        two: list[float] = []
        for r in range(args.rounds):
            one.append(images_per_s(spec, root / f"one-{r}", 1, root / "home"))
            if args.device == "cpu":
                one_thread.append(images_per_s(spec, root / f"one-t1-{r}", 1, root / "home", threads=1))
            two.append(images_per_s(spec, root / f"two-{r}", 2, root / "home"))
            also = f", 1 process 1 thread {one_thread[-1]:,.0f}" if one_thread else ""
            print(f"round {r + 1}: 1 process {one[-1]:,.0f}{also}, 2 processes {two[-1]:,.0f} img/s")
    # Each round's sides ran back to back: the median of the per-round ratios is steadier than
    # a ratio of medians when other work on the machine comes and goes.
    ratio = median([b / a for a, b in zip(one, two, strict=True)])
    print(
        f"{args.config} on {args.device}: 1 process {median(one):,.0f} img/s, "
        f"2 processes {median(two):,.0f} img/s; ratio {ratio:.2f} (2.00 = perfect scaling)"
    )
    ratio_equal = median([b / a for a, b in zip(one_thread, two, strict=True)]) if one_thread else None
    if ratio_equal is not None:
        print(
            f"  with 1 thread per process on both sides: 1 process {median(one_thread):,.0f} img/s; "
            f"ratio {ratio_equal:.2f}"
        )
    path = write_result(
        f"train_scaling_{args.config.replace('@', '_')}_{args.device}",
        {
            "config": {**cfg, "steps": args.steps, "rounds": args.rounds, "device": args.device},
            "images_per_s": {"1": one, "1_one_thread": one_thread, "2": two},
            "median_images_per_s": {
                "1": median(one),
                "1_one_thread": median(one_thread) if one_thread else None,
                "2": median(two),
            },
            "ratio_2_over_1": ratio,
            "ratio_2_over_1_equal_threads": ratio_equal,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
