"""Least-attained-service preemption through the real control plane (store on SQLite, the
local executor with a fake GPU, the cycle run by the test): a fresh job evicts a job of its
own team and class that has received the threshold's GPU-time, with a reason that says so;
the evicted job does not take the GPU back; and `las_preemption = false` in cluster.toml
turns it off. The threshold is set to one GPU-second so that real seconds cross it.

The jobs are sleepers: only the GPU they hold matters here."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from _cpkit import CP, cluster_config, control_plane
from _cpkit import train_doc as _train
from _dbkit import fresh_database
from visionloop.sched.store import Job

ONE_GPU = [{"node": "local", "type": "fake", "count": 1, "price_class": "owned"}]
TEAM = [{"name": "vision", "nominal_gpus": 1}]


def _sleeper(job: Job) -> list[str]:
    return [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.fixture(params=[True, False], ids=["las", "off"])
def cp(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CP]:
    scheduler = {"las_preemption": request.param, "las_threshold_gpu_s": 1}
    cfg = cluster_config(inventory=ONE_GPU, teams=TEAM, scheduler=scheduler)
    with fresh_database("sqlite", tmp_path) as url, control_plane(url, cfg, run_scheduler=False) as plane:
        plane.plane._command = _sleeper  # type: ignore[method-assign]
        yield plane


def _submit(cp: CP, dataset: Path, name: str) -> int:
    spec = {"train": {**_train(dataset), "seed": len(name)}, "name": name, "team": "vision"}
    with cp.client() as c:
        r = c.post("/v1/jobs", json={"spec": spec})
        assert r.status_code == 201, r.text
        return int(r.json()["id"])


def _cycle_until(cp: CP, done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 60
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
        cp.plane.cycle()


def test_a_fresh_job_evicts_one_of_its_class_past_the_threshold_and_it_does_not_come_back(
    cp: CP, digits_dataset: Path
) -> None:
    plane = cp.plane
    state = lambda j: plane.store.get_job(j).state.value  # noqa: E731
    old = _submit(cp, digits_dataset, "old")
    plane.cycle()
    assert state(old) == "running"
    time.sleep(1.5)
    # The view counts the running allocation in what the job has received (the policy's
    # "las" and "srpt" judge by it), not only its ended attempts.
    (active,) = plane._view(plane.clock(), None).running
    assert 1.5 <= active.attained_gpu_s < 60

    fresh = _submit(cp, digits_dataset, "fresh")
    plane.cycle()
    if not plane.policy.las_preemption:
        assert (state(old), state(fresh)) == ("running", "queued")
        reason = plane.store.get_job(fresh).waiting_reason or ""
        assert "team vision is at its limit 1" in reason, reason
        return
    assert state(old) == "preempting"
    why = plane.store.transitions(old)[-1].reason or ""
    assert f"preempted for job {fresh} of its team and class" in why, why
    assert "least attained service first" in why, why
    _cycle_until(cp, lambda: state(fresh) == "running", "the fresh job never started")
    assert state(old) == "queued"
    # The evicted job has had its GPU-second and waits: it never evicts the job that took its
    # place, which has crossed the threshold too by now.
    time.sleep(1.5)
    for _ in range(3):
        plane.cycle()
    assert (state(old), state(fresh)) == ("queued", "running")
    assert plane.store.get_job(old).preemptions == 1
