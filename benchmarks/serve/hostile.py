"""What hostile requests cost the inference server: memory and event-loop stalls, against
baselines measured in the same run.

The real server (`BackgroundServer`, default limits) runs in its own process; psutil samples
its RSS every 10 ms. Model: torchvision resnet18 (random init) exported to ONNX, 3x64x64.

1. **Memory**: peak RSS while 8 clients each send a maximum-size image at once (a 6000x4000
   PNG, then a 6000x4000 JPEG: just under the 24 Mpx default limit), and 8 over-limit
   7999x7999 PNGs, each against the idle RSS.
2. **Event loop**: the worst /v2/health/live latency (a prober sends one every 20 ms) while
   hostile bodies arrive: a 10 MB multipart form of 200,000 parts, a 23 MB JSON tensor of
   nested lists, and maximum-size images; against the worst health latency with no load.

    python benchmarks/serve/hostile.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from throughput import build_model

from _common import write_result

MiB = 2**20


def child_server(onnx_path: Path, card_path: Path, port_file: Path) -> None:
    from visionloop.models.card import ModelCard
    from visionloop.serve.config import ServeConfig
    from visionloop.serve.server import BackgroundServer
    from visionloop.serve.source import StaticSource

    src = StaticSource()
    src.add("resnet", 1, onnx_path, ModelCard.load(card_path))
    cfg = ServeConfig(model="resnet", port=0, prediction_log=False, request_timeout_ms=120_000)
    server = BackgroundServer(cfg, src).start()
    port_file.write_text(str(server.port))
    server.thread.join()


class Peak:
    """The peak RSS of a process, sampled every 10 ms between start() and stop()."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return int(self.proc.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(0.01)

    def __enter__(self) -> Peak:
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _png(w: int, h: int, mode: str = "RGB") -> bytes:
    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([(x * 255 // w), (y * 255 // h), ((x + y) % 256)], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).convert(mode).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def _jpeg(w: int, h: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.open(io.BytesIO(_png(w, h))).save(buf, "JPEG", quality=85)
    return buf.getvalue()


def _multipart(parts: int) -> tuple[bytes, dict[str, str]]:
    part = b'--b\r\nContent-Disposition: form-data; name="x"\r\n\r\nhi\r\n'
    return part * parts + b"--b--\r\n", {"Content-Type": "multipart/form-data; boundary=b"}


def _nested_json(size: int) -> tuple[bytes, dict[str, str]]:
    inner = b"[" + b"0.5," * 999 + b"0.5]"
    n = size // (len(inner) + 1)
    head = b'{"inputs": [{"name": "input", "shape": [1, 3, 64, 64], "datatype": "FP32", "data": ['
    return head + b",".join([inner] * n) + b"]}]}", {"Content-Type": "application/json"}


def _concurrently(fn: Callable[[], Any], n: int) -> list[Any]:
    out: list[Any] = [None] * n

    def one(i: int) -> None:
        out[i] = fn()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def main() -> None:
    import httpx

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="hostile bodies of each kind in part 2")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--onnx", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--card", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child_server(a.onnx, a.card, a.port_file)
        return

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        onnx_path, card_path = build_model(tmp, 64)
        port_file = tmp / "port"
        cmd = [sys.executable, __file__, "--child", "--onnx", str(onnx_path), "--card", str(card_path)]
        proc = subprocess.Popen([*cmd, "--port-file", str(port_file)])
        try:
            deadline = time.monotonic() + 120
            while not port_file.is_file() or not port_file.read_text():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the server did not start")
                time.sleep(0.1)
            url = f"http://127.0.0.1:{port_file.read_text()}"
            result = run(url, proc.pid, a.rounds, httpx)
        finally:
            proc.terminate()
            proc.wait(30)
    path = write_result("serve_hostile", {**result, "load_on_machine": os.getloadavg()})
    print(f"wrote {path}")


def run(url: str, pid: int, rounds: int, httpx: Any) -> dict[str, Any]:
    classify = f"{url}/v2/models/resnet/classify"
    client = httpx.Client(timeout=300)
    small = _png(200, 150)
    assert client.post(classify, content=small).status_code == 200  # warm: model, transform, pools
    peak = Peak(pid)
    time.sleep(1.0)
    idle = peak.rss()
    print(f"idle RSS: {idle / MiB:.0f} MiB")

    # ---- 1. memory under 8 concurrent maximum-size images
    memory: dict[str, Any] = {"idle_rss_mib": idle / MiB}
    for name, body in (
        ("png_6000x4000", _png(6000, 4000)),
        ("jpeg_6000x4000", _jpeg(6000, 4000)),
        ("png_7999x7999_over_limit", _png(7999, 7999, "L")),
    ):
        before = peak.rss()
        with Peak(pid) as p:
            statuses = _concurrently(lambda body=body: client.post(classify, content=body).status_code, 8)
        memory[name] = {
            "body_mib": len(body) / MiB,
            "statuses": sorted(set(statuses)),
            "peak_rss_mib": p.peak / MiB,
            "peak_over_idle_mib": (p.peak - idle) / MiB,
            "rss_before_mib": before / MiB,
        }
        print(
            f"8 x {name} ({len(body) / MiB:.1f} MiB, answered {sorted(set(statuses))}): peak RSS "
            f"{p.peak / MiB:.0f} MiB, {(p.peak - idle) / MiB:+.0f} MiB over idle"
        )

    # ---- 2. health latency, idle and under hostile bodies
    def probe(stop: threading.Event, out: list[float]) -> None:
        with httpx.Client(timeout=300) as c:
            while not stop.is_set():
                t = time.perf_counter()
                assert c.get(f"{url}/v2/health/live").status_code == 200
                out.append(time.perf_counter() - t)
                time.sleep(0.02)

    def probed(work: Callable[[], Any]) -> tuple[list[float], Any]:
        stop = threading.Event()
        lat: list[float] = []
        t = threading.Thread(target=probe, args=(stop, lat))
        t.start()
        try:
            res = work()
        finally:
            stop.set()
            t.join()
        return lat, res

    quiet, _ = probed(lambda: time.sleep(3.0))
    print(f"health with no load: worst {max(quiet) * 1e3:.1f} ms over {len(quiet)} probes")
    infer = f"{url}/v2/models/resnet/infer"
    hostile = {
        "multipart_200000_parts": (classify, *_multipart(200_000)),
        "nested_json_23MB": (infer, *_nested_json(23 * 10**6)),
        "png_6000x4000": (classify, _png(6000, 4000), {"Content-Type": "image/png"}),
    }
    health: dict[str, Any] = {"idle_worst_ms": max(quiet) * 1e3, "idle_probes": len(quiet)}
    for name, (target, body, headers) in hostile.items():

        def work(target: str = target, body: bytes = body, headers: dict[str, str] = headers) -> list[Any]:
            out = []
            for _ in range(rounds):
                t = time.perf_counter()
                r = client.post(target, content=body, headers=headers)
                out.append((r.status_code, time.perf_counter() - t))
            return out

        lat, answers = probed(work)
        health[name] = {
            "body_mib": len(body) / MiB,
            "statuses": sorted({s for s, _ in answers}),
            "answer_s": [round(t, 3) for _, t in answers],
            "health_worst_ms": max(lat) * 1e3,
            "health_probes": len(lat),
            "ratio_vs_idle": max(lat) / max(quiet),
        }
        print(
            f"{name} ({len(body) / MiB:.1f} MiB) x{rounds}, answered {health[name]['statuses']} in "
            f"{health[name]['answer_s']} s: worst health {max(lat) * 1e3:.1f} ms "
            f"({max(lat) / max(quiet):.1f}x the idle worst)"
        )
    return {"model": "resnet18 3x64x64 fp32 onnx", "memory": memory, "health": health}


if __name__ == "__main__":
    main()
