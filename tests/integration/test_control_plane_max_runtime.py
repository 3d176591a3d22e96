"""A job's `max_runtime` through the real control plane (store on SQLite, the local executor
with fake GPUs, the API over HTTP, the CLI): it reaches the policy's view for queued and
running jobs, and with `easy_backfill` in the cluster config a waiting job's reservation holds
its free GPU for a job whose time limit ends before it. Bad values are refused at submit,
naming the field; `jobs show` shows the limit.

The jobs are sleepers (what they run does not matter here, only that they hold their GPUs),
and the cycle is run by the test, so every decision is the one asserted."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from _cpkit import CP, cluster_config, control_plane
from _cpkit import train_doc as _train
from _dbkit import fresh_database
from _trainkit import cli
from visionloop.core.durations import format_duration
from visionloop.sched.policy import schedule
from visionloop.sched.store import Job

TWO_GPUS = [{"node": "local", "type": "fake", "count": 2, "price_class": "owned"}]
# One team entitled to more than the cluster has: every job is in the entitled pass, so the
# order between them is submission order, and what holds a GPU back is the reservation alone.
ONE_TEAM = [{"name": "vision", "nominal_gpus": 4}]


def _sleeper(job: Job) -> list[str]:
    return [sys.executable, "-c", "import time; time.sleep(600)"]


@contextmanager
def _plane(tmp_path: Path, easy: bool) -> Iterator[CP]:
    # victim_order, top_class_preempts_young, reclaim_preempts_young, quota_under_head,
    # holds_yield_to_quota and hold_freed_for_job ride along (quota_under_head off without
    # EASY; with it, off by default): no eviction here, but the switches must reach the policy.
    scheduler: dict[str, Any] = (
        {
            "easy_backfill": True,
            "victim_order": "smallest",
            "top_class_preempts_young": False,
            "reclaim_preempts_young": False,
            "holds_yield_to_quota": False,
            "hold_freed_for_job": False,
        }
        if easy
        else {"quota_under_head": False}
    )
    cfg = cluster_config(inventory=TWO_GPUS, teams=ONE_TEAM, scheduler=scheduler)
    with fresh_database("sqlite", tmp_path) as url, control_plane(url, cfg, run_scheduler=False) as plane:
        plane.plane._command = _sleeper  # type: ignore[method-assign]
        yield plane


@pytest.fixture(params=[True, False], ids=["easy-backfill", "default"])
def cp_both(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CP]:
    """The control plane with and without EASY backfill (its switches in cluster.toml)."""
    with _plane(tmp_path, request.param) as plane:
        yield plane


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[CP]:
    """The control plane with the default policy: for what does not depend on it."""
    with _plane(tmp_path, False) as plane:
        yield plane


def _submit(cp: CP, dataset: Path, gpus: int, max_runtime: str | None, name: str) -> int:
    train = {**_train(dataset), "seed": len(name)}  # the seed is not part of the history's keys
    spec = {"train": train, "name": name, "team": "vision", "resources": {"gpus": gpus}}
    if max_runtime is not None:
        spec["max_runtime"] = max_runtime
    with cp.client() as c:
        r = c.post("/v1/jobs", json={"spec": spec})
        assert r.status_code == 201, r.text
        return int(r.json()["id"])


def test_max_runtime_reaches_the_view_and_easy_backfill_holds_the_reservations_gpu_for_a_job_ending_first(
    cp_both: CP, digits_dataset: Path
) -> None:
    cp = cp_both
    plane = cp.plane
    easy = plane.policy.easy_backfill
    policy = plane.policy
    switches = (
        easy,
        policy.victim_order,
        policy.top_class_preempts_young,
        policy.reclaim_preempts_young,
        policy.quota_under_head,
        policy.holds_yield_to_quota,
        policy.hold_freed_for_job,
    )
    on = (True, "smallest", False, False, False, False, False)
    off = (False, "least_lost", True, True, False, True, True)
    assert switches == (on if plane.config.timings.easy_backfill else off)
    running = _submit(cp, digits_dataset, 1, "1h", "running")
    plane.cycle()
    assert plane.store.get_job(running).state.value == "running"
    head = _submit(cp, digits_dataset, 2, "2h", "head")  # needs both GPUs: waits for `running`
    unknown = _submit(cp, digits_dataset, 1, None, "no-limit")  # its end unknown: would delay head
    short = _submit(cp, digits_dataset, 1, "30m", "short")  # ends before head can start

    view = plane._view(plane.clock(), None)
    (active,) = view.running
    assert (active.id, active.max_runtime_s) == (str(running), 3600.0)
    assert {p.id: p.max_runtime_s for p in view.queued} == {
        str(head): 7200.0,
        str(unknown): None,
        str(short): 1800.0,
    }
    decision = schedule(view, plane.policy)
    # The head's reservation: the running job has reported no pace, so its time limit is its end.
    assert decision.starts[str(head)] == pytest.approx(active.started_at + 3600.0)
    assert sorted(decision.reserved[str(head)]) == ["local/0", "local/1"]

    plane.cycle()
    states = {j: plane.store.get_job(j).state.value for j in (head, unknown, short)}
    if easy:
        # The free GPU is held for the head, lent only to the job that ends before it starts.
        assert states == {head: "queued", unknown: "queued", short: "running"}
    else:
        # Without EASY backfill the reservation only informs: the first job that fits starts.
        assert states == {head: "queued", unknown: "running", short: "queued"}
    reason = plane.store.get_job(head).waiting_reason or ""
    assert reason.startswith("expected start "), reason


def test_bad_max_runtime_is_refused_naming_the_field_and_jobs_show_gives_it(
    cp: CP, digits_dataset: Path, tmp_path: Path
) -> None:
    train = _train(digits_dataset)
    with cp.client() as c:
        for bad in ("soon", "6", -60, "400d"):
            r = c.post("/v1/jobs", json={"spec": {"train": train, "max_runtime": bad}, "team": "vision"})
            assert r.status_code == 422, r.text
            assert "max_runtime" in r.text and "6h" in r.text, r.text
        r = c.post("/v1/jobs", json={"spec": train, "team": "vision", "max_runtime": "tomorrow"})
        assert r.status_code == 422 and "max_runtime" in r.text, r.text
        assert c.get("/v1/jobs").json() == []  # nothing was queued

    import yaml

    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump({"train": train, "team": "vision", "max_runtime": "90m"}))
    env = {"VISIONLOOP_API_URL": cp.url, "VISIONLOOP_TOKEN": cp.admin_token}
    refused = cli("submit", str(spec), "--max-runtime", "eventually", env=env)
    assert refused.returncode != 0
    assert "max_runtime" in refused.stderr and "'eventually' is not a duration" in refused.stderr, (
        refused.stderr
    )

    from_spec = cli("submit", str(spec), env=env)
    assert from_spec.returncode == 0, from_spec.stderr
    flag = cli("submit", str(spec), "--max-runtime", "6h", env=env)  # the flag overrides the spec
    assert flag.returncode == 0, flag.stderr
    jobs = [int(from_spec.stdout.strip()), int(flag.stdout.strip())]
    assert [cp.plane.store.get_job(j).max_runtime_s for j in jobs] == [5400.0, 21600.0]
    shown = cli("jobs", "show", str(jobs[0]), env=env)
    assert shown.returncode == 0, shown.stderr
    assert "max runtime: 1h 30m (planned with for reservations and backfill; not enforced)" in shown.stdout
    with cp.client() as c:
        assert c.get(f"/v1/jobs/{jobs[1]}").json()["job"]["max_runtime_s"] == 21600.0


def test_a_job_without_a_limit_is_planned_with_the_runs_of_its_spec_before_it(
    cp: CP, digits_dataset: Path, tmp_path: Path
) -> None:
    plane = cp.plane

    def command(job: Job) -> list[str]:  # "quick" and "slower" end by themselves, after 1 and 3 s
        naps = {"quick": 1, "slower": 3}
        if job.name in naps:
            return [sys.executable, "-c", f"import time; time.sleep({naps[job.name]})"]
        return _sleeper(job)

    plane._command = command  # type: ignore[method-assign]
    runs: list[float] = []
    for name in ("quick", "slower"):
        done = _submit(cp, digits_dataset, 1, None, name)
        plane.cycle()
        deadline = time.monotonic() + 60
        while plane.store.get_job(done).state.value != "succeeded":
            assert time.monotonic() < deadline, plane.store.transitions(done)
            time.sleep(0.2)
            plane.cycle()
        (attempt,) = plane.store.attempts(done)
        runs.append(attempt.ended_at - attempt.started_at)  # type: ignore[operator]
    first, ran = done, sum(runs) / 2  # the median of two

    # The same spec again (another name and seed): planned with the median of the runs, in
    # the view and in a reservation, and shown by `jobs show` with how far they ranged.
    again = _submit(cp, digits_dataset, 1, None, "again")
    other = _submit(cp, digits_dataset, 1, "2h", "limited")
    view = plane._view(plane.clock(), None)
    assert {p.id: p.expected_runtime_s for p in view.queued} == {
        str(again): pytest.approx(ran),
        str(other): pytest.approx(ran),
    }
    assert [p.max_runtime_s for p in view.queued] == [None, 7200.0]
    env = {"VISIONLOOP_API_URL": cp.url, "VISIONLOOP_TOKEN": cp.admin_token}
    for job, used in (
        (again, "planned with, as no max runtime was given"),
        (other, "the max runtime comes first"),
    ):
        shown = cli("jobs", "show", str(job), env=env)
        assert shown.returncode == 0, shown.stderr
        spread = f"they took {format_duration(min(runs))} to {format_duration(max(runs))}"
        median = format_duration(ran)
        line = f"expected runtime: {median}, the median of 2 earlier runs of this spec ({used}; {spread})"
        assert line in shown.stdout, shown.stdout
    with cp.client() as c:
        done_doc = c.get(f"/v1/jobs/{first}").json()
    assert done_doc["runtime_estimate"] is None  # it ran: a sample, not a plan
    assert done_doc["planned_end"] is None  # and it is not running

    plane.cycle()  # both start (two GPUs): the running one plans with its history too
    (active,) = [j for j in plane._view(plane.clock(), None).running if j.id == str(again)]
    assert active.expected_runtime_s == pytest.approx(ran) and active.max_runtime_s is None
    # Before its first pace report, `jobs show` gives the end planned with, and from what.
    for job, by in ((again, "its history"), (other, "its max runtime")):
        shown = cli("jobs", "show", str(job), env=env)
        (att,) = plane.store.attempts(job)
        planned = att.started_at + (ran if job == again else 7200.0)
        when = datetime.fromtimestamp(planned).strftime("%Y-%m-%d %H:%M:%S")
        line = f"progress: no pace reported yet in this attempt; planned end {when} by {by}"
        assert line in shown.stdout, shown.stdout
        # The API serves it, so that a client need not repeat the rule (limit, else history).
        with cp.client() as c:
            served = c.get(f"/v1/jobs/{job}").json()["planned_end"]
        assert served == {"at": pytest.approx(planned), "by": "history" if job == again else "max_runtime"}
