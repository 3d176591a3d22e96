"""Starting and stopping the control plane (`visionloop up` / `visionloop down`).

`up` opens the store (migrating it), syncs the GPU inventory and teams, makes sure an admin
token exists (`<home>/admin.token`, mode 0600: the first admin credential), writes
`<home>/control-plane.json` (url, pid) so the CLI finds it, and serves the API with the
scheduler in a background thread. `--detach` starts the same thing as a background process
and returns once it answers.

The job store's URL comes from `VISIONLOOP_DB_URL` or a file (`--db-url-file`), never from
the command line when it carries a password (argv is readable by every user: `ps`,
/proc/PID/cmdline); `--detach` hands it to the child through its environment.

The executor comes from the cluster config (`[executor]`: local processes by default, or
an existing Ray cluster); see `build_plane`.

Stopping the control plane never stops jobs: their processes run in their own sessions (or
in the Ray cluster) and are re-adopted by the next `up` (which also requeues any that ended
or vanished meanwhile).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from visionloop.api.client import ADMIN_TOKEN_FILE, STATE_FILE, server_state
from visionloop.core.errors import ConfigError, VisionloopError
from visionloop.core.fsutil import atomic_write_text, tail_lines
from visionloop.core.httpproto import HEAD_TIMEOUT_S, MAX_HEAD_BYTES, bounded_protocol
from visionloop.core.settings import Settings
from visionloop.sched.config import ClusterConfig, load_cluster_config
from visionloop.sched.executors.base import Executor
from visionloop.sched.service import ControlPlane

if TYPE_CHECKING:
    import uvicorn

    from visionloop.sched.store import Store

log = logging.getLogger(__name__)

DEFAULT_PORT = 8765
DB_URL_ENV = "VISIONLOOP_DB_URL"


def uvicorn_config(
    app: Any, host: str, port: int, *, head_timeout_s: float = HEAD_TIMEOUT_S, **options: Any
) -> uvicorn.Config:
    """How the control plane's API is served (by `up`, and by the tests' control planes):
    request heads bounded in size and sent in time (`core.httpproto`)."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=bounded_protocol(head_timeout_s),
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        **{"log_level": "warning", "access_log": False, **options},
    )


def _has_password(url: str) -> bool:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).password is not None
    except (ArgumentError, ValueError):
        # Not a URL SQLAlchemy can parse (Store.open says so later); look for user:pass@.
        netloc = url.partition("://")[2].partition("/")[0]
        return ":" in netloc.rpartition("@")[0]


def resolve_db_url(db: str | None = None, db_url_file: Path | None = None) -> str | None:
    """The job store URL for `up`: `--db` (only without a password), else `--db-url-file`,
    else VISIONLOOP_DB_URL, else None (SQLite under the home)."""
    if db is not None and db_url_file is not None:
        raise ConfigError("pass --db or --db-url-file, not both.")
    if db is not None:
        if _has_password(db):
            raise ConfigError(
                "--db carries a password, which every user of this machine can read on the command line "
                f"(ps, /proc/PID/cmdline). Put the URL in the {DB_URL_ENV} environment variable, or in a "
                "file only you can read (chmod 600) given with --db-url-file PATH."
            )
        return db
    if db_url_file is not None:
        path = Path(db_url_file).expanduser()
        try:
            mode = path.stat().st_mode
            url = path.read_text(encoding="utf-8").strip()
        except OSError as e:
            raise ConfigError(f"cannot read the job store URL from --db-url-file {path}: {e}") from e
        if mode & 0o007:
            raise ConfigError(
                f"{path} holds the job store's password and every user can read it; `chmod 600 {path}`."
            )
        if not url:
            raise ConfigError(
                f"{path} is empty; write the job store URL in it, e.g. postgresql+psycopg://..."
            )
        return url
    return os.environ.get(DB_URL_ENV) or None


def build_executor(config: ClusterConfig) -> Executor:
    """The executor `config.executor` names: local processes (GPUs from `[[inventory]]`, or
    discovered with NVML), an existing Ray cluster or an existing Slurm cluster (GPUs read from
    the cluster)."""
    ex = config.executor
    if ex.kind == "ray":
        from visionloop.sched.executors.ray import RayExecutor

        return RayExecutor(ex.address, prefix=ex.prefix, request_timeout_s=ex.request_timeout_s)
    if ex.kind == "slurm":
        from visionloop.sched.executors.slurm import SlurmExecutor

        return SlurmExecutor(
            ex.partition,
            account=ex.account,
            prefix=ex.prefix,
            slurm_conf=ex.slurm_conf,
            command_timeout_s=ex.command_timeout_s,
            python=ex.python,
        )
    from visionloop.sched.executors.local import LocalExecutor

    return LocalExecutor(inventory=list(config.inventory) if config.inventory is not None else None)


def _check_open_attempts(store: Store, executor: Executor, config: ClusterConfig) -> None:
    """Refuse to start on another executor than the one running jobs: it could not find their
    processes, would declare them lost and run them a second time."""
    others: dict[str, list[int]] = {}
    for attempt in store.active_attempts():
        if attempt.executor != executor.name:
            others.setdefault(attempt.executor, []).append(attempt.job_id)
    if others:
        where = f" in {config.source}" if config.source else ""
        jobs = "; ".join(
            f"{name!r}: job(s) {', '.join(map(str, ids))}" for name, ids in sorted(others.items())
        )
        raise ConfigError(
            f"the cluster config selects the {executor.name!r} executor, but jobs still run on another one "
            f"({jobs}). Start with [executor] kind set back to that one{where}, and let those jobs finish "
            "or `visionloop jobs cancel` them, before switching executors."
        )


def build_plane(settings: Settings, config: ClusterConfig, db_url: str | None) -> ControlPlane:
    """The control plane for `config`: the job store at `db_url` (default: SQLite under the
    home) and the executor the config names, whose capacity becomes the GPU inventory."""
    from visionloop.sched.store import Store, default_url

    executor = build_executor(config)
    store = Store.open(db_url or default_url(settings))
    try:
        _check_open_attempts(store, executor, config)
        return ControlPlane(store, executor, config, settings)
    except BaseException:
        store.close()
        raise


def ensure_admin_token(plane: ControlPlane, home: Path) -> Path:
    path = home / ADMIN_TOKEN_FILE
    if path.is_file() and plane.store.authenticate(path.read_text().strip()) is not None:
        return path
    token = plane.store.create_token(team=None, admin=True, label="bootstrap (visionloop up)")
    # 0600 from the first byte (not a umask change: that is process-wide, racing other threads).
    atomic_write_text(path, token + "\n", mode=0o600)
    return path


def _alive(pid: int, started: float | None = None) -> bool:
    """Whether `pid` is a live process, and the same one that wrote the state file: a
    SIGKILLed control plane leaves a zombie (where nothing reaps it) or a pid that the
    system hands to another process later, and neither must block the next `up`."""
    import psutil

    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(proc.create_time() - started) < 1.0
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def _own_start_time() -> float:
    import psutil

    return float(psutil.Process(os.getpid()).create_time())


def running_server(settings: Settings) -> dict[str, Any] | None:
    state = server_state(settings)
    if state and isinstance(state.get("pid"), int):
        started = state.get("pid_started")
        if _alive(state["pid"], float(started) if isinstance(started, int | float) else None):
            return state
    return None


def serve(settings: Settings, config_path: Path, db_url: str | None, host: str, port: int) -> None:
    """Run in the foreground until SIGTERM/SIGINT."""
    import uvicorn

    from visionloop.api.app import create_app

    settings.ensure()
    existing = running_server(settings)
    if existing and existing.get("pid") != os.getpid():
        raise ConfigError(
            f"a control plane is already running for {settings.home} (pid {existing['pid']}, "
            f"{existing.get('url')}); stop it with `visionloop down` first."
        )
    config = load_cluster_config(config_path)
    plane = build_plane(settings, config, db_url)
    ensure_admin_token(plane, settings.home)
    server = uvicorn.Server(uvicorn_config(create_app(plane), host, port))
    url = f"http://{host}:{port}"
    state_path = settings.home / STATE_FILE
    atomic_write_text(
        state_path,
        json.dumps(
            {"url": url, "pid": os.getpid(), "pid_started": _own_start_time(), "started_at": time.time()}
        ),
    )
    try:
        server.run()
    finally:
        plane.store.close()
        if (server_state(settings) or {}).get("pid") == os.getpid():
            state_path.unlink(missing_ok=True)


def detach(
    settings: Settings, config_path: Path, db_url: str | None, host: str, port: int, wait_s: float = 60
) -> str:
    """Start `up` in the background; return its url once it answers."""
    import httpx

    settings.ensure()
    existing = running_server(settings)
    if existing:
        raise ConfigError(
            f"a control plane is already running for {settings.home} (pid {existing['pid']}, "
            f"{existing.get('url')}); `visionloop down` stops it."
        )
    cmd = [
        sys.executable,
        "-m",
        "visionloop",
        "up",
        "--host",
        host,
        "--port",
        str(port),
        "--config",
        str(config_path),
    ]
    env = {**os.environ, "VISIONLOOP_HOME": str(settings.home)}
    if db_url:
        env[DB_URL_ENV] = db_url  # never in argv: every user can read a process's command line
    log_path = settings.home / "control-plane.log"
    # Owner-only from the first byte: the log can hold job specs, paths and error details.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
    url = f"http://{host}:{port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            try:
                tail = tail_lines(log_path, 15)  # appended to across starts: its end only
            except OSError as e:
                tail = [f"(its log {log_path} could not be read: {e})"]
            raise VisionloopError(f"the control plane exited with {proc.returncode}:\n" + "\n".join(tail))
        try:
            if httpx.get(f"{url}/v1/health", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    # Do not leave a control plane nobody knows started: stop it before saying it failed.
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    raise VisionloopError(
        f"the control plane did not answer at {url} within {wait_s:.0f} s, and was stopped; see {log_path}."
    )


def stop(settings: Settings, wait_s: float = 30) -> int | None:
    """SIGTERM the running control plane; return its pid, or None if none ran."""
    state = running_server(settings)
    if state is None:
        (settings.home / STATE_FILE).unlink(missing_ok=True)
        return None
    pid = int(state["pid"])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and _alive(pid, state.get("pid_started")):
        time.sleep(0.1)
    if _alive(pid, state.get("pid_started")):
        raise VisionloopError(f"the control plane (pid {pid}) did not stop within {wait_s:.0f} s.")
    return pid
