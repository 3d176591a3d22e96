"""The control plane answers its health check while the job store stalls.

Its routes are sync `def`s, which FastAPI runs in AnyIO's worker threads (40), so a store
call that waits (a SQLite write lock held elsewhere: up to the 30 s busy timeout; a slow
PostgreSQL: as long) holds one thread, not the event loop. Here another connection holds the
SQLite write lock while more write requests than there are worker threads wait on it; the
health check sent then must come back before the lock is released.
"""

from __future__ import annotations

import sqlite3
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import httpx
import pytest
from sqlalchemy.engine import make_url

import visionloop.api.app
from _cpkit import CP, TEAMS, cluster_config, control_plane
from _dbkit import fresh_database

WORKERS = 40  # AnyIO's default thread limiter: what sync routes and dependencies share
WRITES = WORKERS + 10
LOCK_S = 5.0  # how long the lock is held once every worker waits on it


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[tuple[CP, str]]:
    cfg = cluster_config(
        inventory=[{"node": "local", "type": "fake", "count": 1, "price_class": "owned"}], teams=TEAMS
    )
    with fresh_database("sqlite", tmp_path) as url, control_plane(url, cfg, run_scheduler=False) as plane:
        yield plane, str(make_url(url).database)


def _busy() -> int:
    """Threads now inside the API's routes or dependencies (a worker running a request)."""
    api = str(Path(visionloop.api.app.__file__).parent)
    busy = 0
    for frame in sys._current_frames().values():
        f: FrameType | None = frame
        while f is not None and not f.f_code.co_filename.startswith(api):
            f = f.f_back
        busy += f is not None
    return busy


def test_health_answers_while_every_worker_waits_on_a_locked_store(cp: tuple[CP, str]) -> None:
    plane, db = cp
    lock = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    lock.execute("BEGIN IMMEDIATE")  # the write lock, as a long transaction elsewhere holds it
    released = threading.Event()

    def release() -> None:
        if not released.is_set():
            released.set()
            lock.execute("ROLLBACK")

    statuses: list[int] = []

    def write(i: int) -> None:
        with plane.client() as c:
            r = c.put(f"/v1/admin/teams/t{i}", json={"nominal_gpus": 1}, timeout=120)
        statuses.append(r.status_code)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(WRITES)]
    try:
        for t in threads:
            t.start()
        # Every worker thread taken by a write waiting on the lock (none can end meanwhile).
        deadline = time.monotonic() + 60
        while _busy() < WORKERS:
            assert time.monotonic() < deadline, f"only {_busy()} worker threads busy"
            time.sleep(0.05)
        assert not statuses
        # The lock goes in LOCK_S whatever happens: a health check queued behind the writes
        # comes back only after that.
        timer = threading.Timer(LOCK_S, release)
        timer.start()
        r = httpx.get(f"{plane.url}/v1/health", timeout=120)
        answered_while_locked = not released.is_set()
    finally:
        release()
        for t in threads:
            t.join(120)
        lock.close()
    assert r.status_code == 200 and r.json()["status"] == "ok", r.text
    assert answered_while_locked, "the health check waited for the job store's lock"
    assert sorted(statuses) == [200] * WRITES
