"""How much one team may queue (`[jobs] max_queued_per_team`), over real HTTP on loopback and
through `visionloop submit` as a user runs it: past the limit a submission is a 429 with
Retry-After, naming the count, the limit and what to do; nothing is queued; other teams, and a
retry of a job already queued, are unaffected."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from _cpkit import CP, TEAMS, cluster_config, control_plane, train_doc
from _dbkit import fresh_database
from _trainkit import cli

GPUS = [{"node": "local", "type": "fake", "count": 1, "price_class": "owned"}]


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CP]:
    tmp = tmp_path_factory.mktemp("queue-limit")
    roots = [str(tmp_path_factory.getbasetemp())]  # the tests' datasets live under it
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VISIONLOOP_HOME", str(tmp / "home"))
        cfg = cluster_config(
            inventory=GPUS, teams=TEAMS, jobs={"allowed_roots": roots, "max_queued_per_team": 2}
        )
        assert cfg.max_queued_per_team == 2
        # No scheduler: every job stays queued, so the count is exact.
        with fresh_database("sqlite", tmp) as url, control_plane(url, cfg, run_scheduler=False) as plane:
            yield plane


def test_past_the_limit_a_submit_is_a_429_and_nothing_is_queued(
    cp: CP, digits_dataset: Path, tmp_path: Path
) -> None:
    dataset = tmp_path / "digits"
    shutil.copytree(digits_dataset, dataset)
    spec = {"train": train_doc(dataset)}
    vision, research = cp.team_token("vision"), cp.team_token("research")
    with cp.client(vision) as c:
        first = c.post("/v1/jobs", json={"spec": spec, "idempotency_key": "first"})
        assert first.status_code == 201, first.text
        assert c.post("/v1/jobs", json={"spec": spec}).status_code == 201
        r = c.post("/v1/jobs", json={"spec": spec})
        assert r.status_code == 429, r.text
        assert r.headers["Retry-After"] == "30"
        assert r.json()["detail"] == (
            "team 'vision' already has 2 jobs waiting, the most a team may have queued ([jobs] "
            "max_queued_per_team = 2 in cluster.toml); nothing was submitted. Submit again once some "
            "have started, or cancel some with `visionloop jobs cancel ID`."
        )
        again = c.post("/v1/jobs", json={"spec": spec, "idempotency_key": "first"})
        assert again.status_code in (200, 201) and again.json()["id"] == first.json()["id"]
        assert len(c.get("/v1/jobs").json()) == 2
    with cp.client(research) as c:
        assert c.post("/v1/jobs", json={"spec": spec}).status_code == 201  # another team's queue

    # As a user sees it: the message, exit 2, no traceback; then room after a cancel.
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "VISIONLOOP_API_URL": cp.url, "VISIONLOOP_TOKEN": vision, "COLUMNS": "250"}
    r2 = cli("submit", str(path), env=env)
    assert r2.returncode == 2, (r2.stdout, r2.stderr)
    assert "Traceback" not in r2.stderr
    said = " ".join(r2.stderr.split())
    assert "team 'vision' already has 2 jobs waiting" in said and "visionloop jobs cancel ID" in said
    done = cli("jobs", "cancel", str(first.json()["id"]), env=env)
    assert done.returncode == 0, done.stderr
    assert cli("submit", str(path), env=env).returncode == 0
