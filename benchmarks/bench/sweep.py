"""`visionloop bench`'s sweep on resnet18 at 224 px: does the harness report what a bare loop
measures, and what does ONNX Runtime buy over eager PyTorch?

- Baseline: a bare timing loop around eager `model(x)` (inference_mode; on CUDA synchronised
  per call), the way one would time a model by hand.
- visionloop: `run_sweep` on the same weights, as eager PyTorch and as an fp32 ONNX export
  (made here with torch.onnx.export), on CPU and, when there is one, on CUDA.

Reported per batch size: the harness's p50 over the bare loop's p50 for the same eager model
(~1.0 means the harness adds nothing), and ONNX Runtime's throughput over eager PyTorch's.
Rounds alternate baseline and sweep; the medians are reported. Random weights (nothing is
downloaded): latency does not depend on them. Accuracy is off: no dataset is involved.

    python benchmarks/bench/sweep.py [--rounds 3] [--batch-sizes 1,8] [--iterations 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from _common import write_result
from visionloop.bench import BenchResult, run_sweep, sweep_settings, target_from_dir
from visionloop.models.card import ModelCard
from visionloop.models.weights import save_weights


def make_model_dir(root: Path, arch: str) -> Path:
    """A model folder as training leaves one (card + final weights) plus an fp32 ONNX export."""
    card = ModelCard(
        arch=arch,
        num_classes=10,
        class_names=[f"c{i}" for i in range(10)],
        input_size=(3, 224, 224),
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        crop_pct=0.875,
    )
    card.save(root)
    torch.manual_seed(0)
    model = card.create_model().eval()
    save_weights(model, root / "final.safetensors")
    out = root / "exports" / "onnx-fp32"
    out.mkdir(parents=True)
    torch.onnx.export(
        model,
        (torch.zeros(2, *card.input_size),),
        str(out / "model.onnx"),
        input_names=["input"],
        output_names=["logits"],
        dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
        dynamo=False,
    )
    (out / "export.json").write_text('{"passed": true}')
    return root


def bare_p50_ms(model: torch.nn.Module, device: str, batch: int, iterations: int, warmup: int) -> float:
    x = torch.randn(batch, 3, 224, 224, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    with torch.inference_mode():
        for i in range(warmup + iterations):
            t0 = time.perf_counter()
            model(x)
            sync()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="resnet18")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--iterations", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="also write the last sweep's bench.json here")
    args = ap.parse_args()
    devices = "cpu,cuda" if torch.cuda.is_available() else "cpu"
    settings = sweep_settings(
        formats="pytorch,onnx",
        precisions="fp32,fp16",
        devices=devices,
        batch_sizes=args.batch_sizes,
        iterations=args.iterations,
        warmup=args.warmup,
        accuracy=False,
    )
    with tempfile.TemporaryDirectory() as tmp:
        target = target_from_dir(make_model_dir(Path(tmp), args.arch))
        model = target.card.create_model(target.weights).eval()
        bare: dict[tuple[str, int], list[float]] = {}
        sweeps: list[BenchResult] = []
        for _ in range(args.rounds):
            for device in settings.devices:
                m = model.to(device)
                for b in settings.batch_sizes:
                    ms = bare_p50_ms(m, device, b, args.iterations, args.warmup)
                    bare.setdefault((device, b), []).append(ms)
            model.to("cpu")
            sweeps.append(run_sweep(target, settings))
    rows: list[dict[str, Any]] = []
    for device in settings.devices:
        for b in settings.batch_sizes:

            def med(fmt: str, precision: str, field: str, device: str = device, b: int = b) -> float | None:
                vals = [
                    getattr(p, field)
                    for r in sweeps
                    for c in r.configs
                    if (c.format, c.precision, c.device, c.status) == (fmt, precision, device, "ok")
                    for p in c.points
                    if p.batch_size == b
                ]
                return statistics.median(vals) if vals else None

            bare_ms = statistics.median(bare[(device, b)])
            torch_p50 = med("pytorch", "fp32", "p50_ms")
            row = {
                "device": device,
                "batch": b,
                "bare_p50_ms": bare_ms,
                "sweep_pytorch_fp32_p50_ms": torch_p50,
                "harness_ratio": torch_p50 / bare_ms if torch_p50 else None,
                "pytorch_fp32_ips": med("pytorch", "fp32", "throughput_ips"),
                "pytorch_fp16_ips": med("pytorch", "fp16", "throughput_ips"),
                "onnx_fp32_ips": med("onnx", "fp32", "throughput_ips"),
                "onnx_fp32_p99_ms": med("onnx", "fp32", "p99_ms"),
                "pytorch_fp32_p99_ms": med("pytorch", "fp32", "p99_ms"),
            }
            onnx, eager = row["onnx_fp32_ips"], row["pytorch_fp32_ips"]
            row["onnx_over_pytorch"] = onnx / eager if onnx and eager else None
            rows.append(row)
            nan = float("nan")
            print(
                f"{device} batch {b}: bare p50 {bare_ms:.2f} ms, sweep p50 {torch_p50 or nan:.2f} ms "
                f"(harness ratio {row['harness_ratio'] or nan:.3f}); "
                f"onnx/pytorch throughput {row['onnx_over_pytorch'] or nan:.2f}x"
            )
    skipped = {c.label: c.status_text for c in sweeps[-1].configs if c.status != "ok"}
    print("not measured:", skipped)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        sweeps[-1].save(args.out / "bench.json")
    path = write_result(
        f"bench_sweep_{'gpu' if torch.cuda.is_available() else 'cpu'}",
        {"arch": args.arch, "rounds": args.rounds, "iterations": args.iterations, "rows": rows}
        | {"skipped": skipped},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
