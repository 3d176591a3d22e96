"""How good is `visionloop size`'s time prediction? Predicted against measured step time on
this machine's CPU, treated as one more device, for several architectures.

The CPU's "datasheet" is measured here:
- its peak: the best fp32 matmul throughput (2 x n^3 FLOPs per n x n matmul, n = 1024, torch's
  intra-op threads), the rate a GEMM-bound layer could reach;
- its per-operator cost: the time of a small elementwise op (dispatch, no arithmetic to speak
  of), the CPU's counterpart of a GPU's kernel-launch floor.

For each architecture, `visionloop.size` measures what it measures for a GPU (3 x forward
FLOPs per image with FlopCounterMode, operators per step) and predicts a step's time with
`predict_time`. The measured step is the real thing: forward through the task's training
loss, backward and the optimizer step (the trainer's optimizer), median over timed steps after
warm-up, data loading excluded on both sides.

Two predictions per architecture:
- `uncorrected`: sustained fraction 1.0, i.e. the whole model at the matmul rate; the ratio
  measured / predicted is how far short of GEMM speed the model's layers fall;
- `corrected`: the sustained fraction measured on the *other* architectures (their median,
  leave-one-out), as `visionloop size` corrects a GPU type's fraction from earlier runs.

    python benchmarks/size_predict.py [--steps 8] [--configs small_cnn@32 resnet18@64 ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _common import write_result

CONFIGS: dict[str, dict[str, Any]] = {
    "small_cnn@32": {"task": "classification", "arch": "small_cnn", "image_size": 32, "batch": 64},
    "resnet18@64": {"task": "classification", "arch": "resnet18", "image_size": 64, "batch": 32},
    "mobilenet_v3_small@96": {
        "task": "classification",
        "arch": "mobilenet_v3_small",
        "image_size": 96,
        "batch": 32,
    },
    "native_detector@96": {"task": "detection", "arch": "native_detector", "image_size": 96, "batch": 16},
}


def matmul_peak_tflops(n: int = 1024, repeats: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def op_overhead_s(repeats: int = 20000) -> float:
    x, y = torch.ones(8), torch.ones(8)
    for _ in range(1000):
        torch.add(x, y)
    t0 = time.perf_counter()
    for _ in range(repeats):
        torch.add(x, y)
    return (time.perf_counter() - t0) / repeats


def datasets(root: Path) -> dict[str, Path]:
    from _trainkit import build_digits_dataset
    from visionloop.data.ingest import IngestOptions, ingest
    from visionloop.tasks.detection.synthetic import generate_detection_dataset

    generate_detection_dataset(root / "det-source", 64, image_size=96, seed=0)
    det = ingest(root / "det-source", root / "det-ds", IngestOptions(seed=0, workers=2)).out
    return {"classification": build_digits_dataset(root / "digits"), "detection": det}


def spec_for(dataset: Path, cfg: dict[str, Any]) -> Any:
    from visionloop.specs import validate_train_spec

    return validate_train_spec(
        {
            "task": cfg["task"],
            "data": {"dataset": str(dataset), "batch_size": cfg["batch"], "image_size": cfg["image_size"]},
            "model": {"arch": cfg["arch"]},
            "optimizer": {"name": "adamw"},
            "precision": "fp32",
            "steps": 100,
        }
    )


def measured_step_s(probe: Any, batch: int, steps: int, warmup: int = 2) -> float:
    from visionloop.train.schedule import build_optimizer

    optimizer = build_optimizer(probe.model, probe.spec.optimizer)
    images, targets = probe.batch(batch, torch.device("cpu"))
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = probe.loss(images, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: least hurt by other processes)"
    )
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()

    from visionloop.size.catalog import Device
    from visionloop.size.predict import ComputeChoice, fraction_from_run, measure_step_cost, predict_time
    from visionloop.size.probe import open_probe

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    peak = matmul_peak_tflops()
    overhead = op_overhead_s()
    print(
        f"CPU: matmul peak {peak * 1000:.1f} GFLOPS, {overhead * 1e6:.2f} us per operator, "
        f"{torch.get_num_threads()} threads"
    )
    choice = ComputeChoice("fp32", "fp32")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        data = datasets(Path(tmp))
        for name in args.configs:
            cfg = CONFIGS[name]
            probe = open_probe(spec_for(data[cfg["task"]], cfg))
            cost = measure_step_cost(probe)
            # The peak is re-measured next to each model: on a shared machine both see the
            # same contention.
            peak = max(peak, matmul_peak_tflops())
            measured = measured_step_s(probe, cfg["batch"], args.steps)
            cpu = Device(
                "cpu",
                "measured here",
                fp32_tflops=peak,
                fp16_tflops=peak,
                memory_gib=1.0,
                bandwidth_gbs=1.0,
                sustained_fraction=1.0,
            )
            uncorrected = predict_time(
                cost, cfg["batch"], cfg["batch"], cpu, 1, choice, op_overhead_s=overhead
            )
            assert uncorrected is not None
            fraction = fraction_from_run(
                cfg["batch"] / measured, cfg["batch"], cost, cpu, 1, choice, overhead
            )
            rows.append(
                {
                    "config": name,
                    "batch": cfg["batch"],
                    "gflops_per_image": cost.flops_per_image / 1e9,
                    "ops_per_step": cost.ops_per_step,
                    "measured_step_s": measured,
                    "predicted_uncorrected_s": uncorrected.seconds_per_step,
                    "ratio_uncorrected": measured / uncorrected.seconds_per_step,
                    "own_fraction": fraction,
                    "_cost": cost,
                    "_device": cpu,
                }
            )
            print(
                f"  {name}: measured {measured * 1000:.1f} ms/step, uncorrected prediction "
                f"{uncorrected.seconds_per_step * 1000:.1f} ms (ratio {rows[-1]['ratio_uncorrected']:.2f}), "
                f"sustained fraction {fraction:.3f}"
            )
    for row in rows:
        others = [r["own_fraction"] for r in rows if r is not row and r["own_fraction"]]
        loo = float(statistics.median(others)) if others else 1.0
        cpu = row.pop("_device")
        cpu = Device(
            "cpu",
            "measured here",
            fp32_tflops=cpu.fp32_tflops,
            fp16_tflops=cpu.fp16_tflops,
            memory_gib=1.0,
            bandwidth_gbs=1.0,
            sustained_fraction=loo,
        )
        corrected = predict_time(
            row.pop("_cost"), row["batch"], row["batch"], cpu, 1, choice, op_overhead_s=overhead
        )
        assert corrected is not None
        row["leave_one_out_fraction"] = loo
        row["predicted_corrected_s"] = corrected.seconds_per_step
        row["ratio_corrected"] = row["measured_step_s"] / corrected.seconds_per_step
    print(
        f"\n{'config':<24} {'GFLOP/img':>9} {'ops':>6} {'measured':>10} {'pred(f=1)':>10} {'ratio':>6} "
        f"{'f(loo)':>7} {'pred(loo)':>10} {'ratio':>6}"
    )
    for r in rows:
        print(
            f"{r['config']:<24} {r['gflops_per_image']:>9.3f} {r['ops_per_step']:>6} "
            f"{r['measured_step_s'] * 1000:>8.1f}ms {r['predicted_uncorrected_s'] * 1000:>8.1f}ms "
            f"{r['ratio_uncorrected']:>6.2f} {r['leave_one_out_fraction']:>7.3f} "
            f"{r['predicted_corrected_s'] * 1000:>8.1f}ms {r['ratio_corrected']:>6.2f}"
        )
    path = write_result(
        "size_predict",
        {"cpu_matmul_peak_tflops": peak, "cpu_op_overhead_s": overhead, "steps": args.steps, "rows": rows},
    )
    print(f"\nratio = measured / predicted step time (1.00 is exact). Results: {path}")


if __name__ == "__main__":
    main()
