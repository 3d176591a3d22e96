"""Upgrading a job store made by the previous release (schema 0001, its revision in the
`alembic_version` table it shared with Optuna) to revision 0002, on SQLite and PostgreSQL:
nothing lost, the revision moved to the queue's own version table, Optuna's history left to
Optuna, the new job state and attempt outcomes accepted, and the way back to 0001."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.environment import EnvironmentContext
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from optuna.storages._rdb import models as optuna_models
from sqlalchemy import JSON, Engine, bindparam, create_engine, inspect, select, text, update
from sqlalchemy.exc import IntegrityError

from _dbkit import BACKENDS, fresh_database, submit_doc
from visionloop.core.errors import ConfigError
from visionloop.core.migration_lock import MIGRATION_LOCK
from visionloop.sched import db
from visionloop.sched.store import Store
from visionloop.specs import JobSpec
from visionloop.tune import study as tune_study

OPTUNA_HEAD = ScriptDirectory(str(Path(optuna_models.__file__).with_name("alembic"))).get_current_head()
SPEC_DOC: dict[str, Any] = {
    "name": "old-job",
    "resources": {"gpus": 1, "memory_gb": 8},
    "train": {"epochs": 2, "model": {"arch": "resnet18"}, "data": {"dataset": "/data/digits"}},
}


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with fresh_database(request.param, tmp_path) as url:
        yield db.parse_url(url).render_as_string(hide_password=False)


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    """A plain engine beside the store's, to look at the database as it is on disk."""
    e = create_engine(db_url)
    yield e
    e.dispose()


def build_release_0001(url: str) -> None:
    """The schema as the previous release made it: revision 0001, recorded in `alembic_version`."""
    script = ScriptDirectory(str(db.MIGRATIONS_DIR))
    engine = db.make_engine(db.parse_url(url))
    try:
        with MIGRATION_LOCK, engine.connect() as conn:
            env = EnvironmentContext(
                db.alembic_config(),
                script,
                fn=lambda rev, _ctx: script._upgrade_revs("0001", rev),
                destination_rev="0001",
            )
            with env:
                env.configure(connection=conn, version_table="alembic_version", render_as_batch=True)
                with env.begin_transaction():
                    env.run_migrations()
            conn.commit()
    finally:
        engine.dispose()


def seed_0001(engine: Engine) -> None:
    """A job with everything that hangs off it (what a batch copy of `jobs` could cascade
    away), and a second job deleted, so that its id must never be handed out again."""
    train = JobSpec.model_validate(SPEC_DOC).train.model_dump(mode="json")
    with engine.begin() as conn:
        conn.execute(text("INSERT INTO teams VALUES ('vision', 4, 2, 1.0, 1.0, 1.0)"))
        for _ in range(2):
            conn.execute(
                text(
                    "INSERT INTO jobs (name, team, priority, priority_rank, spot, gpus, cpus, memory_gb, "
                    "max_restarts, spec_doc, train_spec, run_dir, state, state_since, waiting_reason, "
                    "restarts, preemptions, attempt, not_before, attained_gpu_s, submitted_at, updated_at, "
                    "version) VALUES ('old-job', 'vision', 'normal', 50, 'never', 1, 4.0, 8.0, 3, "
                    ":doc, :train, '/runs/job-1', 'queued', 5.0, 'preempted', 0, 1, 1, 0.0, 120.0, 2.0, "
                    "5.0, 4)"
                ).bindparams(bindparam("doc", type_=JSON()), bindparam("train", type_=JSON())),
                {"doc": SPEC_DOC, "train": train},
            )
        conn.execute(text("DELETE FROM jobs WHERE id = 2"))
        conn.execute(
            text(
                "INSERT INTO job_transitions (job_id, from_state, to_state, at, reason) VALUES "
                "(1, NULL, 'queued', 2.0, 'submitted'), (1, 'queued', 'running', 3.0, 'placed'), "
                "(1, 'running', 'preempting', 4.0, 'preempted'), (1, 'preempting', 'queued', 5.0, 'back')"
            )
        )
        conn.execute(
            text(
                "INSERT INTO attempts (job_id, number, executor, started_at, ended_at, exit_code, outcome) "
                "VALUES (1, 1, 'local', 3.0, 5.0, -15, 'preempted')"
            )
        )
        conn.execute(
            text(
                "INSERT INTO allocations (attempt_id, job_id, gpu_id, node, gpu_type, price_class, "
                "started_at, ended_at) VALUES (1, 1, 'n0/0', 'n0', 'A100-80GB', 'owned', 3.0, 5.0)"
            )
        )
        conn.execute(text("INSERT INTO checkpoints (job_id, attempt, step, at) VALUES (1, 1, 100, 4.0)"))


def old_study(url: str) -> float:
    """A study with one finished trial, made as the previous release's tuner made it: after the
    job store, with Optuna's compatibility check skipped (it would have read the queue's
    revision). Returns the trial's learning rate."""
    storage = optuna.storages.RDBStorage(url, skip_compatibility_check=True)
    study = optuna.create_study(storage=storage, study_name="old-study", direction="maximize")
    trial = study.ask()
    lr = trial.suggest_float("optimizer.lr", 1e-4, 1e-1, log=True)
    trial.report(0.3, step=1)
    study.tell(trial, 0.4)
    storage.engine.dispose()
    return lr


def versions(engine: Engine, table: str) -> list[str] | None:
    """The revisions recorded in `table`; None when there is no such table."""
    with engine.connect() as conn:
        if not inspect(conn).has_table(table):
            return None
        return sorted(conn.execute(text(f"SELECT version_num FROM {table}")).scalars())


def counts(engine: Engine) -> dict[str, int]:
    tables = ("jobs", "job_transitions", "attempts", "allocations", "checkpoints")
    with engine.connect() as conn:
        return {t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in tables}


SEEDED = {"jobs": 1, "job_transitions": 4, "attempts": 1, "allocations": 1, "checkpoints": 1}


def queue_schema_diff(engine: Engine) -> list[Any]:
    """The difference between the queue's tables on disk and its models (Optuna's ignored)."""

    def queue_only(name: str | None, type_: str, _parent: Any) -> bool:
        return type_ != "table" or name in db.Base.metadata.tables

    with engine.connect() as conn:
        context = MigrationContext.configure(
            conn, opts={"version_table": db.VERSION_TABLE, "include_name": queue_only}
        )
        return list(compare_metadata(context, db.Base.metadata))


def submit(store: Store) -> int:
    return int(submit_doc(store, SPEC_DOC, now=10.0).id)


@pytest.mark.parametrize("with_optuna", [True, False], ids=["with-study", "queue-only"])
def test_a_release_0001_database_is_upgraded_in_place(
    db_url: str, engine: Engine, tmp_path: Path, with_optuna: bool
) -> None:
    build_release_0001(db_url)
    seed_0001(engine)
    lr = old_study(db_url) if with_optuna else None
    assert versions(engine, "alembic_version") == ["0001"]  # Optuna left the queue's revision there

    with Store.open(db_url, runs_dir=tmp_path) as store:
        job = store.get_job(1)
        assert (job.name, job.state.value, job.preemptions, job.attempt) == ("old-job", "queued", 1, 1)
        assert (job.attained_gpu_s, job.spec_doc) == (120.0, SPEC_DOC)
        assert job.train_spec.epochs == 2
        assert submit(store) == 3  # job 2 was deleted: its id is not handed out again

    assert versions(engine, db.VERSION_TABLE) == [db.head_revision()]
    # Optuna's own revision where Optuna looks for it; no table left behind without Optuna.
    assert versions(engine, "alembic_version") == ([OPTUNA_HEAD] if with_optuna else None)
    assert counts(engine) == {**SEEDED, "jobs": 2, "job_transitions": 5}  # nothing cascaded away
    with engine.connect() as conn:  # the old job is a training job: no workload document
        assert conn.execute(text("SELECT count(*) FROM jobs WHERE workload_doc IS NULL")).scalar() == 2
    assert queue_schema_diff(engine) == []
    if with_optuna:
        loaded = tune_study.load("old-study", db_url)  # through Optuna's own compatibility check
        assert [(t.state, t.value, t.params) for t in loaded.trials] == [
            (optuna.trial.TrialState.COMPLETE, 0.4, {"optimizer.lr": lr})
        ]
        assert loaded.trials[0].intermediate_values == {1: 0.3}
        plain = optuna.storages.RDBStorage(db_url)  # plain Optuna: at its head, nothing to upgrade
        assert plain.get_current_version() == plain.get_head_version() == OPTUNA_HEAD
        plain.engine.dispose()

    with Store.open(db_url, runs_dir=tmp_path) as again:  # a second open changes nothing
        assert again.get_job(1) == job
    assert versions(engine, db.VERSION_TABLE) == [db.head_revision()]


def test_paused_and_pruned_are_stored_and_the_downgrade_restores_0001(
    db_url: str, engine: Engine, tmp_path: Path
) -> None:
    build_release_0001(db_url)
    seed_0001(engine)
    lr = old_study(db_url)
    Store.open(db_url, runs_dir=tmp_path).close()
    job_row = db.JobRow
    with engine.begin() as conn:
        conn.execute(
            update(job_row)
            .where(job_row.id == 1)
            .values(state="paused", workload_doc={"kind": "trial", "n": 3})
        )
        conn.execute(
            text(
                "INSERT INTO attempts (job_id, number, executor, started_at, ended_at, exit_code, outcome) "
                "VALUES (1, 2, 'local', 6.0, 7.0, 0, 'paused'), (1, 3, 'local', 8.0, 9.0, 0, 'pruned')"
            )
        )
    with engine.connect() as conn:
        assert conn.execute(select(job_row.state, job_row.workload_doc)).one() == (
            "paused",
            {"kind": "trial", "n": 3},
        )
        outcomes = conn.execute(text("SELECT outcome FROM attempts ORDER BY number")).scalars().all()
        assert outcomes == ["preempted", "paused", "pruned"]
    with engine.begin() as conn:
        conn.execute(text("UPDATE jobs SET state = 'pruned' WHERE id = 1"))
        assert conn.execute(text("SELECT state FROM jobs")).scalar_one() == "pruned"
    for bad in ("UPDATE jobs SET state = 'resting'", "UPDATE attempts SET outcome = 'resting'"):
        with (
            pytest.raises(IntegrityError, match=r"ck_jobs_state|ck_attempts_outcome"),
            engine.begin() as c,
        ):
            c.execute(text(bad))

    store_engine = db.make_engine(db.parse_url(db_url))  # the store's own settings (SQLite FKs on)
    try:
        # Not while rows use what 0001 cannot hold: nothing changes.
        with pytest.raises(ConfigError, match=r"cannot go back to schema 0001: 1 job.* 2 attempt"):
            db.downgrade(store_engine, "0001")
        assert versions(engine, db.VERSION_TABLE) == [db.head_revision()]
        assert versions(engine, "alembic_version") == [OPTUNA_HEAD]
        with engine.begin() as conn:
            # A JSON null (as written by code without none_as_null) is a training job too.
            conn.execute(update(job_row).values(state="queued", workload_doc=JSON.NULL))
            assert conn.execute(text("SELECT count(*) FROM jobs WHERE workload_doc IS NULL")).scalar() == 0
            conn.execute(text("DELETE FROM attempts WHERE number > 1"))
        db.downgrade(store_engine, "0001")
    finally:
        store_engine.dispose()

    # Back to what the previous release made and reads: its revision in alembic_version.
    assert versions(engine, db.VERSION_TABLE) is None
    assert versions(engine, "alembic_version") == ["0001"]
    assert "workload_doc" not in {c["name"] for c in inspect(engine).get_columns("jobs")}
    assert counts(engine) == SEEDED
    for state in ("paused", "pruned"):
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(text(f"UPDATE jobs SET state = '{state}'"))
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(text("UPDATE attempts SET outcome = 'pruned'"))

    # And up again, as the first time.
    with Store.open(db_url, runs_dir=tmp_path) as store:
        assert store.get_job(1).state.value == "queued"
        assert submit(store) == 3
    assert versions(engine, db.VERSION_TABLE) == [db.head_revision()]
    assert versions(engine, "alembic_version") == [OPTUNA_HEAD]
    assert tune_study.load("old-study", db_url).trials[0].params == {"optimizer.lr": lr}


@pytest.mark.parametrize("first", ["optuna", "store"])
def test_optuna_and_the_store_open_a_fresh_database_in_either_order(
    db_url: str, engine: Engine, tmp_path: Path, first: str
) -> None:
    def plain_study() -> None:
        storage = optuna.storages.RDBStorage(db_url)  # plain Optuna, its compatibility check on
        study = optuna.create_study(storage=storage, study_name="plain")
        study.tell(study.ask(), 1.5)
        storage.engine.dispose()

    def a_job() -> None:
        with Store.open(db_url, runs_dir=tmp_path) as store:
            store.upsert_team("vision", 4, 2, 1.0, now=1.0)
            assert submit(store) == 1

    for step in (plain_study, a_job) if first == "optuna" else (a_job, plain_study):
        step()
    assert versions(engine, db.VERSION_TABLE) == [db.head_revision()]
    assert versions(engine, "alembic_version") == [OPTUNA_HEAD]
    assert tune_study.load("plain", db_url).best_value == 1.5
    with Store.open(db_url, runs_dir=tmp_path) as store:
        assert [j.name for j in store.list_jobs()] == ["old-job"]
    assert queue_schema_diff(engine) == []


def test_the_queues_tables_without_a_revision_are_refused_not_guessed(
    db_url: str, engine: Engine, tmp_path: Path
) -> None:
    build_release_0001(db_url)
    seed_0001(engine)
    with engine.begin() as conn:
        conn.execute(text("DELETE FROM alembic_version"))
    with pytest.raises(ConfigError, match=r"queue's tables but no schema revision.*backup"):
        Store.open(db_url, runs_dir=tmp_path)
    assert counts(engine) == SEEDED
    assert versions(engine, db.VERSION_TABLE) is None  # nothing was written


OPENER = """
import sys
from pathlib import Path
from visionloop.sched.store import Store
Store.open(sys.argv[1], runs_dir=Path(sys.argv[2])).close()
"""


def test_processes_opening_a_release_0001_database_at_once_move_the_revision_once(
    db_url: str, engine: Engine, tmp_path: Path
) -> None:
    build_release_0001(db_url)
    seed_0001(engine)
    old_study(db_url)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPENER, db_url, str(tmp_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(3)
    ]
    results = [(p.wait(timeout=300), p.stdout.read() if p.stdout else "") for p in procs]
    assert [rc for rc, _ in results] == [0, 0, 0], results
    assert versions(engine, db.VERSION_TABLE) == [db.head_revision()]
    assert versions(engine, "alembic_version") == [OPTUNA_HEAD]
    assert counts(engine) == SEEDED


def test_a_study_written_by_another_optuna_schema_is_refused_with_optunas_advice(
    db_url: str, engine: Engine
) -> None:
    # Optuna's own compatibility check runs on the shared database now: a revision behind its
    # head (as an older Optuna leaves it) is refused with the command that upgrades it.
    tune_study.open_storage(db_url).engine.dispose()
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'v3.0.0.d'"))
    with pytest.raises(ConfigError, match=r"cannot be used by this Optuna.*optuna storage upgrade"):
        tune_study.open_storage(db_url)
    assert versions(engine, db.VERSION_TABLE) == [db.head_revision()]  # the queue's is its own
