"""The control plane SIGKILLed at random moments while it schedules, launches and reaps real
training jobs, and restarted each time: no job is lost, none runs twice at once, no GPU is
double-booked, nothing is left running unaccounted, and every job ends with its model."""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from _cpkit import FAST, free_port, job_roots, jobs_processes
from _trainkit import spec_doc
from visionloop.sched.states import JobState
from visionloop.sched.store import Store

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


def _start(home: Path, port: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "visionloop", "up", "--port", str(port)],
        env={**os.environ, "VISIONLOOP_HOME": str(home)},
        stdout=subprocess.DEVNULL,
        stderr=open(home / "cp.log", "ab"),
        start_new_session=True,
    )


def _wait_up(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the control plane exited at start-up; see cp.log"
        try:
            if httpx.get(f"{url}/v1/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("the control plane did not answer within 60 s")


def test_sigkill_at_random_moments_loses_and_duplicates_nothing(vl_home: Path, digits_dataset: Path) -> None:
    seed = int(os.environ.get("CHAOS_SEED", random.randrange(1_000_000)))
    rng = random.Random(seed)
    timings = "\n".join(f"{k} = {v}" for k, v in FAST.items())
    (vl_home / "cluster.toml").write_text(CLUSTER.format(timings=timings, roots=json.dumps(job_roots())))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _start(vl_home, port)
    try:
        _wait_up(url, proc)
        token = (vl_home / "admin.token").read_text().strip()
        headers = {"Authorization": f"Bearer {token}"}
        ids = []
        for i in range(5):
            spec = spec_doc(digits_dataset, epochs=None, steps=24 + 8 * i, tracking__enabled=False)
            body = {"spec": spec, "team": "vision", "gpus": 1, "idempotency_key": f"chaos-{i}"}
            r = httpx.post(f"{url}/v1/jobs", json=body, headers=headers, timeout=30)
            assert r.status_code == 201, r.text
            ids.append(r.json()["id"])
        for _ in range(6):
            time.sleep(rng.uniform(0.2, 4.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc = _start(vl_home, port)
            _wait_up(url, proc)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            jobs = httpx.get(f"{url}/v1/jobs", headers=headers, timeout=30).json()
            if all(j["state"] in ("succeeded", "failed", "cancelled") for j in jobs):
                break
            time.sleep(0.5)
        else:
            states = [(j["id"], j["state"]) for j in jobs]
            raise AssertionError(f"(seed {seed}) jobs never finished: {states}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)

    store = Store.open(f"sqlite:///{vl_home / 'state.db'}")
    try:
        assert store.active_attempts() == [], f"(seed {seed}) attempts left open"
        per_gpu: dict[str, list[tuple[float, float]]] = {}
        for job_id in ids:
            job = store.get_job(job_id)
            attempts = store.attempts(job_id)
            assert job.state is JobState.SUCCEEDED, (seed, job, store.transitions(job_id))
            assert job.restarts == 0, f"(seed {seed}) a control-plane crash counted as a job failure"
            assert (job.run_dir / "final.safetensors").is_file()
            # One attempt at a time: each ended before the next began.
            for a, b in itertools.pairwise(attempts):
                assert a.ended_at is not None and a.ended_at <= b.started_at, (seed, attempts)
            assert attempts[-1].outcome == "succeeded"
            assert all(a.outcome in ("succeeded", "lost", "preempted") for a in attempts), (seed, attempts)
            for a in attempts:
                for alloc in a.allocations:
                    assert alloc.ended_at is not None
                    per_gpu.setdefault(alloc.gpu_id, []).append((alloc.started_at, alloc.ended_at))
        for gpu, spans in per_gpu.items():
            spans.sort()
            for (_, end), (start, _) in itertools.pairwise(spans):
                assert end <= start, f"(seed {seed}) {gpu} was double-booked: {spans}"
    finally:
        store.close()
    assert jobs_processes(vl_home) == [], f"(seed {seed}) training processes left running"
