"""The job store against a real SQLite file and a real PostgreSQL server: every test runs on
both, each with a fresh database (see tests/_dbkit.py)."""

from __future__ import annotations

import hashlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import IntegrityError

from _dbkit import BACKENDS, fresh_database, submit_doc
from visionloop.core.errors import ConfigError, NotFoundError, QueueFullError, StoreError
from visionloop.core.settings import load_settings
from visionloop.sched import db
from visionloop.sched.records import pace_end
from visionloop.sched.states import JobState, TransitionError, allowed
from visionloop.sched.store import GONE_REASON, ConflictError, Job, Store, TeamQueueFullError, default_url
from visionloop.sched.view import Gpu
from visionloop.sched.workload import CommandContext
from visionloop.specs import JobSpec


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with fresh_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture
def store(db_url: str, tmp_path: Path) -> Iterator[Store]:
    s = Store.open(db_url, runs_dir=tmp_path / "runs")
    s.upsert_team("vision", 4, 2, 1.0, now=1.0)
    yield s
    s.close()


def _raw_engine(url: str) -> Engine:
    """A plain engine beside the store's, to look at the database as it is on disk."""
    return create_engine(db.parse_url(url))


def spec_doc(name: str = "job", gpus: int = 1, **extra: Any) -> dict[str, Any]:
    # Keys deliberately not in the model's order: the stored document must keep them as given.
    return {
        "name": name,
        "resources": {"memory_gb": 16, "gpus": gpus},
        "train": {"epochs": 2, "model": {"arch": "resnet18"}, "data": {"dataset": "/data/digits"}},
        **extra,
    }


def submit(
    s: Store,
    name: str = "job",
    gpus: int = 1,
    key: str | None = None,
    now: float = 10.0,
    team: str = "vision",
) -> Job:
    job: Job = submit_doc(s, spec_doc(name, gpus), now=now, team=team, key=key)
    return job


GPUS = [
    Gpu(f"n{n}/{i}", f"n{n}", "A100-80GB", "spot" if n == 1 else "owned") for n in range(2) for i in range(2)
]


# --------------------------------------------------------------------------- schema


def test_migrations_create_the_models_schema_and_reopen_is_idempotent(db_url: str, tmp_path: Path) -> None:
    s = Store.open(db_url, runs_dir=tmp_path / "runs")
    engine = _raw_engine(db_url)
    try:
        tables = set(inspect(engine).get_table_names())
        assert {"teams", "api_tokens", "jobs", "job_transitions", "attempts", "allocations", "gpus"} <= tables
        assert {"checkpoints", db.VERSION_TABLE} <= tables
        assert "alembic_version" not in tables  # Optuna's, on a database the tuner shares
        with engine.connect() as conn:
            assert db.current_revision(conn) == db.head_revision()
            # The migrations build exactly the schema the models describe, on this backend.
            context = MigrationContext.configure(conn, opts={"version_table": db.VERSION_TABLE})
            assert compare_metadata(context, db.Base.metadata) == []
        s.upsert_team("vision", 4, now=1.0)
        job = submit(s)
        s.close()

        again = Store.open(db_url, runs_dir=tmp_path / "runs")
        assert again.get_job(job.id) == job  # nothing migrated twice, nothing lost
        with engine.connect() as conn:
            assert db.current_revision(conn) == db.head_revision()
            assert conn.scalar(text(f"SELECT count(*) FROM {db.VERSION_TABLE}")) == 1
        again.close()
    finally:
        engine.dispose()


def test_a_database_from_a_newer_release_is_refused(db_url: str, tmp_path: Path) -> None:
    Store.open(db_url, runs_dir=tmp_path).close()
    engine = _raw_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {db.VERSION_TABLE} SET version_num = '9999'"))
    engine.dispose()
    with pytest.raises(
        ConfigError, match=r"revision 9999, newer than this visionloop knows.*Upgrade visionloop"
    ):
        Store.open(db_url, runs_dir=tmp_path)


def test_unsupported_and_unreachable_urls_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"supports SQLite and PostgreSQL.*postgresql\+psycopg://"):
        Store.open("mysql://u:p@localhost/vl")
    with pytest.raises(ConfigError, match="not a database URL"):
        Store.open("no url at all")
    # Port 1 on loopback: nothing listens, so the connection is refused at once.
    with pytest.raises(ConfigError, match=r"cannot open the job store.*server is running") as info:
        Store.open("postgresql://vl:secret@127.0.0.1:1/visionloop")
    assert "secret" not in str(info.value)  # the password is never shown
    assert make_url(db.parse_url("postgres://a@h/d")).drivername == "postgresql+psycopg"
    with pytest.raises(ConfigError, match=r"SQLite \*file\*"):
        Store.open("sqlite://")  # in memory: each pooled connection would see its own database


def test_the_default_store_lives_in_the_visionloop_home(vl_home: Path) -> None:
    settings = load_settings()
    assert default_url(settings) == f"sqlite:///{settings.home / 'state.db'}"
    with Store.open(default_url(settings)) as s:
        s.upsert_team("vision", 1, now=1.0)
        assert submit(s).run_dir == settings.home / "runs" / "job-1"
    assert (settings.home / "state.db").is_file() and settings.home == vl_home.resolve()


# --------------------------------------------------------------------------- jobs


def test_submit_get_list_round_trip_keeps_the_spec_verbatim(store: Store, tmp_path: Path) -> None:
    doc = spec_doc("first", gpus=2, spot="never", priority="high", max_restarts=5)
    spec = JobSpec.model_validate(doc)
    job = store.submit(
        doc, spec, team="vision", priority_rank=100, run_dir=None, idempotency_key=None, now=10.0
    )
    assert job.id >= 1
    assert job.run_dir == tmp_path / "runs" / f"job-{job.id}"
    got = store.get_job(job.id)
    assert got == job
    assert got.spec_doc == doc
    assert list(got.spec_doc) == ["name", "resources", "train", "spot", "priority", "max_restarts"]
    assert list(got.spec_doc["resources"]) == ["memory_gb", "gpus"]
    assert got.train_spec == spec.train
    assert (got.name, got.team, got.priority, got.priority_rank, got.spot) == (
        "first",
        "vision",
        "high",
        100,
        "never",
    )
    assert (got.gpus, got.cpus, got.memory_gb, got.max_restarts) == (2, 2.0, 16.0, 5)
    assert (got.state, got.state_since, got.submitted_at, got.updated_at) == (
        JobState.QUEUED,
        10.0,
        10.0,
        10.0,
    )
    assert (got.attempt, got.restarts, got.preemptions, got.attained_gpu_s, got.version) == (0, 0, 0, 0.0, 1)
    assert got.finished_at is None and got.exit_code is None

    custom = tmp_path / "elsewhere"
    second = store.submit(
        spec_doc("second"), JobSpec.model_validate(spec_doc("second")), team="vision",
        priority_rank=50, run_dir=custom, idempotency_key=None, now=11.0,
    )  # fmt: skip
    assert second.id > job.id and store.get_job(second.id).run_dir == custom
    store.upsert_team("detection", 2, now=1.0)
    other = submit(store, "third", team="detection", now=12.0)

    listed = store.list_jobs()
    assert [j.id for j in listed] == [job.id, second.id, other.id]
    assert all(j.spec_doc is None for j in listed)  # cheap listing: no documents
    with pytest.raises(StoreError, match="get_job"):
        _ = listed[0].train_spec
    assert [j.id for j in store.list_jobs(team="detection")] == [other.id]
    assert [j.id for j in store.list_jobs(newest_first=True, limit=2)] == [other.id, second.id]
    assert [j.id for j in store.list_jobs(limit=1, offset=1)] == [second.id]
    assert store.list_jobs(states={JobState.RUNNING}) == []
    assert store.list_jobs(team="vision", with_specs=True)[0].spec_doc == doc

    with pytest.raises(NotFoundError, match=r"no job 999.*jobs list"):
        store.get_job(999)
    with pytest.raises(NotFoundError, match=r"no team 'nobody'.*admin team set"):
        submit(store, team="nobody")


def test_an_idempotency_key_returns_the_same_job(store: Store) -> None:
    first = submit(store, "a", key="key-1", now=10.0)
    again = submit(store, "a", key="key-1", now=20.0)
    assert again == first and again.submitted_at == 10.0
    assert len(store.list_jobs()) == 1
    assert len(store.transitions(first.id)) == 1

    store.upsert_team("detection", 1, now=1.0)
    assert submit(store, "a", key="key-1", team="detection").id != first.id  # keys are per team
    assert submit(store, "a").id != submit(store, "a").id  # no key: always a new job
    with pytest.raises(ConflictError, match=r"key-1.*different spec.*new key"):
        submit(store, "b", key="key-1")
    assert len(store.list_jobs()) == 4


def _submit_capped(s: Store, key: str | None = None, team: str = "vision", limit: int = 3) -> Job:
    from visionloop.specs import JobSpec

    doc = spec_doc("capped")
    job: Job = s.submit(
        doc, JobSpec.model_validate(doc), team=team, priority_rank=50, run_dir=None,
        idempotency_key=key, now=10.0, max_queued=limit,
    )  # fmt: skip
    return job


def test_a_team_at_its_queue_limit_is_refused_and_nothing_is_queued(store: Store) -> None:
    first = _submit_capped(store, key="k0")
    _submit_capped(store)
    third = _submit_capped(store)
    with pytest.raises(TeamQueueFullError) as e:
        _submit_capped(store, key="k-new")
    assert str(e.value) == (
        "team 'vision' already has 3 jobs waiting, the most a team may have queued ([jobs] "
        "max_queued_per_team = 3 in cluster.toml); nothing was submitted. Submit again once some "
        "have started, or cancel some with `visionloop jobs cancel ID`."
    )
    assert isinstance(e.value, QueueFullError) and (e.value.queued, e.value.limit) == (3, 3)
    assert len(store.list_jobs()) == 3  # nothing half-made
    assert _submit_capped(store, key="k0") == first  # a retry of a queued job still gets it
    store.upsert_team("detection", 1, now=1.0)
    assert _submit_capped(store, team="detection").team == "detection"  # per team
    # A job that starts (or is cancelled) leaves the queue: room for one more, and only one.
    store.start_attempt(first.id, "local", [GPUS[0]], now=12.0)
    store.transition(third.id, JobState.CANCELLED, "by hand", now=13.0)
    _submit_capped(store)
    _submit_capped(store)
    with pytest.raises(TeamQueueFullError):
        _submit_capped(store)
    assert _submit_capped(store, limit=4).state == JobState.QUEUED.value  # the limit is the caller's


def test_racing_submits_never_pass_a_teams_queue_limit(db_url: str, tmp_path: Path) -> None:
    """Twenty threads, each with its own Store (own connections), submit five jobs each to a
    team allowed ten: exactly ten are queued. Without the team row's lock, PostgreSQL's
    transactions each counted nine and all inserted."""
    threads, limit = 20, 10
    barrier = threading.Barrier(threads, timeout=120)
    with Store.open(db_url, runs_dir=tmp_path) as s:
        s.upsert_team("vision", 4, now=1.0)

    def client(t: int) -> tuple[int, int]:
        with Store.open(db_url, runs_dir=tmp_path) as s:
            barrier.wait()
            ok = full = 0
            for _ in range(5):
                try:
                    _submit_capped(s, limit=limit)
                    ok += 1
                except TeamQueueFullError:
                    full += 1
            return ok, full

    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(client, range(threads)))
    assert sum(ok for ok, _ in results) == limit
    assert sum(full for _, full in results) == threads * 5 - limit
    with Store.open(db_url, runs_dir=tmp_path) as s:
        assert len(s.list_jobs()) == limit


# --------------------------------------------------------------------------- transitions


def _job_in(store: Store, state: JobState, gpu: Gpu) -> int:
    """A job brought to `state` through the store's legal paths."""
    job = submit(store, state.value, gpus=1)
    if state is JobState.QUEUED:
        return job.id
    if state in (JobState.FAILED, JobState.CANCELLED):
        store.transition(job.id, state, "set up", now=11.0)
        return job.id
    store.start_attempt(job.id, "local", [gpu], now=12.0)
    if state in (JobState.PREEMPTING, JobState.CANCELLING):
        store.transition(job.id, state, "set up", now=13.0)
    elif state is JobState.SUCCEEDED:
        store.end_attempt(job.id, 1, "succeeded", 0, 14.0, JobState.SUCCEEDED, "done")
    elif state in (JobState.PAUSED, JobState.PRUNED):
        store.end_attempt(job.id, 1, "paused", 76, 14.0, JobState.PAUSED, "at its rung")
        if state is JobState.PRUNED:
            store.prune(job.id, "set up", now=15.0)
    return job.id


def test_every_illegal_transition_is_refused_and_changes_nothing(store: Store) -> None:
    gpus = [Gpu(f"g{i}", "n0", "A100") for i in range(len(JobState))]
    jobs = {state: _job_in(store, state, gpus[i]) for i, state in enumerate(JobState)}
    refused = 0
    for src, job_id in jobs.items():
        before, history = store.get_job(job_id), store.transitions(job_id)
        assert before.state is src
        for dst in JobState:
            if allowed(src, dst):
                continue
            with pytest.raises(TransitionError, match=f"job {job_id} cannot go from {src} to {dst}"):
                store.transition(job_id, dst, "illegal", now=50.0)
            refused += 1
        if src.holds_resources:  # ending its attempt into a state it cannot reach
            dst = next(d for d in JobState if not d.holds_resources and not allowed(src, d))
            with pytest.raises(TransitionError, match=f"cannot go from {src} to {dst}"):
                store.end_attempt(job_id, 1, "succeeded", 0, 50.0, dst, "illegal")
            assert store.active_attempts()[-1].ended_at is None
        assert store.get_job(job_id) == before
        assert store.transitions(job_id) == history
    assert refused == sum(1 for a in JobState for b in JobState if not allowed(a, b))

    # A caller that saw an old state lost a race: refused, nothing changed.
    queued = jobs[JobState.QUEUED]
    with pytest.raises(TransitionError, match=f"job {queued} is queued, not running.*Re-read"):
        store.transition(queued, JobState.FAILED, "stale", expect=JobState.RUNNING, now=50.0)
    # Legal in the state machine, but the GPUs must be booked or freed with the attempt.
    with pytest.raises(StoreError, match="start_attempt"):
        store.transition(queued, JobState.RUNNING, "no attempt", now=50.0)
    with pytest.raises(StoreError, match="end_attempt"):
        store.transition(jobs[JobState.RUNNING], JobState.QUEUED, "no attempt", now=50.0)
    assert store.get_job(queued).state is JobState.QUEUED
    assert store.get_job(jobs[JobState.RUNNING]).state is JobState.RUNNING


def test_every_state_change_writes_one_transition_row_with_time_and_reason(store: Store) -> None:
    job = submit(store, gpus=1, now=10.0)
    store.start_attempt(job.id, "local", [GPUS[0]], now=20.0)
    store.transition(job.id, JobState.PREEMPTING, "preempted by job 7", expect=JobState.RUNNING, now=25.0)
    requeued = store.end_attempt(
        job.id, 1, "preempted", 75, 30.0, JobState.QUEUED, "checkpointed; requeued", preemptions=1
    )
    assert (requeued.state, requeued.preemptions, requeued.exit_code) == (JobState.QUEUED, 1, 75)
    assert requeued.waiting_reason == "checkpointed; requeued"
    store.start_attempt(job.id, "local", [GPUS[1]], now=40.0, reason="placed on n0/1")
    done = store.end_attempt(job.id, 2, "succeeded", 0, 50.0, JobState.SUCCEEDED, "finished (exit 0)")

    q, r, p, s = JobState.QUEUED, JobState.RUNNING, JobState.PREEMPTING, JobState.SUCCEEDED
    assert [(t.from_state, t.to_state, t.at, t.reason) for t in store.transitions(job.id)] == [
        (None, q, 10.0, "submitted"),
        (q, r, 20.0, "attempt 1 on n0/0"),
        (r, p, 25.0, "preempted by job 7"),
        (p, q, 30.0, "checkpointed; requeued"),
        (q, r, 40.0, "placed on n0/1"),
        (r, s, 50.0, "finished (exit 0)"),
    ]
    assert (done.state, done.state_since, done.finished_at, done.exit_code) == (s, 50.0, 50.0, 0)
    assert (done.attempt, done.started_at, done.version, done.waiting_reason) == (2, 20.0, 6, None)
    assert done.attained_gpu_s == pytest.approx(10.0 + 10.0)

    failed = submit(store, now=60.0)
    store.transition(failed.id, JobState.FAILED, "dataset vanished", exit_code=2, now=61.0)
    assert store.get_job(failed.id).finished_at == 61.0
    assert store.transitions(failed.id)[-1] == store.transitions(failed.id)[-1].__class__(
        failed.id, q, JobState.FAILED, 61.0, "dataset vanished"
    )


# --------------------------------------------------------------------------- attempts and GPUs


def test_start_attempt_never_double_books_a_gpu(store: Store) -> None:
    store.sync_gpus(GPUS, now=1.0)
    a, b = submit(store, "a", gpus=1), submit(store, "b", gpus=2)
    first = store.start_attempt(a.id, "local", [GPUS[0]], now=20.0)
    assert (first.number, first.gpu_ids, first.ended_at) == (1, ("n0/0",), None)

    with pytest.raises(ConflictError, match=rf"n0/0 \(job {a.id}\)"):
        store.start_attempt(b.id, "local", [GPUS[1], GPUS[0]], now=21.0)
    assert store.get_job(b.id).state is JobState.QUEUED
    assert store.attempts(b.id) == []
    assert [att.job_id for att in store.active_attempts()] == [a.id]  # n0/1 was not booked either

    store.set_gpus_up("n0/1", up=False, reason="spot interruption", now=22.0)
    with pytest.raises(ConflictError, match=r"down: n0/1 \(spot interruption\)"):
        store.start_attempt(b.id, "local", [GPUS[1], GPUS[2]], now=23.0)
    with pytest.raises(StoreError, match="needs 2 GPU"):
        store.start_attempt(b.id, "local", [GPUS[2]], now=23.0)
    with pytest.raises(TransitionError):  # already running
        store.start_attempt(a.id, "local", [GPUS[3]], now=23.0)

    store.end_attempt(a.id, 1, "succeeded", 0, 30.0, JobState.SUCCEEDED, "done")
    second = store.start_attempt(b.id, "local", [GPUS[0], GPUS[2]], now=31.0)  # freed: bookable again
    assert second.gpu_ids == ("n0/0", "n1/0")


def test_the_database_itself_refuses_a_second_open_allocation_of_a_gpu(store: Store, db_url: str) -> None:
    # The last word between two schedulers that both checked before either committed.
    job = submit(store)
    store.start_attempt(job.id, "local", [GPUS[0]], now=20.0)
    engine = _raw_engine(db_url)
    insert = text(
        "INSERT INTO allocations (attempt_id, job_id, gpu_id, node, gpu_type, price_class, started_at) "
        "SELECT id, job_id, 'n0/0', 'n0', 'A100-80GB', 'owned', 21.0 FROM attempts"
    )
    try:
        with pytest.raises(IntegrityError), engine.begin() as conn:
            conn.execute(insert)
    finally:
        engine.dispose()
    # The store's own connection settings: foreign keys enforced (SQLite needs a PRAGMA).
    own = db.make_engine(db.parse_url(db_url))
    try:
        with pytest.raises(IntegrityError), own.begin() as conn:
            conn.execute(text("INSERT INTO checkpoints (job_id, step, at) VALUES (999, 1, 1.0)"))
        if own.dialect.name == "sqlite":
            with own.connect() as conn:
                assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
                assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
    finally:
        own.dispose()


def test_two_schedulers_racing_for_one_gpu_exactly_one_wins(db_url: str, tmp_path: Path) -> None:
    stores = [Store.open(db_url, runs_dir=tmp_path) for _ in range(2)]
    try:
        stores[0].upsert_team("vision", 4, now=1.0)
        rounds = 8
        pairs = [(submit(stores[0], f"a{i}").id, submit(stores[0], f"b{i}").id) for i in range(rounds)]
        for i, pair in enumerate(pairs):
            gpu = Gpu(f"race/{i}", "race", "A100")
            barrier = threading.Barrier(2, timeout=120)  # a lost partner fails, never hangs

            def start(
                k: int, pair: tuple[int, int] = pair, gpu: Gpu = gpu, barrier: threading.Barrier = barrier
            ) -> str:
                barrier.wait()
                try:
                    stores[k].start_attempt(pair[k], "local", [gpu], now=20.0)
                except ConflictError:
                    return "lost"
                return "won"

            with ThreadPoolExecutor(2) as pool:
                results = sorted(pool.map(start, [0, 1]))
            assert results == ["lost", "won"]
            holders = [a for a in stores[0].active_attempts() if gpu.id in a.gpu_ids]
            assert len(holders) == 1
            loser = pair[1] if holders[0].job_id == pair[0] else pair[0]
            assert stores[0].get_job(loser).state is JobState.QUEUED
            assert stores[0].attempts(loser) == []

            # Both now try to cancel the queued loser, as it was when they looked: one wins.
            def cancel(k: int, loser: int = loser, barrier: threading.Barrier = barrier) -> str:
                barrier.wait()
                try:
                    stores[k].transition(loser, JobState.CANCELLED, f"{k}", expect=JobState.QUEUED, now=30.0)
                except TransitionError:
                    return "lost"
                return "won"

            with ThreadPoolExecutor(2) as pool:
                assert sorted(pool.map(cancel, [0, 1])) == ["lost", "won"]
            assert [t.to_state for t in stores[0].transitions(loser)] == [JobState.QUEUED, JobState.CANCELLED]
    finally:
        for s in stores:
            s.close()


def test_end_attempt_closes_allocations_and_adds_attained_gpu_seconds(store: Store) -> None:
    store.upsert_team("detection", 2, now=1.0)
    job = submit(store, "two", gpus=2)
    other = submit(store, "other", gpus=1, team="detection")
    store.start_attempt(job.id, "local", GPUS[:2], now=100.0)
    store.start_attempt(other.id, "local", [GPUS[2]], now=110.0)
    store.set_attempt_handle(job.id, 1, {"pid": 4242, "start_time": 123.5, "attempt_dir": Path("/tmp/a1")})

    active = store.active_attempts()
    assert [(a.job_id, a.gpu_ids) for a in active] == [(job.id, ("n0/0", "n0/1")), (other.id, ("n1/0",))]
    assert active[0].handle == {"pid": 4242, "start_time": 123.5, "attempt_dir": "/tmp/a1"}

    ended = store.end_attempt(
        job.id, 1, "failed", 1, 160.0, JobState.QUEUED, "exit 1; retry 1 of 3", restarts=1, not_before=190.0
    )
    assert ended.attained_gpu_s == pytest.approx(2 * 60.0)
    assert (ended.state, ended.restarts, ended.not_before, ended.exit_code) == (JobState.QUEUED, 1, 190.0, 1)
    [attempt] = store.attempts(job.id)
    assert (attempt.ended_at, attempt.exit_code, attempt.outcome) == (160.0, 1, "failed")
    assert [(a.gpu_id, a.started_at, a.ended_at) for a in attempt.allocations] == [
        ("n0/0", 100.0, 160.0),
        ("n0/1", 100.0, 160.0),
    ]
    assert [a.job_id for a in store.active_attempts()] == [other.id]
    with pytest.raises(TransitionError, match="already ended"):
        store.end_attempt(job.id, 1, "lost", None, 170.0, JobState.QUEUED, "twice")
    with pytest.raises(NotFoundError, match="no open attempt"):
        store.set_attempt_handle(job.id, 1, {"pid": 1})

    ledger = store.allocations()
    assert [
        (r.job_id, r.team, r.attempt, r.gpu_id, r.price_class, r.start, r.end, r.outcome) for r in ledger
    ] == [
        (job.id, "vision", 1, "n0/0", "owned", 100.0, 160.0, "failed"),
        (job.id, "vision", 1, "n0/1", "owned", 100.0, 160.0, "failed"),
        (other.id, "detection", 1, "n1/0", "spot", 110.0, None, None),
    ]
    assert [r.job_id for r in store.allocations(team="detection")] == [other.id]
    assert [r.gpu_id for r in store.allocations(job_id=job.id)] == ["n0/0", "n0/1"]
    assert [r.job_id for r in store.allocations(since=161.0)] == [other.id]  # still running counts


def test_a_jobs_pace_is_kept_newest_first_and_reaches_the_queue_view(store: Store) -> None:
    a = submit(store, "a")
    store.start_attempt(a.id, "local", [GPUS[0]], now=20.0)
    assert store.get_job(a.id).expected_end(now=21.0) is None  # nothing told yet
    store.record_pace(a.id, 100, 1000, 4.0, 30.0)
    store.record_pace(a.id, 50, 1000, 2.0, 25.0)  # an older line read late: ignored
    job = store.get_job(a.id)
    assert (job.pace_step, job.pace_total, job.pace_rate, job.pace_at) == (100, 1000, 4.0, 30.0)
    assert job.expected_end(now=31.0) == 30.0 + 900 / 4.0
    (row,) = (r for r in store.view_jobs() if r.id == a.id)  # what the scheduler's view reads
    assert (row.pace_step, row.pace_total, row.pace_rate, row.pace_at) == (100, 1000, 4.0, 30.0)
    assert pace_end(row.pace_step, row.pace_total, row.pace_rate, row.pace_at, 20.0, 31.0) == 255.0
    assert pace_end(row.pace_step, row.pace_total, row.pace_rate, row.pace_at, 40.0, 41.0) is None
    assert store.get_job(a.id).version == job.version  # advisory: no new version for a pace


def test_heartbeats_checkpoints_and_waiting_reasons(store: Store) -> None:
    a, b = submit(store, "a"), submit(store, "b")
    store.start_attempt(a.id, "local", [GPUS[0]], now=20.0)
    store.heartbeat(a.id, 25.0)
    store.record_checkpoint(a.id, 100, 26.0, attempt=1)
    store.record_checkpoint(a.id, 200, 27.0, attempt=1)
    job = store.get_job(a.id)
    assert (job.last_heartbeat_at, job.last_checkpoint_at) == (25.0, 27.0)
    assert [(c.step, c.at, c.attempt) for c in store.checkpoints(a.id)] == [(100, 26.0, 1), (200, 27.0, 1)]
    with pytest.raises(NotFoundError):
        store.heartbeat(999, 1.0)

    reasons = {a.id: "running jobs are left alone", b.id: "waiting for 1 GPU: 0 free"}
    assert store.set_waiting_reasons(reasons) == 1
    assert store.set_waiting_reasons(reasons) == 0  # unchanged reasons are not rewritten
    assert store.get_job(a.id).waiting_reason is None
    assert store.get_job(b.id).waiting_reason == "waiting for 1 GPU: 0 free"
    assert store.set_waiting_reasons({}) == 0


# --------------------------------------------------------------------------- inventory


def test_set_gpus_up_for_a_node_is_durable(store: Store, db_url: str, tmp_path: Path) -> None:
    listed = store.sync_gpus(GPUS, now=1.0)
    assert [g.id for g in listed] == ["n0/0", "n0/1", "n1/0", "n1/1"] and all(g.up for g in listed)

    assert store.set_gpus_up("n1", up=False, reason="spot interruption", now=5.0) == ["n1/0", "n1/1"]
    assert store.set_gpus_up("nowhere", up=False, now=5.0) == []
    # A restarted control plane re-syncs its inventory: the interruption is remembered.
    store.close()
    again = Store.open(db_url, runs_dir=tmp_path)
    again.sync_gpus(GPUS, now=6.0)
    state = {g.id: (g.up, g.down_reason, g.updated_at) for g in again.list_gpus()}
    assert state == {
        "n0/0": (True, None, 1.0),
        "n0/1": (True, None, 1.0),
        "n1/0": (False, "spot interruption", 5.0),
        "n1/1": (False, "spot interruption", 5.0),
    }
    assert again.set_gpus_up(["n1/1"], up=True, now=7.0) == ["n1/1"]
    assert [(g.id, g.up, g.down_reason) for g in again.list_gpus() if g.node == "n1"] == [
        ("n1/0", False, "spot interruption"),
        ("n1/1", True, None),
    ]
    # Discovery no longer lists node n1: it leaves the inventory.
    assert [g.id for g in again.sync_gpus(GPUS[:2], now=8.0)] == ["n0/0", "n0/1"]
    again.close()


# --------------------------------------------------------------------------- tokens


def test_tokens_authenticate_revoke_and_are_never_stored_in_plaintext(store: Store, db_url: str) -> None:
    team_token = store.create_token("vision", admin=False, label="ci bot")
    admin_token = store.create_token(None, admin=True, label="ops")
    assert team_token != admin_token and team_token.startswith("vl_") and len(team_token) > 40

    who = store.authenticate(team_token)
    assert who is not None and (who.team, who.admin, who.label) == ("vision", False, "ci bot")
    admin = store.authenticate(admin_token)
    assert admin is not None and (admin.team, admin.admin) == (None, True)
    assert store.authenticate(team_token[:-1] + ("A" if team_token[-1] != "A" else "B")) is None
    assert store.authenticate("") is None

    store.revoke_token(who.token_id, now=50.0)
    assert store.authenticate(team_token) is None
    assert [(t.label, t.revoked_at) for t in store.list_tokens()] == [("ci bot", 50.0), ("ops", None)]
    with pytest.raises(NotFoundError):
        store.revoke_token(999)
    with pytest.raises(NotFoundError, match="no team 'ghosts'"):
        store.create_token("ghosts", admin=False, label="x")
    with pytest.raises(ConfigError, match="give a team or admin=True"):
        store.create_token(None, admin=False, label="x")

    # Grep the database: every row of every table, and for SQLite the files themselves.
    engine = _raw_engine(db_url)
    try:
        with engine.connect() as conn:
            dump = repr([conn.execute(text(f"SELECT * FROM {t}")).all() for t in db.Base.metadata.tables])
    finally:
        engine.dispose()
    assert hashlib.sha256(team_token.encode()).hexdigest() in dump
    for token in (team_token, admin_token):
        assert token not in dump and token[3:] not in dump
    url = make_url(db_url)
    if url.get_backend_name() == "sqlite":
        path = Path(str(url.database))
        for f in [path, *path.parent.glob(path.name + "-*")]:
            raw = f.read_bytes()
            assert team_token[3:].encode() not in raw and admin_token[3:].encode() not in raw


# --------------------------------------------------------------------------- concurrency and crashes


def test_concurrent_submissions_land_exactly_once(db_url: str, tmp_path: Path) -> None:
    """500 jobs from 20 threads, each with its own Store (own connection pool), each job sent
    twice with its idempotency key by two different threads: exactly 500 jobs exist."""
    threads, per_thread = 20, 25
    keys = [f"job-{t}-{i}" for t in range(threads) for i in range(per_thread)]
    # A timeout, and an abort by a thread that fails before it: a thread that died before the
    # barrier must fail the test with its error, not leave the others waiting for ever (the
    # pool's exit joins them, so pytest-timeout cannot end a hang here).
    barrier = threading.Barrier(threads, timeout=120)

    def client(t: int) -> list[tuple[str, int]]:
        s: Store | None = None
        try:
            s = Store.open(db_url, runs_dir=tmp_path)  # twenty opens racing the first migration
            s.upsert_team("vision", 4, now=1.0)
            barrier.wait()
            mine = keys[t * per_thread : (t + 1) * per_thread]
            theirs = keys[((t + 1) % threads) * per_thread : ((t + 1) % threads + 1) * per_thread]
            out = []
            for key in [k for pair in zip(mine, theirs, strict=True) for k in pair]:
                out.append((key, submit(s, "same", key=key).id))
            return out
        except BaseException:
            barrier.abort()  # harmless after the barrier: nobody waits on it again
            raise
        finally:
            if s is not None:
                s.close()

    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(client, t) for t in range(threads)]
    # The first real error, not the BrokenBarrierError it caused in the others.
    errors = [e for f in futures if (e := f.exception()) is not None]
    causes = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:
        raise (causes or errors)[0]
    results = [r for f in futures for r in f.result()]

    assert len(results) == 2 * len(keys)
    by_key: dict[str, set[int]] = {}
    for key, job_id in results:
        by_key.setdefault(key, set()).add(job_id)
    assert all(len(ids) == 1 for ids in by_key.values())  # a re-send got the same job
    ids = {next(iter(v)) for v in by_key.values()}
    assert len(ids) == len(keys) == 500  # no two keys share a job: none lost, none merged
    with Store.open(db_url, runs_dir=tmp_path) as s:
        stored = s.list_jobs()
        assert {j.id for j in stored} == ids and len(stored) == 500
        assert {j.idempotency_key for j in stored} == set(keys)


_KILLED_WRITER = """
import sys, time
from pathlib import Path
from sqlalchemy import event
from sqlalchemy.engine import Engine
from visionloop.sched.states import JobState
from visionloop.sched.store import Store

store = Store.open(sys.argv[1], runs_dir=Path(sys.argv[3]))

def hang_before_commit(conn):
    print("in the transaction, about to commit", flush=True)
    time.sleep(120)

event.listen(Engine, "commit", hang_before_commit)
store.transition(int(sys.argv[2]), JobState.CANCELLED, "never committed", expect=JobState.QUEUED, now=99.0)
print("committed?!", flush=True)
"""


def test_a_writer_killed_mid_transaction_leaves_the_store_consistent(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    job = submit(store)
    before, history = store.get_job(job.id), store.transitions(job.id)
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, db_url, str(job.id), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "in the transaction, about to commit"
        # The write really is in flight: its lock is held (the job row, or SQLite's write lock).
        url = make_url(db_url)
        if url.get_backend_name() == "sqlite":
            probe = sqlite3.connect(str(url.database), timeout=0.05, isolation_level=None)
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                probe.execute("BEGIN IMMEDIATE")
            probe.close()
        else:
            import psycopg

            with (
                psycopg.connect(url.set(drivername="postgresql").render_as_string(False)) as pg,
                pytest.raises(psycopg.errors.LockNotAvailable),
            ):
                pg.execute("SELECT state FROM jobs WHERE id = %s FOR UPDATE NOWAIT", (job.id,))
        assert store.get_job(job.id) == before  # readers never see uncommitted changes
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    assert store.get_job(job.id) == before
    assert store.transitions(job.id) == history  # no half-written transition row
    after = store.transition(job.id, JobState.CANCELLED, "cancelled by a live writer", now=100.0)
    assert after.state is JobState.CANCELLED and after.version == before.version + 1
    assert [t.reason for t in store.transitions(job.id)] == ["submitted", "cancelled by a live writer"]
    if make_url(db_url).get_backend_name() == "sqlite":
        with sqlite3.connect(str(make_url(db_url).database)) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_heartbeats_update_many_jobs_in_one_call(store: Store) -> None:
    a, b = submit(store, "a"), submit(store, "b")
    assert store.heartbeats({}) == 0
    assert store.heartbeats({a.id: 100.5, b.id: 200.25, 999_999: 1.0}) == 2  # unknown id skipped
    assert store.get_job(a.id).last_heartbeat_at == 100.5
    assert store.get_job(b.id).last_heartbeat_at == 200.25
    assert store.heartbeats({a.id: 101.0}) == 1
    assert (store.get_job(a.id).last_heartbeat_at, store.get_job(b.id).last_heartbeat_at) == (101.0, 200.25)


def test_view_jobs_lists_queued_and_active_jobs_with_the_scheduler_columns(store: Store) -> None:
    a, b, c = submit(store, "a", gpus=2, now=10.0), submit(store, "b", now=11.0), submit(store, "c", now=12.0)
    store.transition(c.id, JobState.CANCELLED, "test", now=13.0)
    store.sync_gpus(GPUS, now=1.0)
    store.start_attempt(b.id, "local", GPUS[:1], now=14.0)
    rows = store.view_jobs()
    assert [(r.id, r.state) for r in rows] == [(a.id, "queued"), (b.id, "running")]
    r = rows[0]
    assert (r.team, r.priority_rank, r.gpus, r.submitted_at, r.spot, r.memory_gb) == (
        "vision",
        50,
        2,
        10.0,
        a.spot,
        16.0,
    )
    assert (r.attained_gpu_s, r.not_before, r.last_checkpoint_at) == (0.0, 0.0, None)


def test_view_jobs_follows_every_change_made_through_the_store(store: Store) -> None:
    """view_jobs is cached between full reads; each change through the store must still show
    on the next call: submit, transition, attempt start and end, checkpoint."""
    store.sync_gpus(GPUS, now=1.0)
    a, b = submit(store, "a", now=10.0), submit(store, "b", now=11.0)
    first = store.view_jobs()
    assert [(r.id, r.state) for r in first] == [(a.id, "queued"), (b.id, "queued")]
    assert store.view_jobs() == first  # nothing changed: the same rows

    c = submit(store, "c", now=12.0)
    store.start_attempt(a.id, "local", GPUS[:1], now=13.0)
    store.record_checkpoint(a.id, 7, 14.0, attempt=1)
    rows = {r.id: r for r in store.view_jobs()}
    assert (rows[a.id].state, rows[a.id].last_checkpoint_at) == ("running", 14.0)
    assert [r.id for r in store.view_jobs()] == [a.id, b.id, c.id]  # submission order kept

    store.end_attempt(a.id, 1, "preempted", 75, 23.0, JobState.QUEUED, "preempted", not_before=30.0)
    store.transition(b.id, JobState.CANCELLED, "cancelled", now=24.0)
    rows = {r.id: r for r in store.view_jobs()}
    assert set(rows) == {a.id, c.id}  # the cancelled job left the view
    assert (rows[a.id].state, rows[a.id].attained_gpu_s, rows[a.id].not_before) == ("queued", 10.0, 30.0)
    # The cache never drifts from what a full read gives.
    assert store.view_jobs() == tuple(store._read_view())


def test_view_jobs_sees_a_change_made_through_another_connection_at_the_next_full_read(
    store: Store, db_url: str, tmp_path: Path
) -> None:
    a = submit(store, "a", now=10.0)
    assert [r.id for r in store.view_jobs()] == [a.id]
    with Store.open(db_url, runs_dir=tmp_path / "runs") as other:
        b = submit(other, "b", now=11.0)  # another process's change: this store did not see it
        other.transition(a.id, JobState.CANCELLED, "cancelled elsewhere", now=12.0)
    # Until the next full read the cache answers (what makes a cycle cheap) ...
    assert [(r.id, r.state) for r in store.view_jobs()] == [(a.id, "queued")]
    store.VIEW_FULL_READ_S = 0.0  # ... and the periodic full read brings the other changes in.
    assert [(r.id, r.state) for r in store.view_jobs()] == [(b.id, "queued")]


def test_a_resync_marks_missing_gpus_down_and_brings_them_back_when_listed_again(store: Store) -> None:
    store.sync_gpus(GPUS, now=1.0)
    store.set_gpus_up(GPUS[0].id, up=False, reason="spot interruption", now=2.0)
    # Node n1 leaves (both its GPUs unlisted) and n0/0, down for a spot interruption, stays listed.
    after = {g.id: g for g in store.sync_gpus(GPUS[:2], now=3.0, missing="down")}
    assert set(after) == {g.id for g in GPUS}  # nothing deleted: attempts may still hold them
    assert [(after[g.id].up, after[g.id].down_reason) for g in GPUS] == [
        (False, "spot interruption"),
        (True, None),
        (False, GONE_REASON),
        (False, GONE_REASON),
    ]
    # n1 comes back; n0/0 stays down (a resync does not undo an interruption).
    back = {g.id: g for g in store.sync_gpus(GPUS, now=4.0, missing="down")}
    assert [(back[g.id].up, back[g.id].down_reason) for g in GPUS] == [
        (False, "spot interruption"),
        (True, None),
        (True, None),
        (True, None),
    ]
    # The start-up sync removes what is gone.
    assert [g.id for g in store.sync_gpus(GPUS[:3], now=5.0)] == [g.id for g in GPUS[:3]]


def test_opening_waits_for_a_writer_that_holds_a_database_not_yet_in_wal_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite skips the busy handler for `PRAGMA journal_mode = WAL`: while another connection
    held a write lock on a database not yet in WAL mode, opening the store failed at once with
    "database is locked" (a CI run: twenty stores opening a fresh file together)."""
    path = tmp_path / "state.db"
    # The writer lets go only once the opener has run into its lock ("database is locked"),
    # so the two overlap on any machine (a fixed delay could fire before the opener starts).
    refused: list[str] = []
    ran_into_the_lock = threading.Event()
    from visionloop.sched.db import engine as db_engine

    real_enable_wal = db_engine._enable_wal

    class Cursor:
        def __init__(self, cursor: Any) -> None:
            self.cursor = cursor

        def execute(self, sql: str) -> Any:
            try:
                return self.cursor.execute(sql)
            except sqlite3.OperationalError as e:
                refused.append(f"{sql}: {e}")
                ran_into_the_lock.set()
                raise

    monkeypatch.setattr(db_engine, "_enable_wal", lambda cursor: real_enable_wal(Cursor(cursor)))
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        holder.execute("CREATE TABLE other (x)")  # a database in rollback-journal mode
        holder.execute("BEGIN IMMEDIATE")
        holder.execute("INSERT INTO other VALUES (1)")

        def release() -> None:
            ran_into_the_lock.wait(timeout=60)
            holder.execute("COMMIT")

        releaser = threading.Thread(target=release)
        releaser.start()
        try:
            with Store.open(f"sqlite:///{path}", runs_dir=tmp_path) as store:
                assert store.upsert_team("vision", 1, now=1.0).name == "vision"
        finally:
            releaser.join()
        assert ran_into_the_lock.is_set() and "database is locked" in refused[0], refused
        assert holder.execute("SELECT x FROM other").fetchall() == [(1,)]  # the writer's row kept
        with closing(sqlite3.connect(path)) as fresh:
            assert fresh.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    finally:
        holder.close()


def trial_job(s: Store, number: int, until_epoch: int | None) -> Job:
    doc = {
        **spec_doc(f"t{number}", 1),
        "trial": {"study": "st", "number": number, "until_epoch": until_epoch},
    }
    doc["train"]["epochs"] = 3
    job: Job = submit_doc(s, doc, now=10.0)
    return job


def test_a_paused_trial_is_promoted_with_its_next_rung_or_pruned_for_good(store: Store) -> None:
    gpu = Gpu("g0", "n0", "A100")
    job = trial_job(store, 0, 1)
    assert store.get_job(job.id).workload_doc == {
        "kind": "trial",
        "study": "st",
        "number": 0,
        "until_epoch": 1,
    }
    assert store.get_job(job.id).workload.command(CommandContext(Path("/j"), Path("/r"), 1))[-2:] == [
        "--until-epoch",
        "1",
    ]
    store.start_attempt(job.id, "local", [gpu], now=12.0)
    store.end_attempt(job.id, 1, "paused", 76, 14.0, JobState.PAUSED, "at its rung")
    assert store.get_job(job.id).state is JobState.PAUSED
    assert [j.id for j in store.view_jobs()] == []  # a paused job is not the scheduler's
    with pytest.raises(StoreError, match="promote it to a later epoch"):
        store.resume_paused(job.id, 1, "again", now=15.0)
    resumed = store.resume_paused(job.id, 3, "promoted", now=15.0)
    assert resumed.state is JobState.QUEUED and resumed.waiting_reason == "promoted"
    workload = store.get_job(job.id).workload_doc
    assert workload is not None and workload["until_epoch"] == 3
    assert [j.id for j in store.view_jobs()] == [job.id]
    with pytest.raises(TransitionError, match="is queued, not paused"):
        store.prune(job.id, "late", now=16.0)

    other = trial_job(store, 1, 1)
    store.start_attempt(other.id, "local", [Gpu("g1", "n0", "A100")], now=12.0)
    store.end_attempt(other.id, 1, "paused", 76, 14.0, JobState.PAUSED, "at its rung")
    pruned = store.prune(other.id, "never among the best", now=20.0)
    assert pruned.state is JobState.PRUNED and pruned.finished_at == 20.0
    assert [a.outcome for a in store.attempts(other.id)] == ["pruned"]
    assert store.transitions(other.id)[-1].reason == "never among the best"
    with pytest.raises(TransitionError):
        store.resume_paused(other.id, None, "too late", now=21.0)


def test_only_a_trial_can_be_promoted(store: Store) -> None:
    job = submit(store, "plain")
    store.start_attempt(job.id, "local", [Gpu("g0", "n0", "A100")], now=12.0)
    # Only a trial's workload pauses; the store still refuses to promote a plain job there.
    store.end_attempt(job.id, 1, "paused", 76, 14.0, JobState.PAUSED, "odd")
    with pytest.raises(StoreError, match="not a tuning trial"):
        store.resume_paused(job.id, None, "no", now=15.0)


def test_the_schema_allows_exactly_the_state_machines_states_and_outcomes() -> None:
    from typing import get_args

    from visionloop.sched.records import Outcome

    assert set(db.JOB_STATES) == {s.value for s in JobState}
    assert set(db.OUTCOMES) == set(get_args(Outcome))
