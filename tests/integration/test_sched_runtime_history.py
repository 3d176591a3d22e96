"""The runtime history in the job store, on SQLite and PostgreSQL: a job that ran its whole
length leaves a sample (the time its attempts held GPUs), a queued job of the same spec or
shape gets an estimate from them, and the scheduler's view plans with it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _dbkit import BACKENDS, fresh_database, submit_doc
from visionloop.sched.states import JobState
from visionloop.sched.store import Store
from visionloop.sched.view import Gpu

GPU = Gpu("n0/0", "n0", "A100-80GB")
TRAIN: dict[str, Any] = {"epochs": 10, "model": {"arch": "resnet18"}, "data": {"dataset": "/data/digits"}}


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    with fresh_database(request.param, tmp_path) as url, Store.open(url, runs_dir=tmp_path / "runs") as s:
        s.upsert_team("vision", 4, 0, 1.0, now=1.0)
        yield s


def submit(store: Store, now: float, trial_until: int | None = None, **train: Any) -> int:
    doc: dict[str, Any] = {"train": {**TRAIN, **train}}
    if trial_until is not None:
        doc["trial"] = {"study": "st", "number": int(now), "until_epoch": trial_until}
    return int(submit_doc(store, doc, now=now).id)


def run(store: Store, job_id: int, start: float, seconds: float, end: JobState = JobState.SUCCEEDED) -> None:
    n = store.start_attempt(job_id, "local", [GPU], now=start).number
    outcome = {JobState.SUCCEEDED: "succeeded", JobState.PAUSED: "paused", JobState.FAILED: "failed"}[end]
    store.end_attempt(job_id, n, outcome, 0, start + seconds, end, "ended")


def test_runs_to_the_end_are_samples_and_a_queued_job_of_the_same_spec_gets_their_median(
    store: Store,
) -> None:
    for i, seconds in enumerate((100.0, 400.0, 130.0)):
        run(store, submit(store, now=i * 1000.0, seed=i), start=i * 1000.0 + 1, seconds=seconds)
    # A failure says nothing of a run's length; nor does a run on another architecture.
    run(store, submit(store, now=5000.0), start=5001.0, seconds=5.0, end=JobState.FAILED)
    other = submit(store, now=6000.0, model={"arch": "resnet50"})
    run(store, other, start=6001.0, seconds=900.0)

    queued = submit(store, now=7000.0, seed=99)
    est = store.runtime_estimate(queued)
    assert est is not None
    assert (est.seconds, est.runs, est.basis) == (130.0, 3, "the median of 3 earlier runs of this spec")
    assert (est.shortest, est.longest) == (100.0, 400.0)
    (row,) = store.view_jobs()
    assert row.id == queued and row.run_length == 10 and row.spec_key and row.shape_key
    samples = store.runtime_samples([row.shape_key])
    assert sorted(s.ran_s for s in samples) == [100.0, 130.0, 400.0]  # newest first, of this shape only
    assert [s.ran_s for s in samples] == [130.0, 400.0, 100.0]
    assert store.runtime_estimate(other) is None  # it ended: it is a sample, not a job to plan


def test_a_longer_run_of_the_same_shape_scales_the_time_per_epoch(store: Store) -> None:
    run(store, submit(store, now=0.0), start=1.0, seconds=120.0)  # 10 epochs, 12 s each
    ninety = submit(store, now=500.0, epochs=90, optimizer={"lr": 0.1})
    est = store.runtime_estimate(ninety)
    assert est is not None and est.seconds == pytest.approx(1080.0) and est.runs == 1
    assert "this architecture on the same data and GPUs" in est.basis


def test_a_preempted_run_counts_every_attempt_and_a_paused_trial_counts_to_its_rung(store: Store) -> None:
    job = submit(store, now=0.0)
    store.start_attempt(job, "local", [GPU], now=10.0)
    store.transition(job, JobState.PREEMPTING, "preempted", expect=JobState.RUNNING, now=40.0)
    store.end_attempt(job, 1, "preempted", 75, 50.0, JobState.QUEUED, "requeued")
    assert store.runtime_estimate(job) is None  # not run to its end yet: no sample, itself included
    run(store, job, start=100.0, seconds=60.0)
    (sample,) = store.runtime_samples([_shape(store, job)])
    assert (sample.ran_s, sample.length) == (40.0 + 60.0, 10)

    trial = submit(store, now=200.0, trial_until=3)
    run(store, trial, start=201.0, seconds=36.0, end=JobState.PAUSED)  # 3 epochs at 12 s
    by_length = sorted((s.length, s.ran_s) for s in store.runtime_samples([_shape(store, job)]))
    assert by_length == [(3, 36.0), (10, 100.0)]
    # Promoted to epoch 9: another length, so its keys change with it. Queued again, it is no
    # sample any more: 9 epochs at the full run's 10 s per epoch.
    store.resume_paused(trial, 9, "promoted", now=300.0)
    (row,) = store.view_jobs()
    assert row.run_length == 9
    est = store.runtime_estimate(trial)
    assert est is not None and est.seconds == pytest.approx(90.0) and est.runs == 1


def test_only_the_newest_samples_of_a_shape_count(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    import visionloop.sched.store.jobs as jobs

    monkeypatch.setattr(jobs, "SAMPLES_PER_SHAPE", 2)
    for i, seconds in enumerate((1000.0, 10.0, 20.0)):  # the first to end, an outlier, drops out
        run(store, submit(store, now=i * 2000.0), start=i * 2000.0 + 1, seconds=seconds)
    est = store.runtime_estimate(submit(store, now=999.0))
    assert est is not None and (est.seconds, est.runs) == (15.0, 2)


def _shape(store: Store, job_id: int) -> str:
    from sqlalchemy import select

    from visionloop.sched.db import JobRow

    with store._session(write=False) as s:
        shape = s.execute(select(JobRow.shape_key).where(JobRow.id == job_id)).scalar_one()
    assert shape is not None
    return str(shape)


@pytest.mark.parametrize("backend", BACKENDS)
def test_0007_goes_down_and_up_keeping_the_jobs_and_older_jobs_get_no_estimate(
    backend: str, tmp_path: Path
) -> None:
    from sqlalchemy import inspect

    from visionloop.sched import db

    with fresh_database(backend, tmp_path) as url:
        with Store.open(url, runs_dir=tmp_path / "runs") as store:
            store.upsert_team("vision", 4, 0, 1.0, now=1.0)
            done = submit(store, now=0.0)
            run(store, done, start=1.0, seconds=100.0)
            queued = submit(store, now=200.0)
            assert store.runtime_estimate(queued) is not None
        engine = db.make_engine(db.parse_url(url))
        try:
            db.downgrade(engine, "0006")  # planning data only: nothing refused
            assert not {"spec_key", "shape_key", "run_length", "ran_s"} & {
                c["name"] for c in inspect(engine).get_columns("jobs")
            }
        finally:
            engine.dispose()
        with Store.open(url, runs_dir=tmp_path / "runs") as store:  # up again to the head
            assert [j.id for j in store.list_jobs()] == [done, queued]
            # From before the history: no keys, so neither a sample nor an estimate.
            assert store.runtime_estimate(queued) is None
            (row,) = store.view_jobs()
            assert (row.spec_key, row.shape_key, row.run_length) == (None, None, None)
            again = submit(store, now=300.0)
            assert again == queued + 1 and store.runtime_estimate(again) is None
            run(store, again, start=301.0, seconds=50.0)
            est = store.runtime_estimate(submit(store, now=400.0))
            assert est is not None and est.seconds == 50.0
