"""The control plane's admin routes over real HTTP on loopback: `/v1/cluster`, creating and
changing teams (`PUT /v1/admin/teams/{name}`), and a spot interruption followed by a spot
restore that a waiting job then runs on.

One control plane for the module (SQLite, its scheduler on, the local executor with one fake
spot GPU): starting one per test would cost more than the tests themselves.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import pytest

from _cpkit import CP, TEAMS, cluster_config, control_plane
from _cpkit import train_doc as _train
from _dbkit import fresh_database

SPOT_GPU = [{"node": "spot-a", "type": "fake", "count": 1, "price_class": "spot"}]


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CP]:
    home = tmp_path_factory.mktemp("admin-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VISIONLOOP_HOME", str(home))
        cfg = cluster_config(inventory=SPOT_GPU, teams=TEAMS)
        with fresh_database("sqlite", home) as url, control_plane(url, cfg) as plane:
            yield plane


def _team(data: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((t for t in data["teams"] if t["name"] == name), None)


# --------------------------------------------------------------------------- /v1/cluster


def test_cluster_shows_the_gpus_and_teams_as_stored(cp: CP) -> None:
    with cp.client() as c:
        data = c.get("/v1/cluster").json()
    with cp.client(cp.team_token("research")) as r:
        assert r.get("/v1/cluster").json() == data  # any token may read the cluster
    gpus = [{k: v for k, v in g.items() if k != "updated_at"} for g in data["gpus"]]
    assert gpus == [
        {
            "id": "spot-a/0",
            "node": "spot-a",
            "type": "fake",
            "price_class": "spot",
            "up": True,
            "down_reason": None,
        }
    ]
    for team in TEAMS:
        got = _team(data, team["name"])
        assert got is not None
        assert (got["nominal_gpus"], got["borrow_limit"], got["weight"]) == (1, 1, 1.0)
    # Exactly the store's records, field for field.
    assert data["gpus"] == [asdict(g) for g in cp.plane.store.list_gpus()]
    assert data["teams"] == [asdict(t) for t in cp.plane.store.list_teams()]
    with httpx.Client(base_url=cp.url) as anon:
        assert anon.get("/v1/cluster").status_code == 401


# --------------------------------------------------------------------------- teams


def test_put_team_creates_then_updates_its_quota(cp: CP) -> None:
    with cp.client() as c:
        r = c.put("/v1/admin/teams/newteam", json={"nominal_gpus": 3, "borrow_limit": 2, "weight": 2.5})
        assert r.status_code == 200, r.text
        created = r.json()
        assert (created["name"], created["nominal_gpus"], created["borrow_limit"], created["weight"]) == (
            "newteam",
            3,
            2,
            2.5,
        )
        assert created["created_at"] == created["updated_at"]
        assert asdict(cp.plane.store.get_team("newteam")) == created  # type: ignore[arg-type]

        # A change keeps the team (its creation time) and takes the defaults it was not given.
        r = c.put("/v1/admin/teams/newteam", json={"nominal_gpus": 5})
        assert r.status_code == 200, r.text
        changed = r.json()
        assert (changed["nominal_gpus"], changed["borrow_limit"], changed["weight"]) == (5, 0, 1.0)
        assert changed["created_at"] == created["created_at"]
        assert changed["updated_at"] >= created["updated_at"]
        assert _team(c.get("/v1/cluster").json(), "newteam") == changed

        # The new team can be given a token, which then works (and sees no jobs).
        token = c.post("/v1/admin/tokens", json={"team": "newteam"}).json()["token"]
    with cp.client(token) as t:
        assert t.get("/v1/jobs").json() == []
        assert t.put("/v1/admin/teams/newteam", json={"nominal_gpus": 50}).status_code == 403
    assert cp.plane.store.get_team("newteam").nominal_gpus == 5  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("name", "body", "words"),
    [
        ("bad name", {"nominal_gpus": 1}, "team name"),
        ("a" * 65, {"nominal_gpus": 1}, "team name"),
        ("semi;colon", {"nominal_gpus": 1}, "team name"),
        ("okname", {"nominal_gpus": -1}, "nominal_gpus"),
        ("okname", {"nominal_gpus": 1, "weight": 0}, "weight"),
        ("okname", {"borrow_limit": 1}, "nominal_gpus"),
        ("okname", {"nominal_gpus": 1, "surprise": True}, "surprise"),
    ],
)
def test_put_team_refuses_bad_names_and_quotas(cp: CP, name: str, body: dict[str, Any], words: str) -> None:
    with cp.client() as c:
        r = c.put(f"/v1/admin/teams/{name}", json=body)
    assert r.status_code == 422, r.text
    assert words in r.json()["detail"]
    assert cp.plane.store.get_team(name) is None  # nothing half-created


def test_put_team_needs_an_admin_token(cp: CP) -> None:
    with cp.client(cp.team_token("vision")) as v:
        r = v.put("/v1/admin/teams/vision", json={"nominal_gpus": 100, "borrow_limit": 100})
        assert r.status_code == 403 and "admin" in r.json()["detail"]
        assert v.put("/v1/admin/teams/sneaky", json={"nominal_gpus": 1}).status_code == 403
    with httpx.Client(base_url=cp.url) as anon:
        assert anon.put("/v1/admin/teams/sneaky", json={"nominal_gpus": 1}).status_code == 401
    vision = cp.plane.store.get_team("vision")
    assert vision is not None and (vision.nominal_gpus, vision.borrow_limit) == (1, 1)
    assert cp.plane.store.get_team("sneaky") is None


# --------------------------------------------------------------------------- spot notices


def _gpu(c: httpx.Client) -> dict[str, Any]:
    (gpu,) = c.get("/v1/cluster").json()["gpus"]
    return dict(gpu)


def test_spot_restore_brings_the_gpu_back_and_a_waiting_job_runs_on_it(
    cp: CP, digits_dataset: Path, tmp_path: Path
) -> None:
    dataset = tmp_path / "digits"
    shutil.copytree(digits_dataset, dataset)
    spec = {"train": _train(dataset, epochs=None, steps=1000), "team": "vision", "spot": "allowed"}
    with cp.client() as c:
        r = c.post("/v1/admin/spot-interrupt", json={"target": "spot-a", "reason": "test notice"})
        assert r.status_code == 200 and r.json() == {"preempting": []}  # nothing ran there
        down = _gpu(c)
        assert (down["up"], down["down_reason"]) == (False, "test notice")

        # With its only GPU down, a job waits, and says why.
        job = c.post("/v1/jobs", json={"spec": spec}).json()
    show = cp.wait_job(job["id"], lambda j: j["waiting_reason"] != "waiting for the scheduler")
    assert show["job"]["state"] == "queued" and show["attempts"] == []
    assert show["job"]["waiting_reason"].startswith("waiting for 1 GPU: 0 free"), show["job"]

    with cp.client(cp.team_token("vision")) as v:
        assert v.post("/v1/admin/spot-restore", json={"target": "spot-a"}).status_code == 403
    with cp.client() as c:
        assert _gpu(c) == down  # a team's restore changed nothing
        r = c.post("/v1/admin/spot-restore", json={"target": "nowhere"})
        assert r.status_code == 404 and "nowhere" in r.json()["detail"]
        r = c.post("/v1/admin/spot-restore", json={"target": "spot-a"})
        assert r.status_code == 200 and r.json() == {"up": ["spot-a/0"]}
        gpu = _gpu(c)
        assert (gpu["up"], gpu["down_reason"]) == (True, None)
        assert gpu["updated_at"] >= down["updated_at"]

    # Schedulable again: the waiting job is placed on exactly that GPU.
    show = cp.wait_job(job["id"], lambda j: j["state"] != "queued")
    assert show["job"]["state"] == "running", show["job"]
    (attempt,) = show["attempts"]
    assert [(a["gpu_id"], a["price_class"]) for a in attempt["allocations"]] == [("spot-a/0", "spot")]
    with cp.client() as c:
        assert c.post(f"/v1/jobs/{job['id']}/cancel").json()["state"] == "cancelling"
    show = cp.wait_job(job["id"], lambda j: j["state"] in ("cancelled", "succeeded", "failed"))
    assert show["job"]["state"] == "cancelled"
