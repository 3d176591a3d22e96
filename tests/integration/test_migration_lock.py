"""Two Alembic migrations in one process, the job store's and MLflow's, must not meet.

Alembic's `context` and `op` are process-wide proxies, so before MIGRATION_LOCK a job store
opened while a thread created a fresh MLflow store failed at random ("KeyError: 'script'",
"no such table"), and so did MLflow. This runs both side by side on fresh databases.
"""

from __future__ import annotations

import threading
from pathlib import Path

from sqlalchemy import create_engine, inspect

from visionloop.core.settings import Settings
from visionloop.sched import db
from visionloop.sched.store import Store
from visionloop.track import store as track_store

ROUNDS = 6


def test_job_store_and_mlflow_migrating_at_once_in_one_process_both_succeed(tmp_path: Path) -> None:
    errors: list[str] = []
    start = threading.Barrier(2, timeout=120)

    opened: list[Path] = []
    tracking_done = threading.Event()

    def job_stores() -> None:
        # Fresh job stores for as long as MLflow is migrating, so that the two overlap often.
        start.wait()
        while not tracking_done.is_set() or len(opened) < ROUNDS:
            path = tmp_path / f"state{len(opened)}.db"
            opened.append(path)
            try:
                Store.open(f"sqlite:///{path}", runs_dir=tmp_path).close()
            except BaseException as e:  # every failure is the finding
                errors.append(f"job store {path.name}: {type(e).__name__}: {e}")

    def tracking_stores() -> None:
        start.wait()
        for i in range(ROUNDS):
            home = tmp_path / f"home{i}"
            try:
                settings = Settings(home=home, tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
                track_store.client(settings).search_experiments()
            except BaseException as e:
                errors.append(f"tracking store {i}: {type(e).__name__}: {e}")
        tracking_done.set()

    threads = [threading.Thread(target=job_stores), threading.Thread(target=tracking_stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a migration hung"
    assert errors == []
    # Every job store reached the newest schema, with all its tables.
    for path in opened:
        engine = create_engine(f"sqlite:///{path}")
        try:
            with engine.connect() as conn:
                assert db.current_revision(conn) == db.head_revision()
            assert set(db.Base.metadata.tables) <= set(inspect(engine).get_table_names())
        finally:
            engine.dispose()
