"""Run `python -m visionloop ARGS` as a new process forked from a warm interpreter.

Why: a cold `python -m visionloop` spends 3-8 s of CPU importing mlflow (pandas, alembic,
mlflow.genai come with it), torch, `torch._dynamo` (the first optimizer imports it) and
matplotlib before it does anything, and the suite runs hundreds of them on a 2-core CI
machine. Here one server process per pytest worker imports those once; each call forks it,
and the fork runs the CLI exactly as `python -m visionloop` does: its own pid, argv,
environment, working directory, stdin/stdout/stderr, exit status, thread shutdown and atexit
hooks. Only the third-party imports are done already; visionloop itself is imported afresh
in every fork (its modules are not preloaded), so nothing visionloop reads at import time
can differ.

What stays cold: tests of start-up itself and of the process as a whole (the demo, `--help`,
signals: `_trainkit.popen`), and everything when VISIONLOOP_TEST_COLD_CLI=1 is set, which
runs every call as a plain subprocess: the way to check that the two agree.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

_HEADER = struct.Struct("!Q")

# Third-party modules a visionloop process imports on its common paths. Not visionloop's own.
_PRELOAD = (
    "numpy",
    "PIL.Image",
    "yaml",
    "typer",
    "rich.console",
    "rich.table",
    "pydantic",
    "sqlalchemy",
    "alembic",
    "safetensors.torch",
    "torch",
    "torch._dynamo",
    "torch.nn.functional",
    "torch.utils.data",
    "torchvision",
    "torchvision.transforms.v2",
    "mlflow",
    "mlflow.tracking",
    "mlflow.store.tracking.sqlalchemy_store",
    "mlflow.store.model_registry.sqlalchemy_store",
    "matplotlib.figure",
    "matplotlib.backends.backend_agg",
    "matplotlib.patches",
    "optuna",
)


def cold() -> bool:
    return os.environ.get("VISIONLOOP_TEST_COLD_CLI", "") not in ("", "0")


# ----------------------------------------------------------------------------- server side


def serve(sock_path: str, parent: int) -> None:
    import importlib

    for name in _PRELOAD:
        # An optional extra that is not installed: the fork imports what it needs itself.
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    # fork() copies only the calling thread: a Python thread started by an import would be
    # missing in every fork, with its locks possibly held. (The imports do start two C helper
    # threads, OpenBLAS's pool and pyarrow's jemalloc purger; both libraries re-create them
    # after a fork through their own pthread_atfork handlers, as every forking user relies on.)
    if threading.active_count() != 1:
        raise SystemExit(f"warm CLI server: {threading.enumerate()} after the imports; cannot fork safely")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    srv.listen(64)
    print("ready", flush=True)
    while True:
        while True:  # reap finished monitors
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
        if os.getppid() != parent:
            os._exit(0)  # the pytest worker is gone
        ready, _, _ = select.select([srv], [], [], 0.5)
        if not ready:
            continue
        conn, _ = srv.accept()
        if os.fork() == 0:
            srv.close()
            _monitor(conn)
        conn.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError("client went away")
        buf += chunk
    return buf


def _monitor(conn: socket.socket) -> None:
    """Fork the CLI process, tell the client its pid, wait for it and send its exit code."""
    try:
        head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
        (size,) = _HEADER.unpack(head)
        req = json.loads(_recv_exact(conn, size))
        pid = os.fork()
        if pid == 0:
            conn.close()
            _child(req, fds)
        for fd in fds:
            os.close(fd)
        conn.sendall(f"{pid}\n".encode())
        _, status = os.waitpid(pid, 0)
        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    finally:
        os._exit(0)


def _child(req: dict[str, Any], fds: list[int]) -> None:
    import runpy
    import signal
    import traceback

    code: int = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.path[0] = req["cwd"]  # as `python -m` puts the working directory first
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        threads = os.environ.get("OMP_NUM_THREADS")
        if threads and "torch" in sys.modules:
            # torch read OMP_NUM_THREADS when the server imported it; a cold process reads its own.
            sys.modules["torch"].set_num_threads(int(threads))
        sys.argv = ["visionloop", *req["args"]]
        try:
            runpy.run_module("visionloop", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        # What the interpreter does at exit: join non-daemon threads, run atexit, flush.
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code & 0xFF)


# ----------------------------------------------------------------------------- client side

_server: subprocess.Popen[str] | None = None
_sock_path: str | None = None
_lock = threading.Lock()


def _ensure_server() -> str:
    global _server, _sock_path
    with _lock:
        if _server is not None and _server.poll() is None and _sock_path:
            return _sock_path
        sock_dir = tempfile.mkdtemp(prefix="vl-warm-")
        _sock_path = os.path.join(sock_dir, "s")
        _server = subprocess.Popen(
            [sys.executable, __file__, _sock_path, str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,  # Ctrl-C on the test run does not reach the forks' parent
        )
        assert _server.stdout is not None
        line = _server.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(
                f"warm CLI server did not start (said {line!r}); rerun with VISIONLOOP_TEST_COLD_CLI=1"
            )
        atexit.register(_server.kill)
        return _sock_path


def run(
    args: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    timeout: float | None = None,
    input: str | None = None,
    start_cold: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Like `subprocess.run([python, -m, visionloop, *args], capture_output=True, text=True)`,
    which is what it runs when `start_cold` or VISIONLOOP_TEST_COLD_CLI is set."""
    full_env = dict(os.environ if env is None else env)
    if start_cold or cold():
        return subprocess.run(
            [sys.executable, "-m", "visionloop", *args],
            capture_output=True,
            text=True,
            env=full_env,
            cwd=cwd,
            timeout=timeout,
            input=input,
        )
    path = _ensure_server()
    with (
        tempfile.TemporaryFile() as stdin,
        tempfile.TemporaryFile() as stdout,
        tempfile.TemporaryFile() as stderr,
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn,
    ):
        if input is not None:
            stdin.write(input.encode())
            stdin.seek(0)
        conn.connect(path)
        payload = json.dumps({"args": list(args), "env": full_env, "cwd": str(cwd or os.getcwd())}).encode()
        socket.send_fds(
            conn, [_HEADER.pack(len(payload))], [stdin.fileno(), stdout.fileno(), stderr.fileno()]
        )
        conn.sendall(payload)
        reader = conn.makefile("r")
        pid = int(reader.readline())
        conn.settimeout(timeout)
        try:
            line = reader.readline()
        except TimeoutError:
            os.kill(pid, 9)
            raise subprocess.TimeoutExpired(["visionloop", *args], timeout or 0) from None
        if not line:
            raise RuntimeError("warm CLI server: the monitor went away without an exit status")
        code = int(line)
        out, err = (_text(f) for f in (stdout, stderr))
    return subprocess.CompletedProcess(["visionloop", *args], code, out, err)


def _text(f: Any) -> str:
    f.seek(0)
    # As subprocess.run(text=True): the locale's encoding (UTF-8 here), universal newlines.
    return f.read().decode().replace("\r\n", "\n").replace("\r", "\n")


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
