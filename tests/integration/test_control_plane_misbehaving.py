"""Jobs that do not play by the trainer's rules, run for real by the local executor: a victim
that ignores SIGTERM is SIGKILLed after the grace period and requeued (a preemption, never a
failure); a job whose supervisor vanishes, or that stops heart-beating, is requeued.

The trainer always honours SIGTERM, so these jobs run a small Python program instead: the
control plane's command is replaced on the instance, everything else is the real thing.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _cpkit import CP, TEAMS, cluster_config, control_plane
from _cpkit import train_doc as _train
from _dbkit import fresh_database
from visionloop.sched.store import Job

ONE_GPU = [{"node": "local", "type": "fake", "count": 1, "price_class": "owned"}]

# Ignores SIGTERM; exits 0 after a while, or when a marker file appears.
STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: print("SIGTERM ignored", flush=True))
print("started", flush=True)
deadline = time.time() + float(sys.argv[1])
while time.time() < deadline and not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
"""


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[CP]:
    cfg = cluster_config(
        inventory=ONE_GPU, teams=TEAMS, scheduler={"grace_s": 1.0, "heartbeat_timeout_s": 3.0}
    )
    with fresh_database("sqlite", tmp_path) as url, control_plane(url, cfg) as plane:
        yield plane


def _stubborn(cp: CP, seconds: float, done: Path) -> None:
    def command(job: Job) -> list[str]:
        return [sys.executable, "-c", STUBBORN, str(seconds), str(done)]

    cp.plane._command = command  # type: ignore[method-assign]


def _submit(cp: CP, dataset: Path, **fields: Any) -> int:
    with cp.client() as c:
        r = c.post("/v1/jobs", json={"spec": _train(dataset), **fields})
        assert r.status_code == 201, r.text
        return int(r.json()["id"])


def _shim(cp: CP, job: int) -> dict[str, Any]:
    """The running attempt's supervisor, once the executor has launched it (the attempt is
    committed before its process exists)."""
    deadline = time.monotonic() + 60
    with cp.client() as c:
        while time.monotonic() < deadline:
            attempts = c.get(f"/v1/jobs/{job}").json()["attempts"]
            handle = attempts[0]["handle"] if attempts else None
            if handle and "pid" in handle:
                return dict(json.loads((Path(handle["attempt_dir"]) / "shim.json").read_text()))
            time.sleep(0.05)
    raise AssertionError(f"job {job} was not launched within 60 s")


def test_a_victim_ignoring_sigterm_is_killed_after_the_grace_period_and_requeued(
    cp: CP, digits_dataset: Path, tmp_path: Path
) -> None:
    done = tmp_path / "done"
    _stubborn(cp, 600, done)
    low = _submit(cp, digits_dataset, team="research", priority="low")
    cp.wait_job(low, lambda j: j["state"] == "running")
    # "running" is the launch; the victim ignores SIGTERM only once its handler is installed,
    # which it says with "started" (on a loaded machine Python's start-up took longer than the
    # preemption, and the victim died of the SIGTERM, 143).
    deadline = time.monotonic() + 60
    with cp.client() as c:
        while "started" not in c.get(f"/v1/jobs/{low}/logs", params={"attempt": 1}).text:
            assert time.monotonic() < deadline, "the victim did not start within 60 s"
            time.sleep(0.05)
    high = _submit(cp, digits_dataset, team="vision", priority="high")
    show = cp.wait_job(high, lambda j: j["state"] == "running")
    done.touch()  # from now on every attempt ends at once, with 0
    low_show = cp.wait_job(low, lambda j: j["state"] == "succeeded", timeout=120)
    first = low_show["attempts"][0]
    # SIGKILL after the grace period: 137, recorded as a preemption, not a failure.
    assert first["outcome"] == "preempted" and first["exit_code"] == 137
    assert low_show["job"]["restarts"] == 0 and low_show["job"]["preemptions"] == 1
    requeue = low_show["transitions"][3]
    assert requeue["to_state"] == "queued" and "exit 137 after the grace period" in requeue["reason"]
    with cp.client() as c:
        log = c.get(f"/v1/jobs/{low}/logs", params={"attempt": 1}).text
    assert "SIGTERM ignored" in log
    assert show["attempts"][0]["started_at"] >= first["ended_at"]  # never both on the one GPU


def test_a_job_whose_supervisor_vanishes_is_requeued_and_runs_again(
    cp: CP, digits_dataset: Path, tmp_path: Path
) -> None:
    done = tmp_path / "done"
    _stubborn(cp, 600, done)
    job = _submit(cp, digits_dataset, team="vision")
    shim = _shim(cp, job)
    os.kill(shim["shim_pid"], signal.SIGKILL)  # the job's supervisor dies without a word
    done.touch()  # the next attempt finishes at once
    show = cp.wait_job(job, lambda j: j["state"] == "succeeded", timeout=120)
    first, second = show["attempts"]
    assert first["outcome"] == "lost" and second["outcome"] == "succeeded"
    assert show["job"]["restarts"] == 0  # not the job's fault
    assert "process lost" in show["transitions"][2]["reason"]


def test_a_job_that_stops_heart_beating_is_killed_and_requeued(
    cp: CP, digits_dataset: Path, tmp_path: Path
) -> None:
    done = tmp_path / "done"
    _stubborn(cp, 600, done)
    job = _submit(cp, digits_dataset, team="vision")
    shim = _shim(cp, job)
    os.kill(shim["shim_pid"], signal.SIGSTOP)  # alive, but silent: a hung node, a frozen process
    try:
        cp.wait_job(job, lambda j: j["attempt"] >= 2, timeout=120)
    finally:
        done.touch()
    show = cp.wait_job(job, lambda j: j["state"] == "succeeded", timeout=120)
    first = show["attempts"][0]
    assert first["outcome"] == "lost"
    assert "no heartbeat" in show["transitions"][2]["reason"]


# Stops when asked, but only once a marker file appears: a victim whose grace period is long
# enough to restart the control plane in.
SLOW_STOP = """
import os, signal, sys, time
asked = []
signal.signal(signal.SIGTERM, lambda *a: asked.append(1))
print("started", flush=True)
while not (asked and os.path.exists(sys.argv[1])):
    time.sleep(0.05)
print("stopping after SIGTERM", flush=True)
sys.exit(75)
"""


def test_a_victims_gpus_stay_with_the_job_it_left_for_across_a_control_plane_restart(
    tmp_path: Path, digits_dataset: Path
) -> None:
    # The job a victim steps aside for is stored with it (`Job.leaving_for`), not kept in the
    # control plane's memory: a control plane restarted while the victim is on its way out
    # still shows the policy that it leaves for that job, and gives the job its GPU.
    from visionloop.api.server import build_plane
    from visionloop.core.settings import load_settings
    from visionloop.sched.service_admission import Principal
    from visionloop.sched.states import JobState
    from visionloop.sched.view import ClusterView, Freed

    cfg = cluster_config(inventory=ONE_GPU, teams=TEAMS, scheduler={"grace_s": 120.0})
    go = tmp_path / "go"
    admin = Principal(None, True)
    settings = load_settings().ensure()
    with fresh_database("sqlite", tmp_path) as url:
        first = build_plane(settings, cfg, url)
        planes = [first]
        try:

            def command(job: Job) -> list[str]:
                if job.priority == "high":
                    return [sys.executable, "-c", "print('done')"]
                return [sys.executable, "-c", SLOW_STOP, str(go)]

            first._command = command  # type: ignore[method-assign]
            low = first.submit(admin, _train(digits_dataset), team="research", priority="low")
            first.cycle()  # starts it
            (attempt,) = first.store.active_attempts()
            log = first.executor.log_path(attempt.handle or {})
            assert log is not None
            deadline = time.monotonic() + 60
            while not (log.is_file() and "started" in log.read_text()):  # its handler is installed
                assert time.monotonic() < deadline, "the victim did not start within 60 s"
                time.sleep(0.05)
            high = first.submit(admin, _train(digits_dataset), team="vision", priority="high")
            first.cycle()  # evicts it for the high job
            stored = first.store.get_job(low.id)
            assert (stored.state, stored.leaving_for) == (JobState.PREEMPTING, high.id)

            # The control plane goes (its memory with it); the victim runs on, still stopping.
            first.store.close()
            second = build_plane(settings, cfg, url)
            planes.append(second)
            second._command = command  # type: ignore[method-assign]
            views: list[ClusterView] = []
            build = second._view

            def recording(now: float, attempts: Any) -> ClusterView:
                views.append(build(now, attempts))
                return views[-1]

            second._view = recording  # type: ignore[method-assign]
            second.cycle()
            (victim,) = [j for j in views[0].running if j.id == str(low.id)]
            assert victim.leaving_for == str(high.id) and not victim.preemptible
            go.touch()  # now it stops, with a checkpoint (75)
            deadline = time.monotonic() + 60
            while second.store.get_job(high.id).state == JobState.QUEUED:
                assert time.monotonic() < deadline, "the high job did not start within 60 s"
                second.cycle()
                time.sleep(0.1)
            # Its GPU, once free, was shown as the high job's, and the victim went back to the
            # queue as a preemption, its stored link gone with the state.
            assert any(v.freed_for == {"local/0": Freed(str(high.id), "research")} for v in views)
            back = second.store.get_job(low.id)
            assert back.state == JobState.QUEUED and back.preemptions == 1 and back.leaving_for is None
        finally:
            for plane in planes:
                try:
                    for a in plane.store.active_attempts():
                        if a.handle:
                            plane.executor.kill(a.handle)
                except Exception:
                    pass
            planes[-1].store.close()
