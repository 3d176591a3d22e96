"""The control plane's endpoints for tuning trials, over real HTTP on loopback: a paused
trial is promoted (`POST /v1/jobs/{id}/resume`) or pruned (`.../prune`) by its team or an
admin only, a job in any other state is left alone or refused with 409, bad bodies get 422,
and `GET /v1/jobs/{id}/evals` returns what the job reported, so a tuner needs no access to
the control plane's disk. The scheduler is off: the store puts the job where each case needs it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _cpkit import CP, TEAMS, cluster_config, control_plane
from _cpkit import train_doc as _train
from _dbkit import fresh_database
from visionloop.sched.states import JobState
from visionloop.sched.view import Gpu


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[CP]:
    tmp = tmp_path
    cfg = cluster_config(
        inventory=[{"node": "local", "type": "fake", "count": 1, "price_class": "owned"}], teams=TEAMS
    )
    with fresh_database("sqlite", tmp) as url, control_plane(url, cfg, run_scheduler=False) as plane:
        yield plane


def _paused_trial(cp: CP, dataset: Path, number: int) -> int:
    spec = {"train": _train(dataset, epochs=3), "trial": {"study": "s", "number": number, "until_epoch": 1}}
    with cp.client() as c:
        r = c.post("/v1/jobs", json={"spec": spec, "team": "vision"})
        assert r.status_code == 201, r.text
    job_id = int(r.json()["id"])
    store = cp.plane.store
    store.start_attempt(job_id, "local", [Gpu("local/0", "local", "fake")], now=1.0)
    store.end_attempt(job_id, 1, "paused", 76, 2.0, JobState.PAUSED, "at its rung")
    return job_id


def _post(cp: CP, path: str, body: dict[str, Any], token: str | None = None) -> Any:
    with cp.client(token) as c:
        return c.post(path, json=body)


def test_a_paused_trial_is_promoted_by_its_team_only(cp: CP, digits_dataset: Path) -> None:
    job_id = _paused_trial(cp, digits_dataset, 0)
    other = _post(cp, f"/v1/jobs/{job_id}/resume", {"until_epoch": 2}, cp.team_token("research"))
    assert other.status_code == 404  # another team's job is not even visible
    bad = _post(cp, f"/v1/jobs/{job_id}/resume", {"until_epoch": 0})
    assert bad.status_code == 422 and "until_epoch" in bad.text
    stale = _post(cp, f"/v1/jobs/{job_id}/resume", {"until_epoch": 1})
    assert stale.status_code == 422 and "later epoch" in stale.json()["detail"]
    ok = _post(
        cp, f"/v1/jobs/{job_id}/resume", {"until_epoch": 2, "reason": "#1 of 3"}, cp.team_token("vision")
    )
    assert ok.status_code == 200, ok.text
    assert ok.json()["state"] == "queued"
    with cp.client() as c:
        shown = c.get(f"/v1/jobs/{job_id}").json()
    assert shown["job"]["workload_doc"]["until_epoch"] == 2
    assert shown["transitions"][-1]["reason"].endswith("goes on to epoch 2 (#1 of 3)")
    # Promoted again (a tuner repeating itself after a restart): left as it is.
    again = _post(cp, f"/v1/jobs/{job_id}/resume", {"until_epoch": 2})
    assert again.status_code == 200 and again.json()["version"] == ok.json()["version"]
    # Queued, it cannot be pruned: only a paused trial can.
    refused = _post(cp, f"/v1/jobs/{job_id}/prune", {})
    assert refused.status_code == 409 and "only a paused trial" in refused.json()["detail"]


def test_a_paused_trial_pruned_ends_for_good_and_its_run_says_so(cp: CP, digits_dataset: Path) -> None:
    job_id = _paused_trial(cp, digits_dataset, 1)
    run_dir = Path(cp.plane.store.get_job(job_id).run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.json").write_text(json.dumps({"uid": "u", "status": "paused"}))
    r = _post(cp, f"/v1/jobs/{job_id}/prune", {"reason": "never among the best"})
    assert r.status_code == 200 and r.json()["state"] == "pruned"
    assert [a.outcome for a in cp.plane.store.attempts(job_id)] == ["pruned"]
    assert _post(cp, f"/v1/jobs/{job_id}/prune", {}).json()["state"] == "pruned"  # idempotent
    assert _post(cp, f"/v1/jobs/{job_id}/resume", {"until_epoch": 2}).json()["state"] == "pruned"
    assert _post(cp, f"/v1/jobs/{job_id}/prune", {"reason": "x" * 501}).status_code == 422
    # The run is closed off the request path; it ends up marked pruned.
    import time

    deadline = time.monotonic() + 30
    while json.loads((run_dir / "run.json").read_text())["status"] != "pruned":
        assert time.monotonic() < deadline, (run_dir / "run.json").read_text()
        time.sleep(0.1)


def test_a_cancelled_paused_trial_is_cancelled_at_once(cp: CP, digits_dataset: Path) -> None:
    job_id = _paused_trial(cp, digits_dataset, 2)
    r = _post(cp, f"/v1/jobs/{job_id}/cancel", {})
    assert r.status_code == 200 and r.json()["state"] == "cancelled"


def test_evals_are_served_from_the_job_folder(cp: CP, digits_dataset: Path) -> None:
    job_id = _paused_trial(cp, digits_dataset, 3)
    with cp.client() as c:
        assert c.get(f"/v1/jobs/{job_id}/evals").json() == {"evals": []}
        folder = cp.plane.job_dir(job_id)
        folder.mkdir(parents=True, exist_ok=True)
        lines: list[dict[str, object] | str] = [
            {"attempt": 1, "step": 23, "epoch": 1.0, "metrics": {"accuracy": 0.5}},
            "torn {",
            {"attempt": 1, "step": 46, "epoch": 2.0, "metrics": {"accuracy": 0.75, "loss": 0.3}},
        ]
        (folder / "evals.jsonl").write_text(
            "".join((json.dumps(x) if isinstance(x, dict) else x) + "\n" for x in lines)
        )
        got = c.get(f"/v1/jobs/{job_id}/evals").json()["evals"]
        assert got == [
            {"step": 23, "epoch": 1.0, "metrics": {"accuracy": 0.5}},
            {"step": 46, "epoch": 2.0, "metrics": {"accuracy": 0.75, "loss": 0.3}},
        ]
        assert c.get("/v1/jobs/999999/evals").status_code == 404
    with cp.client(cp.team_token("research")) as c:
        assert c.get(f"/v1/jobs/{job_id}/evals").status_code == 404
