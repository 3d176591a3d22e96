"""The tuner's crash safety, through the real queue: a study run by a `visionloop tune run`
process against a `visionloop up` control plane while both are SIGKILLed at random moments
(seeded) and restarted, on SQLite or PostgreSQL (drawn with the seed), ends with exactly its trials, one job
each, nothing left running, no attempt run twice at once and no GPU double-booked; and a
trial preempted by a higher-priority job resumes as the same job and the same Optuna trial,
reporting each epoch once."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import DBAPIError

from _cpkit import CP, FAST, TEAMS, cluster_config, control_plane, free_port, job_roots, jobs_processes
from _cpkit import train_doc as _train
from _dbkit import BACKENDS, fresh_database
from visionloop.api.client import Client
from visionloop.core.errors import NotFoundError
from visionloop.core.settings import load_settings
from visionloop.sched.records import Attempt
from visionloop.sched.service_reconcile import EVALS_FILE, read_evals
from visionloop.sched.store import Store
from visionloop.tune.spec import TuneSpec, validate_tune_spec
from visionloop.tune.study import create_or_load, load
from visionloop.tune.tuner import JOB_ATTR, Tuner

CLUSTER = """
[scheduler]
{timings}

[jobs]
allowed_roots = {roots}

[[teams]]
name = "vision"
nominal_gpus = 2

[[inventory]]
node = "local"
type = "fake"
count = 2
"""

# What a tuner run may die of, other than our SIGKILL: the control plane it talks to was
# SIGKILLed under it (refused connections while it restarts, a request cut mid-answer).
CP_GONE = (
    "cannot reach the control plane",
    "did not answer in time",
    "RemoteProtocolError",
    "ReadError",
    "ConnectError",
)
# A trial asked (RUNNING) whose job the tuner has not recorded yet (Optuna's own tables).
JOBLESS = text(
    "SELECT t.number FROM trials t JOIN studies s ON s.study_id = t.study_id "
    "WHERE s.study_name = :study AND t.state = 'RUNNING' AND NOT EXISTS ("
    "SELECT 1 FROM trial_user_attributes a WHERE a.trial_id = t.trial_id AND a.key = :key) "
    "AND (:number < 0 OR t.number = :number) ORDER BY t.number LIMIT 1"
)
# Optuna's word for a step reported twice (it keeps the first value, so only this shows it).
REPORTED_TWICE = "is already reported"


def _tune_doc(dataset: Path, name: str, **fields: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": name,
        "train": _train(dataset, epochs=2),
        "space": {"optimizer.lr": {"loguniform": [1e-4, 1e-2]}},
        "sampler": {"name": "random", "seed": 0},
        "pruner": {"name": "asha", "min_epochs": 1, "reduction_factor": 2},
        "trials": 4,
        "concurrency": 2,
        "job": {"team": "vision"},
    }
    doc.update(fields)
    return doc


def _db_args(url: str) -> tuple[list[str], dict[str, str]]:
    """How a command is given the database: `--db URL`, or, for a URL with a password (which
    `--db` refuses: the command line is world-readable), VISIONLOOP_DB_URL."""
    if make_url(url).password:
        return [], {"VISIONLOOP_DB_URL": url}
    return ["--db", url], {}


def _metric_evals(spec: TuneSpec, job_dir: Path) -> dict[int, float]:
    """The objective at each whole epoch in a job's evaluations file, the first one recorded
    for an epoch (what the tuner must have reported)."""
    metric = spec.objective.metric.removeprefix("val/")
    first: dict[int, float] = {}
    for event in read_evals(job_dir / EVALS_FILE):
        if metric in event.metrics and abs(event.epoch - round(event.epoch)) < 1e-6:
            first.setdefault(round(event.epoch), event.metrics[metric])
    return first


def _no_overlap(spans: list[tuple[float, float | None]]) -> bool:
    """Every span ended, each before the next began."""
    ended = sorted((start, end) for start, end in spans if end is not None)
    return len(ended) == len(spans) and all(a[1] <= b[0] for a, b in itertools.pairwise(ended))


def _check_study(
    spec: TuneSpec, url: str, home: Path, extra_jobs: int = 0, why: str = ""
) -> tuple[list[FrozenTrial], dict[int, list[Attempt]]]:
    """Exactly `trials` trials, all finished, one job each (named after the trial, its id on
    the trial), every job ended as its trial did, attempts one at a time and no GPU held by
    two attempts at once. Returns the trials and each trial job's attempts."""
    trials = load(spec.name, url).get_trials()
    assert len(trials) == spec.trials, (why, trials)
    states = [t.state for t in trials]
    assert all(s in (TrialState.COMPLETE, TrialState.PRUNED) for s in states), (why, states)
    store = Store.open(url)
    try:
        jobs = store.list_jobs()
        assert len(jobs) == spec.trials + extra_jobs, (why, jobs)
        assert store.active_attempts() == [], (why, store.active_attempts())
        # Nothing left queued, running or paused, and nothing failed.
        assert all(j.state.value in ("succeeded", "pruned") for j in jobs), (why, jobs)
        by_id = {j.id: j for j in jobs}
        job_ids = [int(t.user_attrs[JOB_ATTR]) for t in trials]
        assert len(set(job_ids)) == len(job_ids), (why, job_ids)  # one job per trial
        per_gpu: dict[str, list[tuple[float, float | None]]] = {}
        attempts: dict[int, list[Attempt]] = {}
        for t, job_id in zip(trials, job_ids, strict=True):
            job = store.get_job(job_id)
            assert job.name == f"{spec.name}-t{t.number}", (why, job)
            assert (job.workload_doc or {}).get("number") == t.number, (why, job.workload_doc)
            assert job.restarts == 0, (
                why,
                "a crash counted as the trial's failure",
                store.transitions(job_id),
            )
            tried = attempts[t.number] = store.attempts(job_id)
            done = [(a.outcome, a.exit_code) for a in tried]
            assert all(a.outcome not in (None, "failed", "cancelled") for a in tried), (why, t.number, done)
            evals = _metric_evals(spec, home / "jobs" / f"job-{job_id}")
            if t.state == TrialState.COMPLETE:
                assert job.state.value == "succeeded", (why, t.number, job, done)
                assert sorted(t.intermediate_values) == [1, 2], (why, t)
                assert t.value == t.intermediate_values[2], (why, t)
                # Promoted from its rung: paused there (exit 76), then went on to the end.
                assert done[-1] == ("succeeded", 0), (why, t.number, done)
                assert ("paused", 76) in done[:-1], (why, t.number, done)
            else:
                assert job.state.value == "pruned", (why, t.number, job, done)
                assert sorted(t.intermediate_values) == [1], (why, t)
                assert done[-1] == ("pruned", 76), (why, t.number, done)
            # The values reported are the job's own evaluations, the first one of each epoch.
            assert t.intermediate_values == {e: evals[e] for e in t.intermediate_values}, (why, t, evals)
            # One attempt at a time.
            assert _no_overlap([(a.started_at, a.ended_at) for a in tried]), (why, t.number, tried)
            for a in tried:
                for alloc in a.allocations:
                    per_gpu.setdefault(alloc.gpu_id, []).append((alloc.started_at, alloc.ended_at))
        for job_id in set(by_id) - set(job_ids):
            for a in store.attempts(job_id):
                for alloc in a.allocations:
                    per_gpu.setdefault(alloc.gpu_id, []).append((alloc.started_at, alloc.ended_at))
        for gpu, spans in per_gpu.items():
            assert _no_overlap(spans), (why, f"{gpu} was double-booked", sorted(spans, key=lambda s: s[0]))
    finally:
        store.close()
    return trials, attempts


# --------------------------------------------------------------------------- 1. SIGKILL chaos


@dataclass
class _Chaos:
    """The control plane and the tuner as processes, killed and restarted by the driver."""

    home: Path
    url: str
    spec_path: Path
    port: int = field(default_factory=free_port)
    cp: subprocess.Popen[bytes] | None = None
    tuner: subprocess.Popen[bytes] | None = None
    tuner_log: Path | None = None
    runs: int = 0
    log: list[str] = field(default_factory=list)  # what happened, for the failure message

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start_cp(self) -> None:
        args, env = _db_args(self.url)
        self.cp = subprocess.Popen(
            [sys.executable, "-m", "visionloop", "up", "--port", str(self.port), *args],
            env={**os.environ, **env},
            stdout=subprocess.DEVNULL,
            stderr=open(self.home / "cp.log", "ab"),  # noqa: SIM115 - the child holds it
            start_new_session=True,
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert self.cp.poll() is None, f"the control plane exited at start-up:\n{self._cp_log()}"
            try:
                if httpx.get(f"{self.api}/v1/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"the control plane did not answer within 90 s:\n{self._cp_log()}")

    def _cp_log(self) -> str:
        return (self.home / "cp.log").read_text(errors="replace")[-3000:]

    def start_tuner(self) -> None:
        self.runs += 1
        args, env = _db_args(self.url)
        token = (self.home / "admin.token").read_text().strip()
        env = {**os.environ, **env, "VISIONLOOP_API_URL": self.api, "VISIONLOOP_TOKEN": token}
        cmd = [sys.executable, "-m", "visionloop", "tune", "run", str(self.spec_path), *args, "--poll", "0.2"]
        self.tuner_log = self.home / f"tuner-{self.runs}.log"
        self.tuner = subprocess.Popen(
            cmd,
            env=env,
            stdout=open(self.tuner_log, "wb"),  # noqa: SIM115 - the child holds it
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def tuner_output(self) -> str:
        assert self.tuner_log is not None
        return self.tuner_log.read_text(errors="replace")

    def kill(self, what: str) -> None:
        """SIGKILL the control plane, the tuner or both at the same instant, then restart."""
        procs = {"cp": [self.cp], "tuner": [self.tuner], "both": [self.cp, self.tuner]}[what]
        for p in procs:
            assert p is not None
            p.send_signal(signal.SIGKILL)  # a no-op on one that already exited
        for p in procs:
            assert p is not None
            p.wait(timeout=30)
        self.log.append(f"{time.strftime('%X')} killed {what}")
        if what in ("cp", "both"):
            self.start_cp()
        if what in ("tuner", "both"):
            self.start_tuner()

    def kill_tuner_mid_submit(self, engine: Engine, study: str) -> tuple[int, int]:
        """SIGKILL the tuner after the control plane made a trial's job, before the tuner
        recorded that job on the trial; return the trial's number and the job's id.

        The moment is made, not hoped for: as soon as a trial without a job shows in the
        database (asked, its job not recorded yet), the tuner is frozen (SIGSTOP) and let
        run in 2 ms slices until the trial's job is in the job store while the trial still
        has no job; it is SIGKILLed there. A slice that went as far as recording the job
        misses the moment: the next trial asked is tried."""
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert self.tuner is not None and self.tuner.poll() is None, self.tuner_output()[-3000:]
            number = self._jobless(engine, study)
            if number is None:
                time.sleep(0.005)
                continue
            tuner = self.tuner
            tuner.send_signal(signal.SIGSTOP)
            try:
                while self._jobless(engine, study, number) == number:
                    job_id = self._job_id(engine, f"{study}-t{number}")
                    if job_id is not None:
                        tuner.send_signal(signal.SIGKILL)
                        tuner.wait(timeout=30)
                        self.log.append(f"{time.strftime('%X')} killed the tuner in trial {number}'s submit")
                        self.start_tuner()
                        return number, job_id
                    tuner.send_signal(signal.SIGCONT)
                    time.sleep(0.002)
                    tuner.send_signal(signal.SIGSTOP)
            finally:
                tuner.send_signal(signal.SIGCONT)  # a no-op on a dead one
        raise AssertionError(f"no trial's submit could be caught within 180 s: {self.log}")

    @staticmethod
    def _jobless(engine: Engine, study: str, number: int = -1) -> int | None:
        """The first trial (or trial `number`) asked without a recorded job, if any."""
        try:
            with engine.connect() as conn:
                found = conn.execute(JOBLESS, {"study": study, "key": JOB_ATTR, "number": number}).scalar()
        except DBAPIError:  # Optuna's tables are not there yet
            return None
        return None if found is None else int(found)

    @staticmethod
    def _job_id(engine: Engine, name: str) -> int | None:
        with engine.connect() as conn:
            found = conn.execute(text("SELECT min(id) FROM jobs WHERE name = :name"), {"name": name}).scalar()
        return None if found is None else int(found)

    def watch_tuner(self) -> int | None:
        """The tuner's exit status once it exited by itself (None while it runs): a run that
        died because the control plane went away under it is started again."""
        assert self.tuner is not None
        rc = self.tuner.poll()
        if rc is None or rc == 0:
            return rc
        out = self.tuner_output()
        self.log.append(f"{time.strftime('%X')} tuner run {self.runs} exited {rc}: {out[-300:]!r}")
        assert any(s in out for s in CP_GONE), f"the tuner failed by itself (exit {rc}):\n{out[-3000:]}"
        self.start_tuner()
        return None

    def stop(self) -> None:
        for p in (self.tuner, self.cp):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def test_tuner_and_control_plane_sigkilled_at_random_moments_finish_the_study_exactly(
    vl_home: Path, tmp_path: Path, digits_dataset: Path
) -> None:
    seed = int(os.environ.get("CHAOS_SEED", random.randrange(1_000_000)))
    rng = random.Random(seed)
    # The backend is part of the random draw (the study takes 1.5 to 2 minutes of the suite's
    # time on each): every run tries one, CHAOS_SEED repeats a run exactly, with its backend.
    # The study's storage on both backends is test_tune_study.py's, every run.
    backend = BACKENDS[seed % len(BACKENDS)]
    print(f"chaos seed {seed} on {backend} (CHAOS_SEED={seed} repeats it)")
    # Both of them, each alone, and both at the same instant, in a random order.
    kills = ["cp", "tuner", "cp", "tuner", "both"]
    rng.shuffle(kills)

    timings = "\n".join(f"{k} = {v}" for k, v in FAST.items())
    (vl_home / "cluster.toml").write_text(CLUSTER.format(timings=timings, roots=json.dumps(job_roots())))
    doc = _tune_doc(digits_dataset, "chaos-lr")
    spec = validate_tune_spec(doc, "tune.yaml")
    spec_path = tmp_path / "tune.yaml"
    spec_path.write_text(yaml.safe_dump(doc, sort_keys=False))

    with fresh_database(backend, tmp_path) as url:
        chaos = _Chaos(vl_home, url, spec_path)
        why = f"seed {seed}, {backend}"
        try:
            chaos.start_cp()
            chaos.start_tuner()
            # First the tuner killed between submitting a trial's job and recording it (the
            # idempotency key gets it the same job back), then the random kills.
            engine = create_engine(url)
            try:
                stalled, stalled_job = chaos.kill_tuner_mid_submit(engine, spec.name)
            finally:
                engine.dispose()
            for what in kills:
                # A random moment: 1 to 6 s apart, so the kills land while trials start,
                # train, pause, get promoted or pruned (the study takes a minute or more).
                until = time.monotonic() + rng.uniform(1.0, 6.0)
                while time.monotonic() < until:
                    rc = chaos.watch_tuner()
                    assert rc is None, f"({why}) the study ended before the kills: {chaos.log}"
                    time.sleep(0.05)
                chaos.kill(what)
            deadline = time.monotonic() + 600
            while (rc := chaos.watch_tuner()) is None:
                assert chaos.cp is not None and chaos.cp.poll() is None, (
                    f"({why}) the control plane died:\n{chaos._cp_log()}"
                )
                assert time.monotonic() < deadline, f"({why}) the study did not end: {chaos.log}"
                # A trial too many fails now, not at the deadline.
                try:
                    asked = len(load(spec.name, url).get_trials(deepcopy=False))
                except NotFoundError:  # no tuner run got as far as creating the study yet
                    asked = 0
                assert asked <= spec.trials, f"({why}) {asked} trials asked: {chaos.log}"
                time.sleep(0.5)
            out = chaos.tuner_output()
            print("\n".join(chaos.log))
            print(f"tuner runs: {chaos.runs}; the last one said:\n{out[-1500:]}")
            assert rc == 0, (why, out[-3000:])
            assert f"{spec.trials}/{spec.trials} finished" in out, (why, out[-3000:])
            for n in range(1, chaos.runs + 1):
                text = (vl_home / f"tuner-{n}.log").read_text(errors="replace")
                assert REPORTED_TWICE not in text, (why, n, text[-3000:])
        finally:
            chaos.stop()

        trials, attempts = _check_study(spec, url, vl_home, why=why)
        # The trial whose submit was cut kept the job made then (its idempotency key).
        assert trials[stalled].user_attrs[JOB_ATTR] == stalled_job, (why, stalled, stalled_job)
        for t in trials:
            print(
                f"trial {t.number} {t.state.name}: {[(a.outcome, a.exit_code) for a in attempts[t.number]]}"
            )
        deadline = time.monotonic() + 30
        while jobs_processes(vl_home) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert jobs_processes(vl_home) == [], f"({why}) training processes left running"


# --------------------------------------------------------------------------- 2. preemption

ONE_GPU = [{"node": "local", "type": "fake", "count": 1, "price_class": "owned"}]
GOOD_LR, BAD_LR = 0.003, 1e-4


@pytest.fixture
def one_gpu_cp(tmp_path: Path) -> Iterator[tuple[CP, str]]:
    cfg = cluster_config(inventory=ONE_GPU, teams=TEAMS)
    with fresh_database("sqlite", tmp_path) as url, control_plane(url, cfg) as plane:
        yield plane, url


def test_a_preempted_trial_resumes_as_the_same_trial_and_reports_each_epoch_once(
    one_gpu_cp: tuple[CP, str], digits_dataset: Path
) -> None:
    cp, url = one_gpu_cp
    # Two trials on the only GPU, research's at low priority, the good one first. The good
    # one is preempted by vision's high-priority job during its first epoch (batches of 4:
    # ~360 steps to the rung, so the preemption lands well before it; with batches of 16,
    # then of 8, a loaded CI machine let the trial reach its rung first), resumes from that
    # checkpoint, pauses at the rung, waits for the bad one, and is promoted to the end.
    train = _train(digits_dataset, epochs=2)
    train["data"]["batch_size"] = 4
    train["checkpoint"]["every_steps"] = 12  # the preemption waits for the first one (~360 steps a rung)
    doc = _tune_doc(
        digits_dataset,
        "preempted-lr",
        train=train,
        trials=2,
        concurrency=1,
        job={"team": "research", "priority": "low"},
    )
    spec = validate_tune_spec(doc, "tune.yaml")
    study = create_or_load(spec, url)
    study.enqueue_trial({"optimizer.lr": GOOD_LR})
    study.enqueue_trial({"optimizer.lr": BAD_LR})
    high_id: list[int] = []

    def on_pass(_: Any) -> None:
        # The moment the good trial's job has a checkpoint: vision wants the GPU.
        if high_id:
            return
        trial = load(spec.name, url).trials[0]
        if JOB_ATTR not in trial.user_attrs:
            return
        with cp.client() as c:
            job = c.get(f"/v1/jobs/{trial.user_attrs[JOB_ATTR]}").json()["job"]
            if job["state"] == "running" and job["last_checkpoint_at"] is not None:
                high = {"spec": _train(digits_dataset, epochs=None, steps=8), "team": "vision"}
                r = c.post("/v1/jobs", json={**high, "priority": "high"})
                assert r.status_code == 201, r.text
                high_id.append(int(r.json()["id"]))

    deadline = time.monotonic() + 300
    with warnings.catch_warnings(record=True) as caught, Client(cp.url, cp.admin_token) as client:
        warnings.simplefilter("always")
        progress = Tuner(spec, study, client).run(
            poll_s=0.2, on_pass=on_pass, should_stop=lambda: time.monotonic() > deadline
        )
    assert progress.done and (progress.finished, progress.running, progress.paused) == (2, 0, 0), progress
    assert high_id, "the good trial never ran with a checkpoint"
    assert not [w for w in caught if REPORTED_TWICE in str(w.message)], [str(w.message) for w in caught]

    trials, attempts = _check_study(spec, url, load_settings().home, extra_jobs=1)
    good, bad = trials
    assert (good.number, good.params["optimizer.lr"], good.state) == (0, GOOD_LR, TrialState.COMPLETE)
    assert (bad.number, bad.state) == (1, TrialState.PRUNED)
    # The same job throughout: preempted (checkpoint, exit 75), requeued and resumed, paused
    # at the rung (76), promoted and resumed again to the end.
    assert [(a.outcome, a.exit_code) for a in attempts[0]] == [
        ("preempted", 75),
        ("paused", 76),
        ("succeeded", 0),
    ]
    with cp.client() as c:
        show = c.get(f"/v1/jobs/{good.user_attrs[JOB_ATTR]}").json()
        high_show = c.get(f"/v1/jobs/{high_id[0]}").json()
    assert show["job"]["preemptions"] == 1 and show["job"]["restarts"] == 0, show["job"]
    preempting = next(t for t in show["transitions"] if t["to_state"] == "preempting")
    assert f"job {high_id[0]}" in preempting["reason"], preempting
    assert high_show["job"]["state"] == "succeeded", high_show["job"]
    # The resumed attempt started from the preempted one's checkpoint, not from scratch.
    with cp.client() as c:
        second_log = c.get(f"/v1/jobs/{good.user_attrs[JOB_ATTR]}/logs", params={"attempt": 2}).text
    assert "resuming from" in second_log, second_log[-2000:]


# --------------------------------------------------------------------------- 3. the tracking store

# A process that SIGKILLs itself as MLflow records its second schema migration on a fresh
# SQLite tracking store: that migration's changes are made, its revision not recorded. A
# real moment of a real run (the tuner's first start makes the store, as does a user's first
# `train`); any stamp from the second to the last one leaves the same damage.
_KILLED_MID_MIGRATION = """
import os, signal
from sqlalchemy import event
from sqlalchemy.engine import Engine

stamps = 0

@event.listens_for(Engine, "before_cursor_execute")
def _die(conn, cursor, statement, *args):
    global stamps
    if statement.lstrip().upper().startswith("UPDATE ALEMBIC_VERSION"):
        stamps += 1
        if stamps == 2:
            os.kill(os.getpid(), signal.SIGKILL)

from visionloop.core.settings import load_settings
from visionloop.track.store import client
client(load_settings())
"""

_OPEN_STORE = """
from visionloop.core.settings import load_settings
from visionloop.track.store import client, ensure_experiment
settings = load_settings()
print(ensure_experiment(client(settings), settings, "after-the-crash"))
"""


def test_a_process_killed_while_creating_the_tracking_store_leaves_it_usable(vl_home: Path) -> None:
    env = {**os.environ, "VISIONLOOP_HOME": str(vl_home)}
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_MID_MIGRATION], env=env, capture_output=True, text=True, timeout=300
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    reopened = subprocess.run(
        [sys.executable, "-c", _OPEN_STORE], env=env, capture_output=True, text=True, timeout=300
    )
    assert reopened.returncode == 0, reopened.stderr[-3000:]
    assert reopened.stdout.strip().isdigit(), reopened.stdout
