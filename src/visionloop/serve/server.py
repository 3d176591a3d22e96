"""Running the app under uvicorn: in the foreground (`visionloop serve`), or in a background
thread on a socket bound beforehand (tests and benchmarks: port 0, no race for a free port).

uvicorn picks uvloop and httptools when they are installed (`loop="auto"`, `http="auto"`) and
asyncio + h11 otherwise.

Security: with API keys (`keys`, a KeyRing over `<home>/serve/keys.json`) every request but
the health checks needs `Authorization: Bearer <key>` (serve.auth). Without keys the server
binds only to loopback: another address is refused unless `insecure_no_auth` says that is
meant. TLS: `tls=(certfile, keyfile)`, handed to uvicorn.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import uvicorn

from visionloop.core.errors import ConfigError, VisionloopError
from visionloop.core.httpproto import MAX_HEAD_BYTES, bounded_protocol
from visionloop.core.settings import Settings
from visionloop.serve.app import create_app
from visionloop.serve.collect import collected_dir
from visionloop.serve.config import ServeConfig
from visionloop.serve.keys import KeyRing
from visionloop.serve.predlog import predictions_dir
from visionloop.serve.source import ModelSource
from visionloop.serve.state import Server

log = logging.getLogger(__name__)


def predictions_path(settings: Settings, host: str, port: int) -> Path:
    """One log per listening address under the home: two servers never write the same file."""
    safe = host.replace(":", "_").replace("/", "_")
    return predictions_dir(settings.home) / f"{safe}-{port}.jsonl"


Tls = tuple[Path, Path]  # (certificate chain PEM, private key PEM)


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_exposure(host: str, keys: KeyRing | None, insecure_no_auth: bool) -> None:
    """Refuse to listen beyond loopback without API keys, unless told that is meant."""
    if keys is None and not insecure_no_auth and not is_loopback(host):
        raise ConfigError(
            f"refusing to listen on {host} without API keys: anyone who can reach it could use "
            "every model. Create a key (`visionloop serve keys create NAME --models M`) and pass "
            "--keys, or pass --insecure-no-auth if a proxy in front of it authenticates."
        )


def resolve_keys(settings: Settings, require: bool = False, insecure_no_auth: bool = False) -> KeyRing | None:
    """The keys a server started with these flags checks: required with `require` or as soon
    as `<home>/serve/keys.json` holds a key; none with `insecure_no_auth`."""
    if require and insecure_no_auth:
        raise ConfigError("--keys and --insecure-no-auth contradict each other; pass one.")
    if insecure_no_auth:
        return None
    ring = KeyRing.for_home(settings.home)
    return ring if require or len(ring) else None


def check_tls(tls: Tls | None) -> None:
    for f in tls or ():
        if not Path(f).is_file():
            raise ConfigError(
                f"TLS file {f} does not exist; give --ssl-certfile and --ssl-keyfile PEM files."
            )


def _uvicorn_config(app: object, config: ServeConfig, tls: Tls | None = None) -> uvicorn.Config:
    return uvicorn.Config(
        app,  # type: ignore[arg-type]
        host=config.host,
        port=config.port,
        log_level="warning",
        access_log=False,
        loop="auto",
        # uvicorn's own choice (httptools when installed, else h11) with a bounded request head
        # that must arrive within `head_timeout_s` (core/httpproto.py): before, one connection
        # sending headers without end, before any key was read, grew the server by as much.
        http=bounded_protocol(config.head_timeout_s),
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        # Keep-alive clients (tritonclient pools connections) must not be cut between requests.
        timeout_keep_alive=30,
        # The server reads no client address, so X-Forwarded-* rewriting is a layer for nothing.
        proxy_headers=False,
        lifespan="on",
        ssl_certfile=str(tls[0]) if tls else None,
        ssl_keyfile=str(tls[1]) if tls else None,
    )


def serve_forever(
    config: ServeConfig,
    source: ModelSource,
    settings: Settings,
    on_ready: Callable[[Server], None] | None = None,
    on_stop: Callable[[Server], None] | None = None,
    keys: KeyRing | None = None,
    insecure_no_auth: bool = False,
    tls: Tls | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM; raises if a model cannot be loaded at start-up.

    On a signal uvicorn drains, runs the app's shutdown (then `on_stop`) and re-raises the
    signal, so nothing after this call runs then: report the stop from `on_stop`."""
    check_exposure(config.host, keys, insecure_no_auth)
    check_tls(tls)
    path = predictions_path(settings, config.host, config.port)
    app = create_app(config, source, path, on_ready, on_stop, keys, collected_dir(settings.home))
    server = uvicorn.Server(_uvicorn_config(app, config, tls))
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

    def __init__(
        self,
        config: ServeConfig,
        source: ModelSource,
        predictions: Path | None = None,
        keys: KeyRing | None = None,
        tls: Tls | None = None,
        insecure_no_auth: bool = False,
        collected: Path | None = None,
    ) -> None:
        """`collected`: where collected images go when the config enables `collect` without
        a `dir` (`serve.collect.collected_dir(home)` is the home's)."""
        check_exposure(config.host, keys, insecure_no_auth)
        check_tls(tls)
        self.tls = tls
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((config.host, config.port))
        self.port: int = self.sock.getsockname()[1]
        self.config = config.model_copy(update={"port": self.port})
        self.app = create_app(self.config, source, predictions, keys=keys, collected=collected)
        self.server = uvicorn.Server(_uvicorn_config(self.app, self.config, tls))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.config.host}:{self.port}"

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
