"""int8 against fp32 on the CPU with ONNX Runtime: throughput, and what int8 costs in accuracy.

Throughput: resnet18 (random weights; speed does not depend on them) exported by visionloop's
own path (`export.convert`: TorchScript exporter, then static QDQ int8 with per-channel 7-bit
weights, calibrated on 64 random images), both run by ONNX Runtime's CPU provider on the same
batches, rounds alternating fp32/int8. The baseline is fp32 in the same run. Reported: images/s
from wall-clock time and images per CPU-second (process CPU time; steadier when other work
shares the machine).

Accuracy: a real trained model — the digits small_cnn (2 epochs, as in the tests) — exported
fp32 and int8 through `export_model`, both evaluated on the whole validation split, against
eager fp32 PyTorch.

    python benchmarks/int8/int8_throughput.py [--size 128] [--batch 8] [--rounds 5] [--iters 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from _common import median, write_result


def _session(path: Path, threads: int) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def throughput(size: int, batch: int, rounds: int, iters: int, threads: int) -> dict[str, Any]:
    import numpy as np
    import torch

    from visionloop.export import convert
    from visionloop.models import registry as archs

    torch.manual_seed(0)
    model = archs.create_model("resnet18", 10).eval()
    work = Path(tempfile.mkdtemp(prefix="int8-bench-"))
    convert.export_fp32(model, (3, size, size), work / "fp32.onnx")
    convert.to_int8(work / "fp32.onnx", work / "int8.onnx", torch.randn(64, 3, size, size), work)
    sessions = {p: _session(work / f"{p}.onnx", threads) for p in ("fp32", "int8")}
    x = np.random.default_rng(0).standard_normal((batch, 3, size, size)).astype(np.float32)
    for s in sessions.values():  # warm-up: allocations, kernel selection
        for _ in range(3):
            s.run(None, {"input": x})
    wall: dict[str, list[float]] = {p: [] for p in sessions}
    cpu: dict[str, list[float]] = {p: [] for p in sessions}
    for r in range(rounds):
        order = ("fp32", "int8") if r % 2 == 0 else ("int8", "fp32")
        for p in order:
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(iters):
                sessions[p].run(None, {"input": x})
            wall[p].append(batch * iters / (time.perf_counter() - t0))
            cpu[p].append(batch * iters / (time.process_time() - c0))
    return {
        "model": f"resnet18 at {size}x{size}, batch {batch}, {threads} ORT threads",
        "size_mb": {p: round((work / f"{p}.onnx").stat().st_size / 1e6, 2) for p in sessions},
        "images_per_s": {p: round(median(v), 2) for p, v in wall.items()},
        "images_per_cpu_s": {p: round(median(v), 2) for p, v in cpu.items()},
        "ratio_wall": round(median(wall["int8"]) / median(wall["fp32"]), 3),
        "ratio_cpu": round(median(cpu["int8"]) / median(cpu["fp32"]), 3),
    }


def accuracy() -> dict[str, Any]:
    from _modelkit import trained_model
    from _trainkit import build_digits_dataset
    from visionloop.export import export_model

    class _Factory:  # what trained_model needs of pytest's TempPathFactory
        def __init__(self, root: Path) -> None:
            self.root = root

        def getbasetemp(self) -> Path:
            return self.root

    root = Path(tempfile.mkdtemp(prefix="int8-acc-"))
    kit = trained_model(_Factory(root), build_digits_dataset(root))  # type: ignore[arg-type]
    out: dict[str, Any] = {"model": "digits small_cnn at 16x16, 2 epochs (tests/_modelkit.py)"}
    for precision in ("fp32", "int8"):
        r = export_model(kit.ref, precision=precision, settings=kit.settings)  # type: ignore[arg-type]
        out[precision] = {"accuracy": r.accuracy, "top1_agreement": r.top1_agreement, "passed": r.passed}
        out["reference_accuracy"] = r.reference_accuracy
        out["samples"] = r.samples
    out["drop_points"] = round((out["reference_accuracy"] - out["int8"]["accuracy"]) * 100, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    speed = throughput(args.size, args.batch, args.rounds, args.iters, args.threads)
    print(f"{speed['model']}")
    for p in ("fp32", "int8"):
        print(
            f"  {p}: {speed['images_per_s'][p]:8.1f} images/s  "
            f"{speed['images_per_cpu_s'][p]:8.1f} images/CPU-s  {speed['size_mb'][p]} MB"
        )
    print(f"  int8 / fp32: {speed['ratio_wall']:.2f}x wall-clock, {speed['ratio_cpu']:.2f}x per CPU-second")
    acc = accuracy()
    print(
        f"{acc['model']}: fp32 PyTorch {acc['reference_accuracy']:.2%}, "
        f"ONNX fp32 {acc['fp32']['accuracy']:.2%}, int8 {acc['int8']['accuracy']:.2%} "
        f"(drop {acc['drop_points']:.2f} points) on {acc['samples']} images"
    )
    path = write_result("int8", {"args": vars(args), "throughput": speed, "accuracy": acc})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
