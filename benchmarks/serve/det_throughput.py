"""Detection server throughput against in-process ONNX Runtime at the same batch size.

Model: the native detector (`native_detector`, 10 classes, 96x96 input), seeded and
**untrained** (speed does not depend on the weights: the exported graph has no NMS and always
returns the top `max_detections` boxes per image), made fixed-shape with the detection task's
`export_module` and written with `export_fp32` (dynamic batch; outputs boxes, scores, labels).
The server is started as `throughput.py` starts its classifier (`BackgroundServer`, max batch
`--max-batch`, 2 ms queue delay, in its own process) with a detection model card (letterbox,
mean 0, std 1). Measured, in one run:

1. **In-process ONNX Runtime** (`OnnxModel.run`, the server's session options) on batches of
   1 and of 8: the ceiling, no HTTP.
2. **`/v2/models/det/infer`** with Triton binary tensors, requests of batch 1 and of batch 8
   (all three outputs asked back as binary), by closed-loop clients at each concurrency in
   `--clients`. A server's throughput is its rate when saturated: a closed loop of 4 clients
   measures latency (4 / round trip) and leaves the server's batcher and both cores half idle,
   so the server's figure is the best median over the concurrencies swept, reported with the
   p50/p99 latency it came with. The ratio is taken against ORT at the *request's* batch size
   (the issue's comparison) and, for transparency, against ORT at the server's max batch
   (what the dynamic batcher actually runs when saturated).
3. **`/v2/models/det/detect`**: one 96x96 PNG in, JSON boxes out (decode, letterbox, model,
   the task's numpy post-processing, JSON), for information; once with the default score
   threshold (the untrained model's boxes fall below it: a short answer) and once with
   `?score_threshold=0` (all 100 boxes in the JSON).

Client and server share the machine's cores.

    python benchmarks/serve/det_throughput.py [--seconds 10] [--clients 4 16 32 64] [--batches 1 8]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from throughput import HEADER, _mean_batch, _text, closed_loop

from _common import median, write_result

SIZE = 96
CLASSES = [str(i) for i in range(10)]
OUTPUTS = ("boxes", "scores", "labels")


def build_model(root: Path) -> tuple[Path, Path]:
    import torch

    from visionloop.export.convert import export_fp32
    from visionloop.models.card import ModelCard
    from visionloop.tasks.detection.export import export_module
    from visionloop.tasks.detection.task import DetectionTask

    torch.manual_seed(0)
    model = DetectionTask().build_model("native_detector", CLASSES, kwargs={}, image_size=SIZE)
    onnx_path = root / "model.onnx"
    export_fp32(export_module(model), (3, SIZE, SIZE), onnx_path, output_names=OUTPUTS)
    card = ModelCard(
        task="detection",
        arch="native_detector",
        num_classes=len(CLASSES),
        class_names=CLASSES,
        input_size=(3, SIZE, SIZE),
        mean=(0.0, 0.0, 0.0),
        std=(1.0, 1.0, 1.0),
        crop_pct=1.0,
        resize="letterbox",
    )
    return onnx_path, card.save(root / "model_card.json")


def batch_input(batch: int) -> np.ndarray:
    return np.random.default_rng(batch).random((batch, 3, SIZE, SIZE), dtype=np.float32)


def in_process(onnx_path: Path, batch: int, seconds: float) -> float:
    """Images/s of ORT alone on `batch`-image batches, same session options as the server."""
    from visionloop.serve.runtime import OnnxModel

    m = OnnxModel(onnx_path)
    x = batch_input(batch)
    for _ in range(5):
        m.run({"input": x})
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        m.run({"input": x})
        n += batch
    return n / (time.perf_counter() - t0)


def child_server(onnx_path: Path, card_path: Path, port_file: Path, max_batch: int) -> None:
    """The server exactly as throughput.py starts its classifier, serving the detector."""
    from visionloop.models.card import ModelCard
    from visionloop.serve.config import ServeConfig
    from visionloop.serve.server import BackgroundServer
    from visionloop.serve.source import StaticSource

    src = StaticSource()
    src.add("det", 1, onnx_path, ModelCard.load(card_path))
    cfg = ServeConfig(
        model="det",
        port=0,
        max_batch_size=max_batch,
        max_queue_delay_ms=2.0,
        queue_capacity=1024,
        request_timeout_ms=60_000,
        prediction_log=False,
        **json.loads(os.environ.get("VL_SERVE_OVERRIDES", "{}")),
    )
    server = BackgroundServer(cfg, src).start()
    port_file.write_text(str(server.port))
    server.thread.join()


def start_child(
    onnx_path: Path, card_path: Path, max_batch: int, tmp: Path
) -> tuple[subprocess.Popen[bytes], str]:
    port_file = tmp / "server.port"
    cmd = [sys.executable, __file__, "--child", "--onnx", str(onnx_path), "--card", str(card_path)]
    cmd += ["--port-file", str(port_file), "--max-batch", str(max_batch)]
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 120
    while not port_file.is_file() or not port_file.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the detection server did not start")
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port_file.read_text()}"


def infer_body(batch: int) -> tuple[bytes, dict[str, str]]:
    x = batch_input(batch)
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
            "outputs": [{"name": n, "parameters": {"binary_data": True}} for n in OUTPUTS],
        }
    ).encode()
    return head + x.tobytes(), {HEADER: str(len(head)), "Content-Type": "application/octet-stream"}


def png_body() -> tuple[bytes, dict[str, str]]:
    """A 96x96 digit scene, as the detection demo draws them."""
    from PIL import Image

    from visionloop.tasks.detection.synthetic import generate_detection_dataset

    with tempfile.TemporaryDirectory() as d:
        generate_detection_dataset(Path(d), 1, image_size=SIZE, seed=3)
        (path,) = sorted((Path(d) / "images").iterdir())
        buf = io.BytesIO()
        Image.open(path).convert("RGB").save(buf, format="PNG")
    return buf.getvalue(), {"Content-Type": "image/png"}


async def _check(url: str, body: bytes, headers: dict[str, str]) -> bytes:
    import aiohttp

    async with aiohttp.ClientSession() as s, s.post(url, data=body, headers=headers) as r:
        data = await r.read()
        if r.status != 200:
            raise RuntimeError(f"{url}: {r.status} {data[:300]!r}")
        return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument(
        "--clients", type=int, nargs="+", default=[4, 16, 32, 64], help="closed-loop concurrencies to sweep"
    )
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8], help="images per /infer request")
    ap.add_argument("--max-batch", type=int, default=8, help="the server's max batch size")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds of ORT and server")
    ap.add_argument("--tag", default="")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--onnx", type=Path)
    ap.add_argument("--card", type=Path)
    ap.add_argument("--port-file", type=Path)
    a = ap.parse_args()
    if a.child:
        child_server(a.onnx, a.card, a.port_file, a.max_batch)
        return

    load_start = os.getloadavg()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        onnx_path, card_path = build_model(tmp)
        png, png_headers = png_body()
        proc, url = start_child(onnx_path, card_path, a.max_batch, tmp)
        infer_url, detect_url = f"{url}/v2/models/det/infer", f"{url}/v2/models/det/detect"
        try:
            ceiling = {}  # ORT at the server's max batch, measured once per round
            for b in a.batches:
                body, headers = infer_body(b)
                asyncio.run(_check(infer_url, body, headers))
                ort_rates: list[float] = []
                max_batch_rates: list[float] = []
                by_clients: dict[int, list[dict[str, Any]]] = {c: [] for c in a.clients}
                for _ in range(a.rounds):  # alternate: machine drift hits both alike
                    ort_rates.append(in_process(onnx_path, b, a.seconds))
                    if b != a.max_batch:
                        max_batch_rates.append(in_process(onnx_path, a.max_batch, a.seconds))
                    for c in a.clients:
                        run = asyncio.run(closed_loop(infer_url, body, headers, c, a.seconds))
                        by_clients[c].append({**run, "images_per_s": run["rps"] * b})
                sweep = {c: median([r["images_per_s"] for r in runs]) for c, runs in by_clients.items()}
                best = max(sweep, key=lambda c: sweep[c])
                ratio = sweep[best] / median(ort_rates)
                if max_batch_rates:
                    ceiling[b] = median(max_batch_rates)
                vs_max = sweep[best] / ceiling[b] if b in ceiling else ratio
                results[f"infer_batch{b}"] = {
                    "request_batch": b,
                    "in_process_ort_images_per_s": ort_rates,
                    "in_process_ort_max_batch_images_per_s": max_batch_rates,
                    "server_by_clients": {str(c): runs for c, runs in by_clients.items()},
                    "server_images_per_s": sweep[best],
                    "best_clients": best,
                    "ratio": ratio,
                    "ratio_vs_ort_at_max_batch": vs_max,
                }
                for c, runs in by_clients.items():
                    last = runs[-1]
                    print(
                        f"/infer batch {b}, {c:3d} clients: server {sweep[c]:8.1f} img/s "
                        f"(p50 {last['p50_ms']:.1f} ms, p99 {last['p99_ms']:.1f} ms, "
                        f"errors {sum(r['errors'] for r in runs)})"
                    )
                print(
                    f"/infer batch {b}: in-process ORT {median(ort_rates):8.1f} img/s, server at best "
                    f"({best} clients) {sweep[best]:8.1f} img/s   ratio {ratio:.3f}  (target >= 0.85)"
                    + (
                        f"; vs ORT at batch {a.max_batch} ({ceiling[b]:.1f} img/s): {vs_max:.3f}"
                        if b in ceiling
                        else ""
                    )
                )
            # The image endpoint, last: it shares the server's batch-size histogram with /infer.
            # Default threshold: the untrained model's boxes all fall below it, so the answer is
            # short; score_threshold=0: all 100 boxes per image go through post-processing and JSON.
            for key, query in (("detect_png", ""), ("detect_png_all_boxes", "?score_threshold=0")):
                first = json.loads(asyncio.run(_check(detect_url + query, png, png_headers)))
                boxes = len(first["detections"])
                clients = max(a.clients)
                detect = asyncio.run(closed_loop(detect_url + query, png, png_headers, clients, a.seconds))
                results[key] = {**detect, "query": query, "detections_per_answer": boxes, "clients": clients}
                print(
                    f"/detect{query} (96x96 PNG in, JSON with {boxes} boxes out): {detect['rps']:.1f} "
                    f"requests/s (p50 {detect['p50_ms']:.1f} ms, p99 {detect['p99_ms']:.1f} ms, "
                    f"errors {detect['errors']})"
                )
            results["mean_server_batch"] = _mean_batch(asyncio.run(_text(f"{url}/metrics")))
        finally:
            proc.terminate()
            proc.wait(30)
    load_end = os.getloadavg()
    print(f"load average start {load_start}, end {load_end}")
    path = write_result(
        "det_serve" + (f"_{a.tag}" if a.tag else ""),
        {
            "model": f"native_detector 3x{SIZE}x{SIZE} fp32 onnx, untrained (seed 0), 100 boxes per image",
            "clients": a.clients,
            "seconds": a.seconds,
            "rounds": a.rounds,
            "max_batch": a.max_batch,
            "load_average_start": load_start,
            "load_average_end": load_end,
            "target": 0.85,
            **results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
