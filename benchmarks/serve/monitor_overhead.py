"""What the monitor's fields cost the server: throughput with `prediction_log_monitor` on (each
prediction record carries the drift outputs and, for an image request, the image's statistics)
against the same server with it off, prediction log on in both. Target: >= 0.95.

Two child processes run the real server (`serve.server.BackgroundServer`, dynamic batching, max
batch `--batch`, 2 ms queue delay, prediction log to a temp folder) on the same ONNX model
(torchvision resnet18, random init, 224 px, the model card's resize 256 → crop 224), one with
the fields and one without. `--clients` closed-loop clients (aiohttp, in this process) send
for `--seconds` to one server, then the other, alternating, `--rounds` times; the ratio is
taken per round pair and its median reported. Two request kinds, measured separately:

- `image`: a 640 x 480 JPEG to /classify (decode, resize, statistics in the decode pool);
- `tensor`: a preprocessed 1 x 3 x 224 x 224 FP32 tensor in the binary format to /infer (no
  image: only the drift outputs are added to the record).

    python benchmarks/serve/monitor_overhead.py [--seconds 10] [--rounds 3] [--clients 16] [--batch 8]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import build_model, closed_loop, request_body

from _common import write_result


def child(onnx: Path, card: Path, port_file: Path, batch: int, monitor: bool, logs: Path) -> None:
    from visionloop.models.card import ModelCard
    from visionloop.serve.config import ServeConfig
    from visionloop.serve.server import BackgroundServer
    from visionloop.serve.source import StaticSource

    src = StaticSource()
    src.add("resnet", 1, onnx, ModelCard.load(card))
    cfg = ServeConfig(
        model="resnet",
        port=0,
        max_batch_size=batch,
        max_queue_delay_ms=2.0,
        queue_capacity=1024,
        request_timeout_ms=60_000,
        prediction_log=True,
        prediction_log_monitor=monitor,
    )
    server = BackgroundServer(cfg, src, logs / "predictions.jsonl").start()
    port_file.write_text(str(server.port))
    server.thread.join()


def start(
    onnx: Path, card: Path, batch: int, monitor: bool, tmp: Path
) -> tuple[subprocess.Popen[bytes], str]:
    name = "monitor" if monitor else "plain"
    port_file, logs = tmp / f"{name}.port", tmp / f"logs-{name}"
    logs.mkdir()
    args = [sys.executable, __file__, "--child", name, "--onnx", str(onnx), "--card", str(card)]
    args += ["--port-file", str(port_file), "--batch", str(batch), "--logs", str(logs)]
    proc = subprocess.Popen(args)
    deadline = time.monotonic() + 120
    while not port_file.is_file() or not port_file.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the {name} server did not start")
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port_file.read_text()}"


def jpeg_body() -> tuple[bytes, dict[str, str]]:
    from PIL import Image

    rng = np.random.default_rng(3)
    # A smooth picture with some texture (a JPEG of pure noise is unusually large).
    y, x = np.mgrid[0:480, 0:640]
    base = np.stack([x / 640 * 255, y / 480 * 255, (x + y) / 1120 * 255], axis=-1)
    img = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    return buf.getvalue(), {"Content-Type": "image/jpeg"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--child", choices=["monitor", "plain"])
    p.add_argument("--onnx", type=Path)
    p.add_argument("--card", type=Path)
    p.add_argument("--port-file", type=Path)
    p.add_argument("--logs", type=Path)
    a = p.parse_args()
    if a.child:
        child(a.onnx, a.card, a.port_file, a.batch, a.child == "monitor", a.logs)
        return

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        onnx, card = build_model(tmp, 224)
        servers = {m: start(onnx, card, a.batch, m, tmp) for m in (True, False)}
        kinds: dict[str, tuple[str, bytes, dict[str, str]]] = {
            "image": ("classify", *jpeg_body()),
            "tensor": ("infer", *request_body(224)),
        }
        results: dict[str, Any] = {}
        try:
            for kind, (endpoint, body, headers) in kinds.items():
                rounds: list[dict[str, Any]] = []
                for r in range(a.rounds):
                    order = (True, False) if r % 2 == 0 else (False, True)  # alternate who goes first
                    got = {}
                    for monitor in order:
                        url = f"{servers[monitor][1]}/v2/models/resnet/{endpoint}"
                        got[monitor] = asyncio.run(closed_loop(url, body, headers, a.clients, a.seconds))
                    ratio = got[True]["rps"] / got[False]["rps"]
                    rounds.append({"with": got[True], "without": got[False], "ratio": ratio})
                    print(
                        f"{kind} round {r + 1}: with fields {got[True]['rps']:.1f} req/s "
                        f"(p99 {got[True]['p99_ms']:.0f} ms), without {got[False]['rps']:.1f} req/s "
                        f"(p99 {got[False]['p99_ms']:.0f} ms): ratio {ratio:.3f}",
                        flush=True,
                    )
                median = statistics.median(x["ratio"] for x in rounds)
                results[kind] = {"rounds": rounds, "median_ratio": median}
                print(f"{kind}: median ratio {median:.3f} (target >= 0.95)", flush=True)
            logs = {
                m: sum(len(f.read_bytes().splitlines()) for f in (tmp / f"logs-{n}").glob("*.jsonl*"))
                for m, n in ((True, "monitor"), (False, "plain"))
            }
            sample = next((tmp / "logs-monitor").glob("*.jsonl")).open().readline()
            results["logged_records"] = {"with": logs[True], "without": logs[False]}
            results["record_bytes_with_fields"] = len(sample)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    config = {
        "seconds": a.seconds,
        "rounds": a.rounds,
        "clients": a.clients,
        "batch": a.batch,
        "model": "resnet18 224",
    }
    path = write_result("serve_monitor_overhead", {"config": config, "results": results})
    print(
        json.dumps(
            {k: v["median_ratio"] for k, v in results.items() if isinstance(v, dict) and "median_ratio" in v}
        )
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
