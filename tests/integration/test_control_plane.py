"""The control plane end to end over real HTTP on loopback: the store, the scheduler, the
local executor with fake GPUs, and the real trainer on the digits dataset."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from _cpkit import CP, TEAMS, cluster_config, control_plane
from _cpkit import train_doc as _train
from _dbkit import BACKENDS, fresh_database
from visionloop.sched.view import ClusterView, Freed

ONE_GPU = [{"node": "local", "type": "fake", "count": 1, "price_class": "owned"}]


def _states(show: dict[str, Any]) -> list[str]:
    return [t["to_state"] for t in show["transitions"]]


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Every test here runs on both job stores: SQLite and a real PostgreSQL server."""
    with fresh_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture
def cp(db_url: str) -> Iterator[CP]:
    cfg = cluster_config(inventory=ONE_GPU, teams=TEAMS)
    with control_plane(db_url, cfg) as plane:
        yield plane


@pytest.fixture
def sqlite_cp(tmp_path: Path) -> Iterator[CP]:
    """For the long scenarios: the store's part in them is the same calls the tests above
    already run on both backends, so they run once (the CI machine has two cores)."""
    cfg = cluster_config(inventory=ONE_GPU, teams=TEAMS)
    with fresh_database("sqlite", tmp_path) as url, control_plane(url, cfg) as plane:
        yield plane


# ------------------------------------------------------------------ auth and bad input


def test_every_route_needs_a_valid_token(cp: CP) -> None:
    with httpx.Client(base_url=cp.url) as anon:
        assert anon.get("/v1/jobs").status_code == 401
        r = anon.get("/v1/jobs", headers={"Authorization": "Bearer not-a-token"})
        assert r.status_code == 401 and "unknown or revoked" in r.json()["detail"]
        r = anon.post("/v1/jobs", json={"spec": {}}, headers={"Authorization": "Basic abc"})
        assert r.status_code == 401 and "bearer" in r.json()["detail"].lower()
        assert anon.get("/v1/health").json()["status"] == "ok"


def test_teams_see_and_act_on_their_own_jobs_only(cp: CP, digits_dataset: Path) -> None:
    vision, research = cp.team_token("vision"), cp.team_token("research")
    with cp.client(vision) as v, cp.client(research) as r:
        job = v.post(
            "/v1/jobs", json={"spec": _train(digits_dataset, steps=2, epochs=None), "gpus": 0}
        ).json()
        assert job["team"] == "vision"
        assert r.get(f"/v1/jobs/{job['id']}").status_code == 404  # same answer as a missing job
        assert r.post(f"/v1/jobs/{job['id']}/cancel").status_code == 404
        assert [j["id"] for j in r.get("/v1/jobs").json()] == []
        assert [j["id"] for j in v.get("/v1/jobs").json()] == [job["id"]]
        forbidden = r.post("/v1/jobs", json={"spec": _train(digits_dataset), "team": "vision"})
        assert forbidden.status_code == 403 and "research" in forbidden.json()["detail"]
        assert r.post("/v1/admin/tokens", json={"team": "research"}).status_code == 403
        assert v.post(f"/v1/jobs/{job['id']}/cancel").json()["state"] in ("cancelled", "cancelling")


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"spec": {"data": {"dataset": "/x"}}}, 422, "model"),
        ({"spec": {"train": {"model": {"arch": "resnet18"}}, "resources": {"gpus": -1}}}, 422, "gpus"),
        ({"spec": "not a mapping"}, 422, "spec"),
        ({"spec": {}, "surprise": 1}, 422, "surprise"),
        ({"spec": {}, "spot": "sometimes"}, 422, "spot"),
    ],
)
def test_malformed_submissions_get_a_4xx_naming_the_problem(
    cp: CP, body: dict[str, Any], status: int, words: str
) -> None:
    with cp.client() as c:
        r = c.post("/v1/jobs", json=body)
    assert r.status_code == status, r.text
    assert words in r.json()["detail"]
    with cp.client() as c:
        assert c.get("/v1/jobs").json() == []  # nothing half-created


def test_impossible_and_unknown_requests_are_refused_at_submit(cp: CP, digits_dataset: Path) -> None:
    spec = _train(digits_dataset)
    with cp.client() as c:
        r = c.post("/v1/jobs", json={"spec": spec, "gpus": 8, "team": "vision"})
        assert r.status_code == 422 and "largest machine has 1" in r.json()["detail"]
        r = c.post("/v1/jobs", json={"spec": spec, "team": "nobody"})
        assert r.status_code == 404 and "unknown team 'nobody'" in r.json()["detail"]
        r = c.post("/v1/jobs", json={"spec": spec, "team": "vision", "priority": "urgent"})
        assert r.status_code == 422 and "unknown priority class 'urgent'" in r.json()["detail"]
        missing = _train(digits_dataset.parent / "nope")
        r = c.post("/v1/jobs", json={"spec": missing, "team": "vision"})
        assert r.status_code == 422 and "not a dataset folder" in r.json()["detail"]
        relative = _train(Path("digits"))
        r = c.post("/v1/jobs", json={"spec": relative, "team": "vision"})
        assert r.status_code == 422 and "relative" in r.json()["detail"]
        r = c.post("/v1/jobs", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "the body is not valid JSON" in r.json()["detail"]
        r = c.post("/v1/jobs", content=b"x" * (2 * 1024 * 1024), headers={"Content-Type": "application/json"})
        assert r.status_code == 413
        assert c.get("/v1/jobs/999").status_code == 404
        assert c.get("/v1/jobs/abc").status_code == 422
        assert c.get("/v1/jobs").json() == []


# ------------------------------------------------------------------ concurrency


def test_500_submissions_from_20_clients_land_exactly_once(db_url: str, digits_dataset: Path) -> None:
    cfg = cluster_config(inventory=ONE_GPU, teams=TEAMS)
    with control_plane(db_url, cfg, run_scheduler=False) as cp:
        spec = _train(digits_dataset)

        def client_work(k: int) -> list[int]:
            ids = []
            with cp.client() as c:
                for i in range(25):
                    key = f"client{k}-job{i}"
                    body = {"spec": spec, "team": "vision", "idempotency_key": key}
                    first = c.post("/v1/jobs", json=body)
                    assert first.status_code == 201, first.text
                    # A client that lost the answer sends again: the same job comes back.
                    again = c.post("/v1/jobs", json=body)
                    assert again.json()["id"] == first.json()["id"]
                    ids.append(int(first.json()["id"]))
            return ids

        with concurrent.futures.ThreadPoolExecutor(20) as pool:
            ids = [i for part in pool.map(client_work, range(20)) for i in part]
        assert len(ids) == 500 and len(set(ids)) == 500
        with cp.client() as c:
            listed = c.get("/v1/jobs", params={"limit": 1000}).json()
        assert sorted(j["id"] for j in listed) == sorted(ids)
        assert {j["state"] for j in listed} == {"queued"}


# ------------------------------------------------------------------ the life of a job


def test_a_job_runs_to_success_with_history_logs_and_cost(cp: CP, digits_dataset: Path) -> None:
    with cp.client() as c:
        job = c.post("/v1/jobs", json={"spec": _train(digits_dataset, epochs=1), "team": "vision"}).json()
    show = cp.wait_job(job["id"], lambda j: j["state"] in ("succeeded", "failed"))
    assert show["job"]["state"] == "succeeded", show
    assert _states(show) == ["queued", "running", "succeeded"]
    (attempt,) = show["attempts"]
    assert attempt["outcome"] == "succeeded" and attempt["exit_code"] == 0
    assert [a["gpu_id"] for a in attempt["allocations"]] == ["local/0"]
    assert (Path(show["job"]["run_dir"]) / "final.safetensors").is_file()
    assert show["cost"]["total"]["gpu_hours"] > 0
    assert show["cost"]["by_team"]["vision"]["gpu_hours"] == show["cost"]["total"]["gpu_hours"]
    with cp.client() as c:
        log = c.get(f"/v1/jobs/{job['id']}/logs").text
        part = c.get(f"/v1/jobs/{job['id']}/logs", params={"offset": 10})
    assert "val" in log.lower()
    assert part.text == log[10:] and int(part.headers["X-Next-Offset"]) == len(log.encode())


def test_a_higher_priority_job_preempts_through_a_checkpoint_and_the_victim_resumes(
    sqlite_cp: CP, digits_dataset: Path
) -> None:
    cp = sqlite_cp
    # What the policy is shown each cycle (recorded, not changed): who the victim steps aside
    # for, and the GPU it frees for that job once it has left.
    views: list[ClusterView] = []
    build = cp.plane._view

    def recording(now: float, attempts: Any) -> ClusterView:
        views.append(build(now, attempts))
        return views[-1]

    cp.plane._view = recording  # type: ignore[method-assign]
    low_spec = _train(digits_dataset, epochs=None, steps=60)
    with cp.client() as c:
        low = c.post("/v1/jobs", json={"spec": low_spec, "team": "research", "priority": "low"}).json()
        # Wait until the victim has written a checkpoint, so it has work to keep.
        cp.wait_job(low["id"], lambda j: j["state"] == "running" and j["last_checkpoint_at"] is not None)
        high = c.post(
            "/v1/jobs", json={"spec": _train(digits_dataset, epochs=1), "team": "vision", "priority": "high"}
        ).json()
    high_show = cp.wait_job(high["id"], lambda j: j["state"] in ("succeeded", "failed"), timeout=300)
    assert high_show["job"]["state"] == "succeeded"
    low_show = cp.wait_job(low["id"], lambda j: j["state"] in ("succeeded", "failed"), timeout=300)
    job = low_show["job"]
    assert job["state"] == "succeeded" and job["preemptions"] == 1 and job["restarts"] == 0
    assert _states(low_show) == ["queued", "running", "preempting", "queued", "running", "succeeded"]
    first, second = low_show["attempts"]
    assert first["outcome"] == "preempted" and first["exit_code"] == 75
    assert second["outcome"] == "succeeded"
    preempting = low_show["transitions"][2]
    assert f"job {high['id']}" in preempting["reason"]
    # It resumed: the second attempt's log says so, and the run finished its 60 steps once.
    with cp.client() as c:
        second_log = c.get(f"/v1/jobs/{low['id']}/logs", params={"attempt": 2}).text
    assert "resuming from" in second_log
    # The checkpoints came from the trainer's progress lines, attempt by attempt; the one the
    # victim stopped on (written just before it exited 75) is the one the second attempt
    # resumed from.
    m = re.search(r"resuming from step-(\d+)\.ckpt", second_log)
    assert m is not None, second_log
    ckpts = cp.plane.store.checkpoints(low["id"])
    first_steps = [c.step for c in ckpts if c.attempt == 1]
    assert first_steps and first_steps[-1] == int(m.group(1)), (ckpts, m.group(0))
    assert {c.attempt for c in ckpts} == {1, 2} and len({c.step for c in ckpts}) == len(ckpts)
    # The victim was shown leaving for the high job, and its GPU, once free, as that job's.
    victim, winner = str(low["id"]), str(high["id"])
    assert any(j.id == victim and j.leaving_for == winner for v in views for j in v.running)
    assert any(v.freed_for == {"local/0": Freed(winner, "research")} for v in views), [
        v.freed_for for v in views
    ]
    assert all(not v.freed_for for v in views[-3:])  # for one cycle only
    # Every job it runs checkpoints when asked to stop, and the policy is told so while it
    # waits too (what lets it start as a tenant on GPUs held for another job).
    waiting = [j for v in views for j in v.queued if j.id == winner]
    assert waiting and all(j.checkpoints_at_stop for j in waiting)
    assert all(j.checkpoints_at_stop for v in views for j in v.running)


def test_failures_are_retried_with_backoff_then_fail_with_the_log(
    sqlite_cp: CP, digits_dataset: Path, tmp_path: Path
) -> None:
    cp = sqlite_cp
    import shutil

    dataset = tmp_path / "ds"
    shutil.copytree(digits_dataset, dataset)
    spec = {"train": _train(dataset, epochs=1), "max_restarts": 1, "team": "vision"}
    with cp.client() as c:
        job = c.post("/v1/jobs", json={"spec": spec}).json()
    shutil.rmtree(dataset)  # the job can no longer start: a real failure, not a preemption
    show = cp.wait_job(job["id"], lambda j: j["state"] in ("succeeded", "failed"))
    assert show["job"]["state"] == "failed" and show["job"]["restarts"] == 1
    assert [a["outcome"] for a in show["attempts"]] == ["failed", "failed"]
    retry = show["transitions"][2]
    assert retry["to_state"] == "queued" and "retry 1 of 1" in retry["reason"]
    final = show["transitions"][-1]["reason"]
    assert "no restarts left" in final and "Last log lines" in final and "dataset" in final


def test_cancel_a_queued_and_a_running_job(sqlite_cp: CP, digits_dataset: Path) -> None:
    cp = sqlite_cp
    spec = _train(digits_dataset, epochs=None, steps=1000, tracked=True)
    with cp.client() as c:
        running = c.post("/v1/jobs", json={"spec": spec, "team": "vision"}).json()
        # Once it has checkpointed, the trainer is past start-up and handles SIGTERM itself.
        cp.wait_job(running["id"], lambda j: j["state"] == "running" and j["last_checkpoint_at"] is not None)
        queued = c.post("/v1/jobs", json={"spec": spec, "team": "vision"}).json()
        assert c.post(f"/v1/jobs/{queued['id']}/cancel").json()["state"] == "cancelled"
        assert c.post(f"/v1/jobs/{running['id']}/cancel").json()["state"] == "cancelling"
    show = cp.wait_job(running["id"], lambda j: j["state"] == "cancelled")
    assert show["attempts"][0]["outcome"] == "cancelled" and show["attempts"][0]["exit_code"] == 75
    assert _states(show) == ["queued", "running", "cancelling", "cancelled"]
    # The trainer stopped after a checkpoint ("preempted", resumable); the job will not resume
    # it, so the run says cancelled, in run.json and in MLflow.
    from visionloop.track import store as track_store

    meta_file = Path(show["job"]["run_dir"]) / "run.json"
    deadline = time.monotonic() + 30
    while json.loads(meta_file.read_text())["status"] != "cancelled":
        assert time.monotonic() < deadline, meta_file.read_text()
        time.sleep(0.1)
    client = track_store.client(cp.plane.settings)
    run_id = json.loads(meta_file.read_text())["mlflow_run_id"]
    while client.get_run(run_id).data.tags["visionloop.state"] != "cancelled":  # written after run.json
        assert time.monotonic() < deadline, client.get_run(run_id).data.tags
        time.sleep(0.1)
    assert client.get_run(run_id).info.status == "KILLED"


def test_a_sigkilled_trainer_has_its_run_closed_when_the_job_fails(
    sqlite_cp: CP, digits_dataset: Path
) -> None:
    from visionloop.track import store as track_store

    cp = sqlite_cp

    with cp.client() as c:
        spec = {
            "train": _train(digits_dataset, epochs=None, steps=5000, tracked=True),
            "team": "vision",
            "max_restarts": 0,
        }
        r = c.post("/v1/jobs", json={"spec": spec})
        assert r.status_code == 201, r.text
        job = int(r.json()["id"])
    # Past start-up: the MLflow run is open and run.json says "running".
    show = cp.wait_job(job, lambda j: j["state"] == "running" and j["last_checkpoint_at"] is not None)
    run_dir = Path(show["job"]["run_dir"])
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "running"
    client = track_store.client(cp.plane.settings)
    assert client.get_run(meta["mlflow_run_id"]).info.status == "RUNNING"

    (attempt,) = show["attempts"]
    shim = json.loads((Path(attempt["handle"]["attempt_dir"]) / "shim.json").read_text())
    os.kill(shim["child_pid"], signal.SIGKILL)  # the OOM killer: no handler runs
    show = cp.wait_job(job, lambda j: j["state"] == "failed", timeout=120)
    assert show["attempts"][0]["exit_code"] == 128 + signal.SIGKILL

    # The trainer could not write its ending; the control plane did, in both places.
    deadline = time.monotonic() + 30
    while json.loads((run_dir / "run.json").read_text())["status"] == "running":
        assert time.monotonic() < deadline, "run.json still says running"
        time.sleep(0.1)
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "failed" and f"job {job} failed: exit 137" in meta["error"]
    while client.get_run(meta["mlflow_run_id"]).info.status == "RUNNING":
        assert time.monotonic() < deadline, "the MLflow run is still RUNNING"
        time.sleep(0.1)
    run = client.get_run(meta["mlflow_run_id"])
    assert run.info.status == "FAILED" and run.data.tags["visionloop.state"] == "failed"
    assert run.info.end_time is not None
