"""A real control plane for tests: the real store, the local executor with a fake GPU
inventory, the FastAPI app served by uvicorn on a loopback port, and an httpx client."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

from visionloop.core.settings import load_settings
from visionloop.sched.config import ClusterConfig, parse_cluster_config
from visionloop.sched.service import ControlPlane

# Two teams sharing the test inventory.
TEAMS: list[dict[str, Any]] = [
    {"name": "vision", "nominal_gpus": 1, "borrow_limit": 1},
    {"name": "research", "nominal_gpus": 1, "borrow_limit": 1},
]

# Fast timings so that a whole preemption round trip takes seconds, not minutes.
FAST = {"cycle_s": 0.2, "grace_s": 60, "min_runtime_s": 0, "heartbeat_timeout_s": 60, "retry_backoff_s": 0.5}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_roots() -> list[str]:
    """Where tests keep datasets (tmp_path, the digits dataset): pytest's base temp folder,
    the parent of the autouse `vl_home`. Jobs may read only under their allowed roots."""
    return [str(Path(os.environ["VISIONLOOP_HOME"]).parent)]


def cluster_config(**sections: Any) -> ClusterConfig:
    doc: dict[str, Any] = {"scheduler": dict(FAST), "jobs": {"allowed_roots": job_roots()}}
    doc["scheduler"].update(sections.pop("scheduler", {}))
    doc.update(sections)
    return parse_cluster_config(doc)


@dataclass
class CP:
    url: str
    admin_token: str
    plane: ControlPlane

    def client(self, token: str | None = None) -> httpx.Client:
        return httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {token or self.admin_token}"}, timeout=30
        )

    def team_token(self, team: str) -> str:
        with self.client() as c:
            r = c.post("/v1/admin/tokens", json={"team": team})
            assert r.status_code == 201, r.text
            return str(r.json()["token"])

    def wait_job(
        self, job_id: int, done: Callable[[dict[str, Any]], bool], timeout: float = 180
    ) -> dict[str, Any]:
        """Poll `jobs show` until `done(job)`; fail with the job's history when it never is."""
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        with self.client() as c:
            while time.monotonic() < deadline:
                last = c.get(f"/v1/jobs/{job_id}").json()
                if done(last["job"]):
                    return last
                time.sleep(0.2)
        raise AssertionError(f"job {job_id} never reached the expected state; last seen:\n{last}")


@contextmanager
def control_plane(
    db_url: str, config: ClusterConfig, *, run_scheduler: bool = True, **server_options: Any
) -> Iterator[CP]:
    import uvicorn

    from visionloop.api.app import create_app
    from visionloop.api.server import build_plane, ensure_admin_token, uvicorn_config

    settings = load_settings().ensure()
    plane = build_plane(settings, config, db_url)
    token_path = ensure_admin_token(plane, settings.home)
    port = free_port()
    # Served as `visionloop up` serves it (its HTTP parser and limits).
    server = uvicorn.Server(
        uvicorn_config(create_app(plane, run_scheduler=run_scheduler), "127.0.0.1", port, **server_options)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the control plane did not start within 30 s"
        time.sleep(0.05)
    try:
        yield CP(url=url, admin_token=token_path.read_text().strip(), plane=plane)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        # Jobs outlive the control plane by design; a test must not leave any behind.
        for attempt in plane.store.active_attempts():
            if attempt.handle:
                plane.executor.kill(attempt.handle)
        plane.store.close()


def train_doc(dataset: Path, *, tracked: bool = False, **kw: Any) -> dict[str, Any]:
    """A small digits train spec (see _trainkit.spec_doc) for a queue job: not recorded in
    MLflow unless `tracked` (then in its own experiment). Most queue tests check the job, not
    its MLflow run, and each tracked trainer pays ~3 CPU-s to import and open MLflow."""
    from _trainkit import spec_doc

    doc = spec_doc(dataset, **kw)
    doc["tracking"] = {"experiment": "queue-tests"} if tracked else {"enabled": False}
    return doc


def jobs_processes(home: Path) -> list[psutil.Process]:
    """Training processes started for this home (their command names its jobs folder): what
    a test checks is empty once its jobs have ended."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
        except psutil.Error:
            continue
        if str(home / "jobs") in cmd:
            found.append(p)
    return found
