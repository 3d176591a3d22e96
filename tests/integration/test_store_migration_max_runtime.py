"""Migration 0006 (a job's `max_runtime_s`) on SQLite and PostgreSQL: jobs queued before it
have no time limit, new ones keep theirs, and the way back to 0005 drops only the column."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, inspect, text

from _dbkit import BACKENDS, fresh_database, submit_doc
from visionloop.sched import db
from visionloop.sched.store import Store

TRAIN = {"epochs": 2, "model": {"arch": "resnet18"}, "data": {"dataset": "/data/digits"}}


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with fresh_database(request.param, tmp_path) as url:
        yield db.parse_url(url).render_as_string(hide_password=False)


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    e = create_engine(db_url)
    yield e
    e.dispose()


def _submit(store: Store, **fields: Any) -> int:
    return int(submit_doc(store, {"train": TRAIN, **fields}, now=1.0).id)


def _version(engine: Engine) -> str:
    with engine.connect() as conn:
        return str(conn.execute(text(f"SELECT version_num FROM {db.VERSION_TABLE}")).scalar_one())


def test_max_runtime_is_stored_and_0006_goes_down_and_up_keeping_the_jobs(
    db_url: str, engine: Engine, tmp_path: Path
) -> None:
    assert int(db.head_revision()) >= 6  # later revisions add other columns
    with Store.open(db_url, runs_dir=tmp_path) as store:
        store.upsert_team("vision", 2, 0, 1.0)
        limited, unlimited = _submit(store, max_runtime="6h"), _submit(store)
        assert [store.get_job(j).max_runtime_s for j in (limited, unlimited)] == [21600.0, None]
        assert [v.max_runtime_s for v in store.view_jobs()] == [21600.0, None]

    store_engine = db.make_engine(db.parse_url(db_url))
    try:
        db.downgrade(store_engine, "0005")  # nothing refused: planning data only
    finally:
        store_engine.dispose()
    assert _version(engine) == "0005"
    assert "max_runtime_s" not in {c["name"] for c in inspect(engine).get_columns("jobs")}
    with engine.connect() as conn:
        assert conn.execute(text("SELECT id FROM jobs ORDER BY id")).scalars().all() == [limited, unlimited]

    # Up again, as a release with 0006 opens a 0005 database: the old jobs have no limit.
    with Store.open(db_url, runs_dir=tmp_path) as store:
        assert _version(engine) == db.head_revision()
        assert [store.get_job(j).max_runtime_s for j in (limited, unlimited)] == [None, None]
        again = _submit(store, max_runtime=5400)
        assert again == unlimited + 1  # the id counter survived the column's drop
        assert store.get_job(again).max_runtime_s == 5400.0
