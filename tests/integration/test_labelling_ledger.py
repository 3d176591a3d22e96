"""The labelling ledger, through a real control plane on SQLite and PostgreSQL: what labelling
a dataset version cost goes in once per version, against the team that paid, and `cost
report` lists it beside the GPU time; `data add --cost-per-image` puts it there itself, and
says how to do it later when no control plane answers."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from _cpkit import CP, TEAMS, cluster_config, control_plane, free_port
from _dbkit import BACKENDS, fresh_database
from _trainkit import cli

V1, V2, V3 = "a" * 64, "b" * 64, "c" * 64


@pytest.fixture(params=BACKENDS)
def cp(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CP]:
    with (
        fresh_database(request.param, tmp_path) as url,
        control_plane(url, cluster_config(teams=TEAMS), run_scheduler=False) as plane,
    ):
        yield plane


def _body(version: str, images: int = 200, cost: float = 30.0, **extra: object) -> dict[str, object]:
    return {
        "dataset_version": version,
        "dataset_path": f"/data/{version[:4]}",
        "images": images,
        "cost": cost,
        **extra,
    }


def test_a_version_is_billed_once_to_one_team_and_reported(cp: CP) -> None:
    vision = cp.team_token("vision")
    research = cp.team_token("research")
    with cp.client(vision) as c:
        r = c.post("/v1/cost/labelling", json=_body(V2, parent_version=V1))
        assert r.status_code == 201, r.text
        assert r.json()["team"] == "vision" and r.json()["parent_version"] == V1
        # The same figures again (a retried `data add`): the stored entry, not a second bill.
        again = c.post("/v1/cost/labelling", json=_body(V2, parent_version=V1))
        assert again.status_code == 200 and again.json()["recorded_at"] == r.json()["recorded_at"]
        other = c.post("/v1/cost/labelling", json=_body(V2, images=300, cost=45.0))
        assert other.status_code == 409 and "billed once" in other.json()["detail"]
        # A team token bills its own team only.
        theirs = c.post("/v1/cost/labelling", json=_body(V3, team="research"))
        assert theirs.status_code == 403
    with cp.client() as c:  # admin: names the team
        assert c.post("/v1/cost/labelling", json=_body(V3, images=10, cost=2.5)).status_code == 422
        assert c.post("/v1/cost/labelling", json=_body(V3, team="nobody")).status_code == 404
        assert (
            c.post("/v1/cost/labelling", json=_body(V3, images=10, cost=2.5, team="research")).status_code
            == 201
        )
        for bad in (
            {**_body("not-hex"), "team": "vision"},
            {**_body(V1, cost=-1.0), "team": "vision"},
            {**_body(V1, images=-5), "team": "vision"},
            {**_body(V1), "team": "vision", "extra": 1},
        ):
            r = c.post("/v1/cost/labelling", json=bad)
            assert r.status_code == 422, (bad, r.text)
        report = c.get("/v1/cost").json()
    assert [(e["dataset_version"], e["team"], e["images"], e["cost"]) for e in report["labelling"]] == [
        (V2, "vision", 200, 30.0),
        (V3, "research", 10, 2.5),
    ]
    assert report["labelling_by_team"] == {"vision": 30.0, "research": 2.5}
    assert report["labelling_total"] == pytest.approx(32.5)
    # A team sees its own.
    with cp.client(research) as c:
        mine = c.get("/v1/cost").json()
    assert [e["dataset_version"] for e in mine["labelling"]] == [V3] and mine["labelling_total"] == 2.5
    # A job's own cost is its GPU time only.
    assert cp.plane.store.labelling_costs(team="vision")[0].images == 200


def test_data_add_bills_the_new_version_and_cost_report_lists_it(
    cp: CP, tmp_path: Path, digits_dataset: Path
) -> None:
    # A folder with two of the parent's images under another class (relabels) and one new one.
    from visionloop.data.shards import ShardReader

    reader = ShardReader(digits_dataset / "shards" / "train")
    src = tmp_path / "labelled"
    for i in range(2):
        r = reader[i]
        new = str((int(r["label"]) + 1) % 10)
        (src / new).mkdir(parents=True, exist_ok=True)
        (src / new / f"r{i}.png").write_bytes(r["image"])
    env = {"VISIONLOOP_API_URL": cp.url, "VISIONLOOP_TOKEN": cp.team_token("vision"), "COLUMNS": "200"}
    made = cli(
        "data", "add", str(digits_dataset), str(src), "--out", str(tmp_path / "v2"),
        "--cost-per-image", "0.3", "-j", "1", env=env,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    version = json.loads((tmp_path / "v2" / "dataset.json").read_text())["version"]
    assert f"labelling of {version[:12]} in the cost ledger: 2 images, 0.60 (team vision)" in made.stdout
    report = cli("cost", "report", env=env)
    assert report.returncode == 0, report.stderr
    assert "labelling, by the dataset version it produced" in report.stdout and version[:12] in report.stdout
    assert "labelling total 0.60" in report.stdout
    # Recording it again is harmless; a dataset without a price is refused by name.
    again = cli("cost", "labelling", str(tmp_path / "v2"), env=env)
    assert again.returncode == 0 and "2 images, 0.60" in again.stdout
    plain = cli("cost", "labelling", str(digits_dataset), env=env)
    assert (
        plain.returncode != 0
        and "records no labelling cost" in plain.stderr
        and "Traceback" not in plain.stderr
    )

    # No control plane: the version is made and kept; the message says how to bill it later.
    shutil.rmtree(tmp_path / "v2")
    away = {**env, "VISIONLOOP_API_URL": f"http://127.0.0.1:{free_port()}"}
    made = cli(
        "data", "add", str(digits_dataset), str(src), "--out", str(tmp_path / "v2"),
        "--cost-per-image", "0.3", "-j", "1", env=away,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert (tmp_path / "v2" / "dataset.json").is_file()
    assert "not in the cost ledger" in made.stderr and "visionloop cost labelling" in made.stderr
