"""visionloop serve against real peers: LitServe, and Triton through PyTriton.

All servers serve the same ONNX file (`build_model` of throughput.py: resnet18 at 224 px by
default; `--arch small_cnn --size 32` is the demo's model) with the same dynamic batching (max
batch `--batch`, 2 ms queue delay, throughput.py's) and the same compute: `--concurrency`
batches at once (visionloop: `batch_concurrency` on one session; LitServe: `workers_per_device`
worker processes; Triton: that many model instances), each ONNX Runtime session given
`cores // concurrency` intra-op threads (visionloop's own rule) and visionloop's session
options. Everything else is each server's default. The load is throughput.py's closed-loop
aiohttp clients (1 and 32), batch-1 requests, pre-encoded bodies:

- `json`: the KServe v2 JSON body, `{"inputs": [{"name", "shape", "datatype": "FP32",
  "data": [...]}]}`, the same bytes to every server (LitServe's LitAPI reads this document).
- `binary`: visionloop and Triton: the KServe v2 binary tensor extension with a binary output
  (throughput.py's `request_body`). LitServe has no binary tensor format; its only non-JSON
  body is multipart/form-data, so its `binary` is the raw tensor bytes as a form file upload
  (what LitServe's docs do for images).

Servers take turns, one at a time, each in its own process group and session (the scheduler's
autogroups share the CPU between sessions: a server in the client's session would share its
part with the client), `--rounds` times, and the order rotates each round; each figure is the
median over the rounds. Before the load, every server answers the same eight inputs as JSON,
and its logits and top-1 classes are compared with in-process ONNX Runtime (printed; a
difference stops the run, as does any error answer under load).

    pip install -e '.[peer]'   # LitServe 0.2.19 and python-multipart (Apache-2.0), not in the main install
    python benchmarks/serve/peer.py [--arch resnet18 --size 224] [--rounds 3 --seconds 8]
                                    [--clients 1,32] [--formats json,binary] [--batch 8]
                                    [--pytriton-python PATH]

PyTriton (Apache-2.0; bundles a Triton server 2.51 binary, which runs on a CPU-only machine)
needs numpy < 2, which visionloop's environment does not allow, so it lives in a venv of its
own, of the same Python version, and is used only when `--pytriton-python` names that venv's
interpreter:

    python -m venv /tmp/pyt_venv && /tmp/pyt_venv/bin/pip install nvidia-pytriton 'numpy<2' onnxruntime

Results: benchmarks/results/serve_peer[_ARCH].json (`--name` for another); figures and
findings in BENCHMARKS.md, "Inference server against a peer".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

MODEL = "resnet"  # the model's name in throughput.py's visionloop child, used by every server
INFER_PATH = f"/v2/models/{MODEL}/infer"
DELAY_MS = 2.0  # throughput.py's visionloop child: max_queue_delay_ms
SERVERS = ("visionloop", "litserve", "pytriton")


def _session(onnx_path: str, threads: int) -> Any:
    """An ORT session with visionloop.serve.runtime.OnnxModel's options (this module also
    runs in PyTriton's venv, where visionloop is not installed)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(onnx_path, sess_options=opts, providers=["CPUExecutionProvider"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- LitServe (child process)

try:  # LitServe's workers are spawned and unpickle the LitAPI by name: it must be module-level
    import litserve as ls
except ImportError:  # not installed (or PyTriton's venv)
    ls = None

if ls is not None:

    class OrtLitAPI(ls.LitAPI):  # type: ignore[misc]
        """The same ONNX file in an ORT session, batched by LitServe."""

        def __init__(self, onnx_path: str, threads: int, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.onnx_path, self.threads = onnx_path, threads

        def setup(self, device: str) -> None:
            self.session = _session(self.onnx_path, self.threads)
            shape = [1 if not isinstance(d, int) else d for d in self.session.get_inputs()[0].shape]
            self.session.run(None, {"input": np.zeros(shape, np.float32)})

        # Unannotated, as in LitServe's examples: an annotation becomes the endpoint's
        # request model (or, with `encode_response`'s, its response model).
        def decode_request(self, request):  # type: ignore[no-untyped-def]
            if "inputs" in request:  # the KServe v2 JSON document
                t = request["inputs"][0]
                if t.get("datatype") != "FP32" or t.get("name") != "input":
                    raise ValueError("expected one FP32 input named 'input'")
                return np.asarray(t["data"], dtype=np.float32).reshape(t["shape"])
            # multipart/form-data: the raw tensor as a file, its shape as a field
            shape = [int(d) for d in request["shape"].split(",")]
            return np.frombuffer(request["tensor"].file.read(), dtype=np.float32).reshape(shape)

        def batch(self, inputs: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(inputs)

        def predict(self, x: np.ndarray) -> np.ndarray:
            return self.session.run(["logits"], {"input": x})[0]

        def unbatch(self, output: np.ndarray) -> list[np.ndarray]:
            return list(output)

        def encode_response(self, output):  # type: ignore[no-untyped-def]
            return {
                "model_name": MODEL,
                "outputs": [
                    {"name": "logits", "datatype": "FP32", "shape": [1, output.size], "data": output.tolist()}
                ],
            }


def litserve_child(a: argparse.Namespace) -> None:
    if ls is None:
        sys.exit("LitServe is not installed: pip install -e '.[peer]'")
    api = OrtLitAPI(
        str(a.onnx),
        a.threads,
        max_batch_size=a.batch,
        batch_timeout=DELAY_MS / 1000.0,
        api_path=INFER_PATH,
    )
    server = ls.LitServer(
        api,
        accelerator="cpu",
        devices=1,
        workers_per_device=a.concurrency,
        timeout=60,
        fast_queue=a.fast_queue,
    )
    port = _free_port()
    a.port_file.write_text(str(port))
    server.run(
        host="127.0.0.1",
        port=port,
        log_level="warning",
        generate_client_file=False,
        num_api_servers=a.api_servers or None,
    )


# ---------------------------------------------------------------- PyTriton (child process)


def pytriton_child(a: argparse.Namespace) -> None:
    import sysconfig

    # The python-backend stub links libpython3.X.so from the loader's path; a Python built
    # elsewhere (pyenv) must put its own first, or the stub runs this stdlib on the system's
    # older libpython (seen: "'_thread.RLock' object has no attribute '_recursion_count'").
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    os.environ["LD_LIBRARY_PATH"] = ":".join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH")) if p)
    from pytriton.decorators import batch
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    def make(session: Any) -> Any:
        @batch
        def infer(input: np.ndarray) -> dict[str, np.ndarray]:
            return {"logits": session.run(["logits"], {"input": input})[0]}

        return infer

    sessions = [_session(str(a.onnx), a.threads) for _ in range(a.concurrency)]
    port = _free_port()
    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=port,
        grpc_address="127.0.0.1",
        grpc_port=_free_port(),
        metrics_port=_free_port(),
        allow_metrics=False,
        log_verbose=0,
    )
    with Triton(config=config) as triton:
        triton.bind(
            model_name=MODEL,
            infer_func=[make(s) for s in sessions],  # one model instance each
            inputs=[Tensor(name="input", dtype=np.float32, shape=(3, a.size, a.size))],
            outputs=[Tensor(name="logits", dtype=np.float32, shape=(-1,))],
            config=ModelConfig(
                max_batch_size=a.batch,
                batcher=DynamicBatcher(max_queue_delay_microseconds=int(DELAY_MS * 1000)),
            ),
        )
        a.port_file.write_text(str(port))
        triton.serve()


# ---------------------------------------------------------------- parent


def start_server(
    kind: str, a: argparse.Namespace, onnx_path: Path, card_path: Path, tmp: Path, threads: int
) -> tuple[subprocess.Popen[bytes], str]:
    """The server in a session (process group) of its own. visionloop is throughput.py's
    child, started as its `start_child` does, but in its own session like the peers: with
    Linux's scheduler autogroups (on here) a session shares the CPU as one, so a server left
    in the client's session would share its share with the client."""
    port_file = tmp / f"{kind}.port"
    port_file.unlink(missing_ok=True)
    env = dict(os.environ)
    if kind == "visionloop":
        script = Path(__file__).with_name("throughput.py")
        cmd = [sys.executable, str(script), "--child", "visionloop", "--card", str(card_path)]
        cmd += ["--batch", str(a.batch), "--device", "cpu"]
        overrides = {"batch_concurrency": a.concurrency, "intra_op_threads": threads}
        env["VL_SERVE_OVERRIDES"] = json.dumps(overrides)
    else:
        python = a.pytriton_python if kind == "pytriton" else sys.executable
        cmd = [str(python), __file__, "--child", kind, "--batch", str(a.batch), "--size", str(a.size)]
        cmd += ["--concurrency", str(a.concurrency), "--threads", str(threads)]
        cmd += ["--api-servers", str(a.api_servers)] + (["--fast-queue"] if a.fast_queue else [])
    cmd += ["--onnx", str(onnx_path), "--port-file", str(port_file)]
    with open(tmp / f"{kind}.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + 180
    while not port_file.is_file() or not port_file.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            tail = (tmp / f"{kind}.log").read_bytes()[-3000:].decode(errors="replace")
            raise RuntimeError(f"the {kind} server did not start; the end of its log:\n{tail}")
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port_file.read_text()}"


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT (visionloop stops; both peers shut their workers down on it), then SIGTERM,
    then SIGKILL, to the server's own process group; then SIGKILL to the group's stragglers
    (workers, tritonserver)."""
    for sig, wait in ((signal.SIGINT, 10), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def json_body(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    doc = {
        "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]
    }
    return json.dumps(doc).encode(), {"Content-Type": "application/json"}


def multipart_body(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """The raw tensor as a form file upload, pre-encoded (LitServe's only non-JSON body)."""
    b = "vlpeerboundary7f3a"
    shape = ",".join(str(d) for d in x.shape)
    body = (
        f'--{b}\r\nContent-Disposition: form-data; name="shape"\r\n\r\n{shape}\r\n'
        f'--{b}\r\nContent-Disposition: form-data; name="tensor"; filename="x.bin"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    body += x.tobytes() + f"\r\n--{b}--\r\n".encode()
    return body, {"Content-Type": f"multipart/form-data; boundary={b}"}


def bodies(kind: str, size: int) -> dict[str, tuple[bytes, dict[str, str]]]:
    from throughput import request_body

    x = np.random.default_rng(1).standard_normal((1, 3, size, size)).astype(np.float32)
    binary = multipart_body(x) if kind == "litserve" else request_body(size)
    return {"json": json_body(x), "binary": binary}


async def answers(url: str, xs: np.ndarray, deadline_s: float = 180.0) -> np.ndarray:
    """Each row of `xs` as one JSON request; the logits. Retries while the server warms up
    (LitServe opens its port before its workers are ready)."""
    import aiohttp

    out = []
    deadline = time.monotonic() + deadline_s
    async with aiohttp.ClientSession() as s:
        for i in range(len(xs)):
            body, headers = json_body(xs[i : i + 1])
            while True:
                try:
                    async with s.post(url, data=body, headers=headers) as r:
                        text = await r.read()
                        if r.status == 200:
                            out.append(np.asarray(json.loads(text)["outputs"][0]["data"], np.float32))
                            break
                        err = f"{r.status} {text[:200]!r}"
                except aiohttp.ClientError as e:
                    err = repr(e)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} did not answer: {err}")
                await asyncio.sleep(0.5)
    return np.stack(out)


def _versions(pytriton_python: Path | None) -> dict[str, str]:
    from importlib.metadata import version

    out = {p: version(p) for p in ("onnxruntime", "litserve", "uvicorn", "fastapi") if _installed(p)}
    if pytriton_python:
        code = "from importlib.metadata import version as v; print(v('nvidia-pytriton'), v('onnxruntime'))"
        pyt, ort = subprocess.run(
            [str(pytriton_python), "-c", code], capture_output=True, text=True, check=True
        ).stdout.split()
        out |= {"nvidia-pytriton": pyt, "onnxruntime (pytriton venv)": ort}
    return out


def _installed(dist: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(dist)
    except PackageNotFoundError:
        return False
    return True


def summarise(cells: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    return {
        k: {
            "rps": statistics.median(r["rps"] for r in runs),
            "p50_ms": statistics.median(r["p50_ms"] for r in runs),
            "p99_ms": statistics.median(r["p99_ms"] for r in runs),
            "errors": sum(r["errors"] for r in runs),
            "rounds": runs,
        }
        for k, runs in cells.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="resnet18")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--clients", default="1,32")
    ap.add_argument("--formats", default="json,binary")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=2, help="batches computing at once (see above)")
    ap.add_argument("--servers", default="visionloop,litserve,pytriton")
    ap.add_argument("--pytriton-python", type=Path, help="the Python of a venv with nvidia-pytriton")
    ap.add_argument(
        "--api-servers", type=int, default=0, help="LitServe's HTTP processes; 0: its default (= workers)"
    )
    ap.add_argument("--fast-queue", action="store_true", help="LitServe's ZeroMQ queue (default: off)")
    ap.add_argument("--name", help="results file name (default serve_peer[_ARCH])")
    ap.add_argument("--child", choices=["litserve", "pytriton"])
    ap.add_argument("--onnx", type=Path)
    ap.add_argument("--port-file", type=Path)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    if a.child == "litserve":
        litserve_child(a)
        return
    if a.child == "pytriton":
        pytriton_child(a)
        return

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from throughput import build_model, closed_loop

    from _common import write_result

    servers = [s for s in a.servers.split(",") if s]
    if "pytriton" in servers and not a.pytriton_python:
        print("no --pytriton-python: Triton skipped")
        servers.remove("pytriton")
    if "litserve" in servers and ls is None:
        sys.exit("LitServe is not installed: pip install -e '.[peer]'")
    clients = [int(c) for c in a.clients.split(",")]
    formats = [f for f in a.formats.split(",") if f]
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores // a.concurrency)
    print(
        f"{a.arch} {a.size} px, max batch {a.batch}, {DELAY_MS} ms delay, {a.concurrency} batches at once x "
        f"{threads} ORT thread(s), {cores} cores; load average {os.getloadavg()}"
    )
    load_at_start = os.getloadavg()
    cells: dict[str, dict[str, list[dict[str, Any]]]] = {s: {} for s in servers}
    checks: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        onnx_path, card_path = build_model(tmp, a.size, a.arch)
        # Eight inputs of different scales and channel offsets (so that the demo's model, at
        # least, answers more than one class; the logits are compared as well).
        rng = np.random.default_rng(7)
        xs = np.stack(
            [
                rng.standard_normal((3, a.size, a.size)) * rng.uniform(0.2, 3) + rng.uniform(-3, 3, (3, 1, 1))
                for _ in range(8)
            ]
        ).astype(np.float32)
        ref = np.concatenate([_session(str(onnx_path), 1).run(["logits"], {"input": x[None]})[0] for x in xs])
        for rnd in range(a.rounds):
            order = servers[rnd % len(servers) :] + servers[: rnd % len(servers)]
            for kind in order:
                for attempt in range(3):
                    try:
                        proc, url = start_server(kind, a, onnx_path, card_path, tmp, threads)
                        break
                    except RuntimeError as e:  # PyTriton times out on its own start now and then
                        if attempt == 2:
                            raise
                        print(f"{kind} did not start; once more. {str(e)[-300:]}")
                try:
                    infer = url + INFER_PATH
                    got = asyncio.run(answers(infer, xs))
                    same = bool((got.argmax(1) == ref.argmax(1)).all())
                    diff = float(np.abs(got - ref).max())
                    if rnd == 0:
                        checks[kind] = {
                            "top1": got.argmax(1).tolist(),
                            "same_top1": same,
                            "max_abs_diff": diff,
                        }
                        print(
                            f"check {kind}: top-1 {got.argmax(1).tolist()} (ORT {ref.argmax(1).tolist()}), "
                            f"max |logit diff| {diff:.2e}"
                        )
                    if not same or diff > 1e-3:
                        sys.exit(f"{kind} answers differently from ONNX Runtime (see the check above)")
                    for fmt, (body, headers) in bodies(kind, a.size).items():
                        if fmt not in formats:
                            continue
                        for c in clients:
                            r = asyncio.run(closed_loop(infer, body, headers, c, a.seconds))
                            cells[kind].setdefault(f"{fmt}@{c}", []).append(r)
                            if r["errors"]:  # closed_loop counts them in its rate too
                                sys.exit(f"{kind} answered {r['errors']} {fmt} requests with an error")
                            print(
                                f"round {rnd + 1} {kind:10s} {fmt:6s} {c:3d} clients: {r['rps']:8.1f} req/s  "
                                f"p50 {r['p50_ms']:7.1f}  p99 {r['p99_ms']:7.1f} ms  errors {r['errors']}"
                            )
                finally:
                    stop_server(proc)

    results = {kind: summarise(c) for kind, c in cells.items()}
    ratios: dict[str, dict[str, float]] = {}
    print(f"\nmedian of {a.rounds} rounds; ratio = visionloop / peer (throughput > 1 and p99 < 1 favour us)")
    print(f"{'format':6s} {'clients':>7s} {'server':10s} {'req/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for fmt in formats:
        for c in clients:
            key = f"{fmt}@{c}"
            ours = results.get("visionloop", {}).get(key)
            for kind in servers:
                r = results[kind].get(key)
                if r is None:
                    continue
                print(f"{fmt:6s} {c:7d} {kind:10s} {r['rps']:8.1f} {r['p50_ms']:8.1f} {r['p99_ms']:8.1f}")
                if ours is not None and kind != "visionloop":
                    q = {
                        "rps": ours["rps"] / r["rps"],
                        "p50": ours["p50_ms"] / r["p50_ms"],
                        "p99": ours["p99_ms"] / r["p99_ms"],
                    }
                    ratios[f"{key} vs {kind}"] = q
                    print(
                        f"  visionloop / {kind}: throughput {q['rps']:.2f}x, "
                        f"p50 {q['p50']:.2f}, p99 {q['p99']:.2f}"
                    )
    target = {}
    for kind in servers:
        if kind == "visionloop":
            continue
        for fmt in formats:
            q = ratios.get(f"{fmt}@32 vs {kind}")
            if q is not None:
                target[f"{fmt} vs {kind}"] = bool(q["rps"] > 1.0 and q["p99"] < 1.0)
    print(f"\ntarget (ahead in throughput at 32 clients with a lower p99): {target}")
    path = write_result(
        a.name or ("serve_peer" + ("" if a.arch == "resnet18" else f"_{a.arch}")),
        {
            "model": f"{a.arch} 3x{a.size}x{a.size} fp32 onnx",
            "batch": a.batch,
            "queue_delay_ms": DELAY_MS,
            "concurrency": a.concurrency,
            "ort_threads_per_session": threads,
            "litserve": {"api_servers": a.api_servers or "default (= workers)", "fast_queue": a.fast_queue},
            "clients": clients,
            "formats": formats,
            "rounds": a.rounds,
            "seconds": a.seconds,
            "versions": _versions(a.pytriton_python if "pytriton" in servers else None),
            "load_on_machine_at_start": load_at_start,
            "load_on_machine_at_end": os.getloadavg(),
            "checks": checks,
            "results": results,
            "ratios": ratios,
            "target_met": target,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
