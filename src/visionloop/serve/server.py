"""Running the app under uvicorn: in the foreground (`visionloop serve`), or in a background
thread on a socket bound beforehand (tests and benchmarks: port 0, no race for a free port).

uvicorn picks uvloop and httptools when they are installed (`loop="auto"`, `http="auto"`) and
asyncio + h11 otherwise.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn

from visionloop.core.errors import VisionloopError
from visionloop.core.settings import Settings
from visionloop.serve.app import create_app
from visionloop.serve.config import ServeConfig
from visionloop.serve.source import ModelSource
from visionloop.serve.state import Server

log = logging.getLogger(__name__)


def predictions_path(settings: Settings, host: str, port: int) -> Path:
    """One log per listening address under the home: two servers never write the same file."""
    safe = host.replace(":", "_").replace("/", "_")
    return settings.home / "serve" / "predictions" / f"{safe}-{port}.jsonl"


def _uvicorn_config(app: object, config: ServeConfig) -> uvicorn.Config:
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=config.host,
        port=config.port,
        log_level="warning",
        access_log=False,
        loop="auto",
        http="auto",
        # Keep-alive clients (tritonclient pools connections) must not be cut between requests.
        timeout_keep_alive=30,
        # The server reads no client address, so X-Forwarded-* rewriting is a layer for nothing.
        proxy_headers=False,
        lifespan="on",
    )


def serve_forever(
    config: ServeConfig,
    source: ModelSource,
    settings: Settings,
    on_ready: Callable[[Server], None] | None = None,
    on_stop: Callable[[Server], None] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM; raises if a model cannot be loaded at start-up.

    On a signal uvicorn drains, runs the app's shutdown (then `on_stop`) and re-raises the
    signal, so nothing after this call runs then: report the stop from `on_stop`."""
    path = predictions_path(settings, config.host, config.port)
    app = create_app(config, source, path, on_ready, on_stop)
    server = uvicorn.Server(_uvicorn_config(app, config))
    server.run()
    error = app.state.server.startup_error
    if isinstance(error, VisionloopError):
        raise error
    if error is not None:
        raise VisionloopError(f"the server could not load its models: {type(error).__name__}: {error}")
    if not server.started:
        raise VisionloopError(
            f"the server did not start on {config.host}:{config.port}; see the log above "
            "(a model that cannot load, or the port in use: pick another with --port)"
        )


class BackgroundServer:
    """The real server on a loopback socket in a thread of this process."""

    def __init__(self, config: ServeConfig, source: ModelSource, predictions: Path | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((config.host, config.port))
        self.port: int = self.sock.getsockname()[1]
        self.config = config.model_copy(update={"port": self.port})
        self.app = create_app(self.config, source, predictions)
        self.server = uvicorn.Server(_uvicorn_config(self.app, self.config))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.sock.close()
                raise VisionloopError("the server did not start; see the log")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
