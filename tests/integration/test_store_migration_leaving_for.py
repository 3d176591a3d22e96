"""Migration 0008 (`Job.leaving_for`, the job a victim steps aside for) on SQLite and
PostgreSQL: stored while the victim is PREEMPTING and cleared when it leaves that state; a
job on its way out when the schema is upgraded leaves for no job in particular; the way back
to 0007 drops only the column."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine, inspect, text

from _dbkit import BACKENDS, fresh_database, submit_doc
from visionloop.sched import db
from visionloop.sched.states import JobState
from visionloop.sched.store import Store
from visionloop.sched.view import Gpu

TRAIN = {"epochs": 2, "model": {"arch": "resnet18"}, "data": {"dataset": "/data/digits"}}
GPU = Gpu("n0/0", "n0", "A100")


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with fresh_database(request.param, tmp_path) as url:
        yield db.parse_url(url).render_as_string(hide_password=False)


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    e = create_engine(db_url)
    yield e
    e.dispose()


def _version(engine: Engine) -> str:
    with engine.connect() as conn:
        return str(conn.execute(text(f"SELECT version_num FROM {db.VERSION_TABLE}")).scalar_one())


def test_leaving_for_lives_while_preempting_and_0008_goes_down_and_up(
    db_url: str, engine: Engine, tmp_path: Path
) -> None:
    assert int(db.head_revision()) >= 8
    with Store.open(db_url, runs_dir=tmp_path) as store:
        store.upsert_team("vision", 2, 0, 1.0)
        store.sync_gpus([GPU], now=1.0)
        victim = submit_doc(store, {"train": TRAIN}, now=1.0).id
        winner = submit_doc(store, {"train": TRAIN}, now=2.0).id
        assert store.get_job(victim).leaving_for is None
        store.start_attempt(victim, "local", [GPU], now=3.0)
        job = store.transition(
            victim, JobState.PREEMPTING, "preempted", expect=JobState.RUNNING, now=4.0, leaving_for=winner
        )
        assert job.leaving_for == winner == store.get_job(victim).leaving_for
        assert {v.id: v.leaving_for for v in store.view_jobs()} == {victim: winner, winner: None}

    store_engine = db.make_engine(db.parse_url(db_url))
    try:
        db.downgrade(store_engine, "0007")  # nothing refused: a scheduling hint only
    finally:
        store_engine.dispose()
    assert _version(engine) == "0007"
    assert "leaving_for" not in {c["name"] for c in inspect(engine).get_columns("jobs")}

    # Up again, as a release with 0008 opens a 0007 database: the victim, still on its way
    # out, leaves for no job in particular; entering PREEMPTING again stores the job, and
    # leaving the state clears it.
    with Store.open(db_url, runs_dir=tmp_path) as store:
        assert _version(engine) == db.head_revision()
        assert store.get_job(victim).leaving_for is None
        store.end_attempt(victim, 1, "preempted", 75, 5.0, JobState.QUEUED, "preempted")
        store.start_attempt(victim, "local", [GPU], now=6.0)
        store.transition(victim, JobState.PREEMPTING, "again", now=7.0, leaving_for=winner)
        assert store.get_job(victim).leaving_for == winner
        store.end_attempt(victim, 2, "preempted", 75, 8.0, JobState.QUEUED, "preempted")
        assert store.get_job(victim).leaving_for is None
        assert {v.id: v.leaving_for for v in store.view_jobs()} == {victim: None, winner: None}
