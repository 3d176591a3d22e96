"""How much batching itself can buy on this machine: in-process ONNX Runtime images/s at
batch 8 and 32 over batch 1, per architecture, same session, no HTTP.

A dynamic-batching server's advantage over a one-request-one-inference server at saturation
is bounded by this ratio (both pay the same HTTP cost per request; only the model runs differ).
So where batch 8 is not ≥ 3× batch 1 here, no batching server can be 3× a naive one here.
Baseline: batch 1, measured in the same run.

    python benchmarks/serve/batch_scaling.py [--seconds 3] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import build_model

from _common import write_result

# The project's default model at its demo size, an edge model, and the serve benchmark's model.
MODELS = [("small_cnn", 32), ("mobilenet_v3_small", 224), ("resnet18", 224)]
BATCHES = (1, 8, 32)


def images_per_s(session: Any, size: int, batch: int, seconds: float) -> float:
    x = np.random.default_rng(0).standard_normal((batch, 3, size, size)).astype(np.float32)
    name = session.get_inputs()[0].name
    for _ in range(3):  # warm-up: arenas, kernels chosen
        session.run(None, {name: x})
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        session.run(None, {name: x})
        n += batch
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    a = ap.parse_args()
    import onnxruntime as ort

    provider = "CUDAExecutionProvider" if a.device == "cuda" else "CPUExecutionProvider"
    if provider not in ort.get_available_providers():
        sys.exit(f"this onnxruntime has no {provider}; install onnxruntime-gpu for --device cuda")
    rows: list[dict[str, Any]] = []
    print(
        f"{'model':<22} {'size':>4} "
        + " ".join(f"{'b' + str(b) + ' img/s':>11}" for b in BATCHES)
        + "  b8/b1"
    )
    for arch, size in MODELS:
        with tempfile.TemporaryDirectory() as d:
            onnx_path, _ = build_model(Path(d), size, arch)
            session = ort.InferenceSession(str(onnx_path), providers=[provider])
            rates = {b: images_per_s(session, size, b, a.seconds) for b in BATCHES}
        ratio = rates[8] / rates[1]
        rows.append({"arch": arch, "size": size, "images_per_s": rates, "b8_over_b1": ratio})
        print(f"{arch:<22} {size:>4} " + " ".join(f"{rates[b]:>11.1f}" for b in BATCHES) + f"  {ratio:.2f}x")
    path = write_result(f"serve_batch_scaling_{a.device}", {"device": a.device, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
