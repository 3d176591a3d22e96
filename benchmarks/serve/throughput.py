"""Inference server throughput and latency, against two baselines measured in the same run.

Model: torchvision resnet18 (random init: speed does not depend on the weights) exported to
ONNX with a dynamic batch axis, 3x224x224 FP32 input. Three measurements:

1. **In-process ONNX Runtime** at the server's batch size (`--batch`, default 8): the ceiling,
   no HTTP at all.
2. **visionloop serve at saturation**: the real server (dynamic batching, max batch `--batch`,
   2 ms queue delay) in its own process; `--clients` (32) concurrent closed-loop clients
   sending batch-1 requests in Triton's binary tensor format, from this process with aiohttp.
3. **A naive FastAPI server**: the same ONNX session, one request = one `session.run` of one
   image in FastAPI's thread pool, same clients.

Then the p50/p99 latency at half the server's saturation rate (open loop, fixed rate).
Client and server share the machine's cores; the client is aiohttp with pre-encoded bodies
(about 0.1-0.3 ms of CPU a request), so it takes little of the machine, but not nothing.

    python benchmarks/serve/throughput.py [--size 224] [--seconds 12] [--clients 32] [--batch 8]
                                          [--arch resnet18] [--device cpu|cuda]

`--device cuda` puts all three on ONNX Runtime's CUDA provider (onnxruntime-gpu).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import Request, Response  # module level: FastAPI resolves the handler's annotations here

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import pct, write_result

HEADER = "Inference-Header-Content-Length"


# ---------------------------------------------------------------- model


def build_model(root: Path, size: int, arch: str = "resnet18") -> tuple[Path, Path]:
    import warnings

    import torch

    from visionloop.models.card import ModelCard

    card = ModelCard(
        arch=arch,
        num_classes=10,
        class_names=[f"c{i}" for i in range(10)],
        input_size=(3, size, size),
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        crop_pct=0.875,
    )
    card_path = card.save(root / "model_card.json")
    model = card.create_model().eval()
    onnx_path = root / "model.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (torch.zeros(1, 3, size, size),),
            str(onnx_path),
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
            dynamo=False,
        )
    return onnx_path, card_path


def in_process(onnx_path: Path, size: int, batch: int, seconds: float, device: str = "cpu") -> float:
    """Images/s of ORT alone at `batch`, same session options as the server."""
    from visionloop.serve.runtime import OnnxModel

    m = OnnxModel(onnx_path, device=device)
    if device == "cuda" and m.providers[0] != "CUDAExecutionProvider":
        sys.exit(
            f"--device cuda: ONNX Runtime has no CUDA provider here ({m.providers}); install onnxruntime-gpu"
        )
    x = np.random.default_rng(0).standard_normal((batch, 3, size, size)).astype(np.float32)
    for _ in range(3):
        m.run({"input": x})
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        m.run({"input": x})
        n += batch
    return n / (time.perf_counter() - t0)


# ---------------------------------------------------------------- servers (child processes)


def child_server(
    kind: str, onnx_path: Path, card_path: Path, port_file: Path, batch: int, device: str = "cpu"
) -> None:
    import socket

    import uvicorn

    from visionloop.models.card import ModelCard
    from visionloop.serve.config import ServeConfig
    from visionloop.serve.server import BackgroundServer
    from visionloop.serve.source import StaticSource

    if kind == "visionloop":
        src = StaticSource()
        src.add("resnet", 1, onnx_path, ModelCard.load(card_path))
        cfg = ServeConfig(
            model="resnet",
            port=0,
            max_batch_size=batch,
            max_queue_delay_ms=2.0,
            queue_capacity=1024,
            request_timeout_ms=60_000,
            prediction_log=False,
            device=device,
            **json.loads(os.environ.get("VL_SERVE_OVERRIDES", "{}")),  # try: {"batch_concurrency": 1}
        )
        server = BackgroundServer(cfg, src).start()
        port_file.write_text(str(server.port))
        server.thread.join()
        return
    # The naive baseline: what a first FastAPI wrapper around a session looks like.
    import onnxruntime as ort
    from fastapi import FastAPI
    from starlette.concurrency import run_in_threadpool

    providers = (
        ["CUDAExecutionProvider", "CPUExecutionProvider"] if device == "cuda" else ["CPUExecutionProvider"]
    )
    session = ort.InferenceSession(str(onnx_path), providers=providers)
    app = FastAPI()

    @app.post("/v2/models/resnet/infer")
    async def infer(request: Request) -> Response:
        body = await request.body()
        n = int(request.headers[HEADER])
        head = json.loads(body[:n])
        shape = head["inputs"][0]["shape"]
        x = np.frombuffer(body, dtype=np.float32, offset=n).reshape(shape)
        (out,) = await run_in_threadpool(session.run, None, {"input": x})
        doc = json.dumps(
            {
                "model_name": "resnet",
                "outputs": [
                    {
                        "name": "logits",
                        "datatype": "FP32",
                        "shape": list(out.shape),
                        "data": out.ravel().tolist(),
                    }
                ],
            }
        )
        return Response(doc, media_type="application/json")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port_file.write_text(str(sock.getsockname()[1]))
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])


def start_child(
    kind: str, onnx_path: Path, card_path: Path, batch: int, tmp: Path, device: str = "cpu"
) -> tuple[subprocess.Popen[bytes], str]:
    port_file = tmp / f"{kind}.port"
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--child",
            kind,
            "--onnx",
            str(onnx_path),
            "--card",
            str(card_path),
            "--port-file",
            str(port_file),
            "--batch",
            str(batch),
            "--device",
            device,
        ]
    )
    deadline = time.monotonic() + 120
    while not port_file.is_file() or not port_file.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {kind} server did not start")
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port_file.read_text()}"


# ---------------------------------------------------------------- clients


def request_body(size: int) -> tuple[bytes, dict[str, str]]:
    x = np.random.default_rng(1).standard_normal((1, 3, size, size)).astype(np.float32)
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
        }
    ).encode()
    return head + x.tobytes(), {HEADER: str(len(head)), "Content-Type": "application/octet-stream"}


async def closed_loop(
    url: str, body: bytes, headers: dict[str, str], clients: int, seconds: float
) -> dict[str, Any]:
    import aiohttp

    lat: list[float] = []
    errors = 0
    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def one() -> None:
            nonlocal errors
            t = time.perf_counter()
            async with s.post(url, data=body, headers=headers) as r:
                await r.read()
                if r.status != 200:
                    errors += 1
            lat.append(time.perf_counter() - t)

        # Warm-up: connections open, ORT arenas grown.
        await asyncio.gather(*(one() for _ in range(clients * 2)))
        lat.clear()
        stop = time.perf_counter() + seconds

        async def client() -> None:
            while time.perf_counter() < stop:
                await one()

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.perf_counter() - t0
    return {
        "rps": len(lat) / elapsed,
        "requests": len(lat),
        "errors": errors,
        "p50_ms": pct(lat, 0.5) * 1e3,
        "p99_ms": pct(lat, 0.99) * 1e3,
    }


async def open_loop(
    url: str, body: bytes, headers: dict[str, str], rate: float, seconds: float
) -> dict[str, Any]:
    import aiohttp

    lat: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as s:

        async def one() -> None:
            nonlocal errors
            t = time.perf_counter()
            async with s.post(url, data=body, headers=headers) as r:
                await r.read()
                errors += r.status != 200
            lat.append(time.perf_counter() - t)

        await asyncio.gather(*(one() for _ in range(8)))
        lat.clear()
        tasks = []
        t0 = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):  # requests leave on a fixed schedule, whatever the answers do
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one()))
        await asyncio.gather(*tasks)
    return {
        "rate": rate,
        "requests": len(lat),
        "errors": errors,
        "p50_ms": pct(lat, 0.5) * 1e3,
        "p99_ms": pct(lat, 0.99) * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--arch", default="resnet18", help="any registry model, e.g. resnet50")
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--child", choices=["visionloop", "naive"])
    ap.add_argument("--onnx", type=Path)
    ap.add_argument("--card", type=Path)
    ap.add_argument("--port-file", type=Path)
    a = ap.parse_args()
    if a.child:
        child_server(a.child, a.onnx, a.card, a.port_file, a.batch, a.device)
        return

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        onnx_path, card_path = build_model(tmp, a.size, a.arch)
        base = in_process(onnx_path, a.size, a.batch, a.seconds, a.device)
        print(f"in-process ONNX Runtime, batch {a.batch}: {base:.1f} images/s")
        body, headers = request_body(a.size)
        results: dict[str, Any] = {}
        for kind in ("visionloop", "naive"):
            proc, url = start_child(kind, onnx_path, card_path, a.batch, tmp, a.device)
            try:
                infer = f"{url}/v2/models/resnet/infer"
                results[kind] = asyncio.run(closed_loop(infer, body, headers, a.clients, a.seconds))
                print(f"{kind} server, {a.clients} clients: {results[kind]}")
                if kind == "visionloop":
                    metrics = asyncio.run(_text(f"{url}/metrics"))
                    results[kind]["mean_batch"] = _mean_batch(metrics)
                    half = results[kind]["rps"] / 2
                    results["half_rate"] = asyncio.run(open_loop(infer, body, headers, half, a.seconds))
                    print(f"visionloop at half saturation ({half:.1f} req/s): {results['half_rate']}")
            finally:
                proc.terminate()
                proc.wait(30)
    vl, naive = results["visionloop"], results["naive"]
    ratio_ort = vl["rps"] / base
    ratio_naive = vl["rps"] / naive["rps"]
    print(f"\nserver / in-process ORT (batch {a.batch}): {ratio_ort:.3f}   (target >= 0.85)")
    print(f"server / naive FastAPI at {a.clients} clients: {ratio_naive:.2f}x   (target >= 3x)")
    half = results["half_rate"]
    print(f"p99 at half saturation: {half['p99_ms']:.1f} ms (p50 {half['p50_ms']:.1f} ms)")
    path = write_result(
        "serve"
        + ("" if a.arch == "resnet18" else f"_{a.arch}")
        + ("" if a.device == "cpu" else f"_{a.device}"),
        {
            "model": f"{a.arch} 3x{a.size}x{a.size} fp32 onnx",
            "device": a.device,
            "batch": a.batch,
            "clients": a.clients,
            "seconds": a.seconds,
            "load_on_machine": os.getloadavg(),
            "in_process_ort_images_per_s": base,
            "visionloop": vl,
            "naive_fastapi": naive,
            "half_rate": results["half_rate"],
            "ratio_vs_in_process_ort": ratio_ort,
            "ratio_vs_naive": ratio_naive,
        },
    )
    print(f"wrote {path}")


async def _text(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return await r.text()


def _mean_batch(metrics: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = count = 0.0
    for fam in text_string_to_metric_families(metrics):
        for smp in fam.samples:
            if smp.name == "visionloop_serve_batch_size_sum":
                total += smp.value
            elif smp.name == "visionloop_serve_batch_size_count":
                count += smp.value
    return total / count if count else 0.0


if __name__ == "__main__":
    main()
