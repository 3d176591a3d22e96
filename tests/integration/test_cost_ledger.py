"""The cost ledger's arithmetic, on a ledger built by hand: every expected number below is
worked out from the allocations' times and the test catalog's prices, not by calling the
code under test.

The store-level tests run on both job stores (a fresh SQLite file and a fresh PostgreSQL
database each, see tests/_dbkit.py); the HTTP tests read the same ledger through a real
control plane's `/v1/cost` on loopback, with its `team` and `since` filters and its tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from _cpkit import CP, cluster_config, control_plane
from _dbkit import BACKENDS, fresh_database, submit_doc
from visionloop.sched.cost import CostLine, CostReport, cost_report
from visionloop.sched.prices import PriceCatalog, load_catalog, parse_catalog
from visionloop.sched.states import JobState
from visionloop.sched.store import Job, Store
from visionloop.sched.view import Gpu

H = 3600.0

# Prices chosen so that every (type, class) pair is different: a price looked up for the
# wrong type or class changes the total.
CATALOG_TOML = """
[gpus."T"]
owned = 0.5
on_demand = 4.0
spot = 1.5

[gpus."U"]
owned = 0.25
on_demand = 3.0
spot = 2.0
"""
# GPU type "Z" is deliberately absent: its hours count, at no cost, and the report says so.

OWN_T = Gpu("own/0", "own", "T", "owned")
SPOT_T = [Gpu("spot-a/0", "spot-a", "T", "spot"), Gpu("spot-a/1", "spot-a", "T", "spot")]
OD_T = [Gpu("od/0", "od", "T", "on_demand"), Gpu("od/1", "od", "T", "on_demand")]
SPOT_U = Gpu("spot-u/0", "spot-u", "U", "spot")
OWN_U = Gpu("own-u/0", "own-u", "U", "owned")
OWN_Z = Gpu("odd/0", "odd", "Z", "owned")


@dataclass
class Ledger:
    t0: float
    j1: int  # vision: 2 h on one owned T, succeeded
    j2: int  # vision: 2 spot T preempted after a checkpoint, then 2 on-demand T
    j3: int  # research: spot U interrupted twice, then running on an owned U
    j4: int  # research: 1 h on an unpriced Z
    j5: int  # vision: lost (process vanished) after a checkpoint
    j6: int  # vision: CPU only, no GPU time at all


def _submit(store: Store, team: str, gpus: int, now: float) -> Job:
    doc = {
        "name": f"{team}-{gpus}",
        "resources": {"gpus": gpus},
        "train": {"epochs": 1, "model": {"arch": "resnet18"}, "data": {"dataset": "/data/digits"}},
    }
    job: Job = submit_doc(store, doc, now=now, team=team)
    return job


_NEXT = {
    "succeeded": JobState.SUCCEEDED,
    "failed": JobState.FAILED,
    "preempted": JobState.QUEUED,
    "interrupted": JobState.QUEUED,
    "lost": JobState.QUEUED,
}


def _attempt(
    store: Store,
    job: Job,
    gpus: list[Gpu],
    start: float,
    end: float | None,
    outcome: str = "succeeded",
    checkpoints: tuple[float, ...] = (),
) -> None:
    """One attempt the way the control plane records it: started on `gpus`, checkpoints
    reported, then (unless `end` is None: still running) ended with `outcome`."""
    att = store.start_attempt(job.id, "local", gpus, now=start)
    for step, at in enumerate(checkpoints, start=1):
        store.record_checkpoint(job.id, step * 10, at, attempt=att.number)
    if end is None:
        return
    if outcome in ("preempted", "interrupted"):
        store.transition(job.id, JobState.PREEMPTING, f"{outcome} notice", expect=JobState.RUNNING, now=end)
    code = {"succeeded": 0, "failed": 1, "preempted": 75, "interrupted": 75, "lost": None}[outcome]
    store.end_attempt(job.id, att.number, outcome, code, end, _NEXT[outcome], f"test: {outcome}")


def build_ledger(store: Store, t0: float) -> Ledger:
    """The hand-built ledger (times in hours after t0):

    j1 vision   own/0 (T owned)          [0, 2]     succeeded
    j2 vision   spot-a/0,1 (T spot)      [0, 1.5]   preempted; checkpoints at 0.5 and 1
                od/0,1 (T on-demand)     [2, 3]     succeeded
    j3 research spot-u/0 (U spot)        [0, 1]     interrupted; checkpoint at 2/3 (40 min)
                spot-u/0 (U spot)        [1.25, 2]  interrupted; no checkpoint of its own
                own-u/0 (U owned)        [2.5, -)   still running
    j4 research odd/0 (Z owned, no price)[0, 1]     failed
    j5 vision   own/0 (T owned)          [2, 2.5]   lost; checkpoint at 2 h 10 min
    j6 vision   CPU only                 [3, 3.5]   succeeded
    """
    store.upsert_team("vision", 4, 2, now=t0)
    store.upsert_team("research", 2, 0, now=t0)
    j1 = _submit(store, "vision", 1, t0)
    j2 = _submit(store, "vision", 2, t0)
    j3 = _submit(store, "research", 1, t0)
    j4 = _submit(store, "research", 1, t0)
    j5 = _submit(store, "vision", 1, t0)
    j6 = _submit(store, "vision", 0, t0)
    _attempt(store, j1, [OWN_T], t0, t0 + 2 * H)
    _attempt(store, j2, SPOT_T, t0, t0 + 1.5 * H, "preempted", (t0 + 0.5 * H, t0 + 1 * H))
    _attempt(store, j2, OD_T, t0 + 2 * H, t0 + 3 * H)
    _attempt(store, j3, [SPOT_U], t0, t0 + 1 * H, "interrupted", (t0 + 2400,))
    _attempt(store, j3, [SPOT_U], t0 + 1.25 * H, t0 + 2 * H, "interrupted")
    _attempt(store, j3, [OWN_U], t0 + 2.5 * H, None)
    _attempt(store, j4, [OWN_Z], t0, t0 + 1 * H, "failed")
    _attempt(store, j5, [OWN_T], t0 + 2 * H, t0 + 2.5 * H, "lost", (t0 + 2 * H + 600,))
    _attempt(store, j6, [], t0 + 3 * H, t0 + 3.5 * H)
    return Ledger(t0, j1.id, j2.id, j3.id, j4.id, j5.id, j6.id)


def line(
    gpu_hours: float,
    cost: float,
    by_price_class: dict[str, float],
    lost_pre: float = 0.0,
    lost_int: float = 0.0,
    spot_hours: float = 0.0,
    spot_saved: float = 0.0,
) -> dict[str, Any]:
    return {
        "gpu_hours": gpu_hours,
        "cost": cost,
        "lost_gpu_hours_preemption": lost_pre,
        "lost_gpu_hours_interruption": lost_int,
        "spot_gpu_hours": spot_hours,
        "spot_saved": spot_saved,
        "by_price_class": by_price_class,
    }


# Worked out by hand from the table in build_ledger, with now = t0 + 4 h (j3's third attempt
# has run 1.5 h). Prices per GPU-hour: T 0.5/4.0/1.5, U 0.25/3.0/2.0 (owned/on-demand/spot).
J1 = line(2.0, 2.0 * 0.5, {"owned": 2.0})
J2 = line(
    3.0 + 2.0,  # 2 spot GPUs x 1.5 h, then 2 on-demand GPUs x 1 h
    3.0 * 1.5 + 2.0 * 4.0,  # = 12.5
    {"spot": 3.0, "on_demand": 2.0},
    lost_pre=2 * 0.5,  # 2 GPUs x the 0.5 h between the checkpoint at 1 h and the end at 1.5 h
    spot_hours=3.0,
    spot_saved=3.0 * (4.0 - 1.5),  # T's on-demand price minus its spot price: 7.5
)
J3 = line(
    1.0 + 0.75 + 1.5,
    1.0 * 2.0 + 0.75 * 2.0 + 1.5 * 0.25,  # = 3.875
    {"spot": 1.75, "owned": 1.5},
    # 20 min after the checkpoint at 40 min; then all 0.75 h of attempt 2, whose only
    # checkpoint (40 min) came before it started.
    lost_int=1 / 3 + 0.75,
    spot_hours=1.75,
    spot_saved=1.75 * (3.0 - 2.0),  # U's on-demand minus U's spot, not T's
)
J4 = line(1.0, 0.0, {"owned": 1.0})
J5 = line(0.5, 0.5 * 0.5, {"owned": 0.5}, lost_pre=1 / 3)  # "lost" counts with preemptions: 20 min
VISION = line(
    7.5, 13.75, {"owned": 2.5, "spot": 3.0, "on_demand": 2.0}, lost_pre=4 / 3, spot_hours=3.0, spot_saved=7.5
)
RESEARCH = line(4.25, 3.875, {"spot": 1.75, "owned": 2.5}, lost_int=13 / 12, spot_hours=1.75, spot_saved=1.75)
TOTAL = line(
    11.75,
    17.625,
    {"owned": 5.0, "spot": 4.75, "on_demand": 2.0},
    lost_pre=4 / 3,
    lost_int=13 / 12,
    spot_hours=4.75,
    spot_saved=9.25,
)
NOW_H = 4.0


def assert_line(got: CostLine | dict[str, Any], want: dict[str, Any]) -> None:
    got = asdict(got) if isinstance(got, CostLine) else got
    scalars = {k: v for k, v in want.items() if k != "by_price_class"}
    assert {k: got[k] for k in scalars} == pytest.approx(scalars, rel=1e-9, abs=1e-12)
    assert got["by_price_class"] == pytest.approx(want["by_price_class"], rel=1e-9, abs=1e-12)


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with fresh_database(request.param, tmp_path) as url:
        yield url


@pytest.fixture
def catalog() -> PriceCatalog:
    return parse_catalog(CATALOG_TOML, "test catalog")


@pytest.fixture
def ledger_store(db_url: str, tmp_path: Path) -> Iterator[tuple[Store, Ledger]]:
    store = Store.open(db_url, runs_dir=tmp_path / "runs")
    try:
        yield store, build_ledger(store, t0=1_000_000.0)
    finally:
        store.close()


# --------------------------------------------------------------------------- the store


def test_the_whole_ledger_by_job_team_and_total(
    ledger_store: tuple[Store, Ledger], catalog: PriceCatalog
) -> None:
    store, lg = ledger_store
    report = cost_report(store, catalog, now=lg.t0 + NOW_H * H)
    assert report.currency == "USD"
    assert sorted(report.by_job) == sorted([lg.j1, lg.j2, lg.j3, lg.j4, lg.j5])  # j6 held no GPU
    for job_id, want in ((lg.j1, J1), (lg.j2, J2), (lg.j3, J3), (lg.j4, J4), (lg.j5, J5)):
        assert_line(report.by_job[job_id], want)
    assert sorted(report.by_team) == ["research", "vision"]
    assert_line(report.by_team["vision"], VISION)
    assert_line(report.by_team["research"], RESEARCH)
    assert_line(report.total, TOTAL)
    assert report.unpriced == ["Z (owned)"]


def test_a_running_allocation_is_costed_up_to_now(
    ledger_store: tuple[Store, Ledger], catalog: PriceCatalog
) -> None:
    store, lg = ledger_store
    # j3's third attempt started at 2.5 h on an owned U (0.25/h); the rest of j3 is fixed.
    for now_h, running_h in ((2.5, 0.0), (3.0, 0.5), (10.5, 8.0)):
        job = cost_report(store, catalog, job_id=lg.j3, now=lg.t0 + now_h * H).by_job[lg.j3]
        assert job.gpu_hours == pytest.approx(1.75 + running_h, rel=1e-12)
        assert job.cost == pytest.approx(3.5 + running_h * 0.25, rel=1e-12)
        assert job.by_price_class == pytest.approx({"spot": 1.75, "owned": running_h}, abs=1e-12)
        # Running work is not lost work.
        assert job.lost_gpu_hours_interruption == pytest.approx(1 / 3 + 0.75, rel=1e-12)
        assert job.lost_gpu_hours_preemption == 0.0


def test_the_team_and_job_filters(ledger_store: tuple[Store, Ledger], catalog: PriceCatalog) -> None:
    store, lg = ledger_store
    now = lg.t0 + NOW_H * H
    vision = cost_report(store, catalog, team="vision", now=now)
    assert sorted(vision.by_job) == sorted([lg.j1, lg.j2, lg.j5])
    assert list(vision.by_team) == ["vision"]
    assert_line(vision.total, VISION)
    assert vision.unpriced == []  # the unpriced GPU was research's
    research = cost_report(store, catalog, team="research", now=now)
    assert sorted(research.by_job) == sorted([lg.j3, lg.j4])
    assert_line(research.total, RESEARCH)
    assert research.unpriced == ["Z (owned)"]
    only_j2 = cost_report(store, catalog, job_id=lg.j2, now=now)
    assert list(only_j2.by_job) == [lg.j2] and list(only_j2.by_team) == ["vision"]
    assert_line(only_j2.total, J2)
    assert cost_report(store, catalog, job_id=lg.j6, now=now).total == CostLine()
    assert cost_report(store, catalog, team="nobody", now=now).total == CostLine()


def test_since_counts_only_gpu_time_from_then_on(
    ledger_store: tuple[Store, Ledger], catalog: PriceCatalog
) -> None:
    """`cost report --since` is "only GPU time from this date on": an allocation that spans
    `since` counts from `since`, one that ended before it not at all."""
    store, lg = ledger_store
    now = lg.t0 + NOW_H * H
    report = cost_report(store, catalog, since=lg.t0 + 1.75 * H, now=now)
    # Kept, from 1.75 h on: j1 [1.75, 2] owned T; j2 [2, 3] 2 x on-demand T; j3 [1.75, 2]
    # spot U (interrupted, no checkpoint in it: all lost) and [2.5, 4] owned U; j5 [2, 2.5]
    # owned T (lost after its checkpoint at 2 h 10 min). j4 and j2's first attempt ended before.
    assert sorted(report.by_job) == sorted([lg.j1, lg.j2, lg.j3, lg.j5])
    assert_line(report.by_job[lg.j1], line(0.25, 0.25 * 0.5, {"owned": 0.25}))
    assert_line(report.by_job[lg.j2], line(2.0, 8.0, {"on_demand": 2.0}))
    assert_line(
        report.by_job[lg.j3],
        line(
            0.25 + 1.5,
            0.25 * 2.0 + 1.5 * 0.25,
            {"spot": 0.25, "owned": 1.5},
            lost_int=0.25,
            spot_hours=0.25,
            spot_saved=0.25 * 1.0,
        ),
    )
    assert_line(report.by_job[lg.j5], J5)
    assert_line(
        report.total,
        line(
            4.5,
            0.125 + 8.0 + 0.875 + 0.25,
            {"owned": 2.25, "on_demand": 2.0, "spot": 0.25},
            lost_pre=1 / 3,
            lost_int=0.25,
            spot_hours=0.25,
            spot_saved=0.25,
        ),
    )
    assert report.unpriced == []
    # Later still: only j2's second attempt (from 2.75 h: 2 GPUs x 0.25 h) and j3's running one.
    late = cost_report(store, catalog, team="vision", since=lg.t0 + 2.75 * H, now=now)
    assert list(late.by_job) == [lg.j2]
    assert_line(late.total, line(0.5, 2.0, {"on_demand": 0.5}))


def test_the_shipped_catalog_prices_the_fake_and_a100_types(db_url: str, tmp_path: Path) -> None:
    """The default catalog's numbers, end to end: 1.5 h on a spot A100 preempted 0.5 h after
    its checkpoint, then 1 h on-demand, and 3 h on an owned fake GPU."""
    store = Store.open(db_url, runs_dir=tmp_path / "runs")
    try:
        t0 = 5_000.0
        store.upsert_team("vision", 2, now=t0)
        a = _submit(store, "vision", 1, t0)
        b = _submit(store, "vision", 1, t0)
        a100_spot = Gpu("c/0", "c", "A100-80GB", "spot")
        _attempt(store, a, [a100_spot], t0, t0 + 1.5 * H, "preempted", (t0 + 1 * H,))
        _attempt(store, a, [Gpu("c/1", "c", "A100-80GB", "on_demand")], t0 + 2 * H, t0 + 3 * H)
        _attempt(store, b, [Gpu("local/0", "local", "fake", "owned")], t0, t0 + 3 * H)
        report: CostReport = cost_report(store, load_catalog(None), now=t0 + 10 * H)
    finally:
        store.close()
    # A100-80GB: owned 0.95, on-demand 3.43, spot 1.65; fake: owned 0.5.
    assert_line(
        report.by_job[a.id],
        line(
            2.5,
            1.5 * 1.65 + 1.0 * 3.43,
            {"spot": 1.5, "on_demand": 1.0},
            lost_pre=0.5,
            spot_hours=1.5,
            spot_saved=1.5 * (3.43 - 1.65),
        ),
    )
    assert_line(report.by_job[b.id], line(3.0, 1.5, {"owned": 3.0}))
    assert report.total.cost == pytest.approx(1.5 * 1.65 + 3.43 + 1.5, rel=1e-12)


# --------------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def http_ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CP, Ledger]]:
    """One real control plane for the module (SQLite; the store's part is the calls tested
    above on both backends), its scheduler off so nothing touches the hand-built attempts,
    priced by the test catalog through the cluster config's `prices`."""
    home = tmp_path_factory.mktemp("cost-home")
    prices = home / "prices.toml"
    prices.write_text(CATALOG_TOML)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VISIONLOOP_HOME", str(home))
        cfg = cluster_config(
            prices=str(prices),
            inventory=[{"node": "own", "type": "T", "count": 1, "price_class": "owned"}],
            teams=[{"name": "vision", "nominal_gpus": 4}, {"name": "research", "nominal_gpus": 2}],
        )
        with fresh_database("sqlite", home) as url, control_plane(url, cfg, run_scheduler=False) as cp:
            # Hours in the past, so that "now" (the server's clock) lies after every end.
            lg = build_ledger(cp.plane.store, t0=time.time() - 6 * H)
            yield cp, lg


def _running_hours(lg: Ledger, before: float, after: float) -> tuple[float, float]:
    """j3's running attempt (from 2.5 h) as of a request sent between `before` and `after`."""
    start = lg.t0 + 2.5 * H
    return (before - start) / H, (after - start) / H


def test_cost_endpoint_matches_the_hand_worked_ledger(http_ledger: tuple[CP, Ledger]) -> None:
    cp, lg = http_ledger
    with cp.client() as c:
        before = time.time()
        r = c.get("/v1/cost")
        after = time.time()
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["currency"] == "USD" and data["unpriced"] == ["Z (owned)"]
    assert sorted(data["by_job"]) == sorted(str(j) for j in (lg.j1, lg.j2, lg.j3, lg.j4, lg.j5))
    for job_id, want in ((lg.j1, J1), (lg.j2, J2), (lg.j5, J5), (lg.j4, J4)):
        assert_line(data["by_job"][str(job_id)], want)
    assert_line(data["by_team"]["vision"], VISION)
    # research and the total include j3's running attempt, costed up to the server's "now":
    # the same arithmetic as above with its running hours somewhere in [lo, hi].
    lo, hi = _running_hours(lg, before, after)
    research = data["by_team"]["research"]
    running = research["by_price_class"]["owned"] - 1.0  # j4's 1 h on Z is owned too
    assert lo - 1e-6 <= running <= hi + 1e-6
    fixed_research = {**RESEARCH, "by_price_class": {"spot": 1.75, "owned": 1.0 + running}}
    fixed_research["gpu_hours"] = 2.75 + running
    fixed_research["cost"] = 3.5 + 0.25 * running
    assert_line(research, fixed_research)
    assert data["total"]["gpu_hours"] == pytest.approx(7.5 + 2.75 + running, rel=1e-9)
    assert data["total"]["cost"] == pytest.approx(13.75 + 3.5 + 0.25 * running, rel=1e-9)
    assert data["total"]["spot_saved"] == pytest.approx(9.25, rel=1e-9)


def test_cost_endpoint_team_and_since_filters(http_ledger: tuple[CP, Ledger]) -> None:
    cp, lg = http_ledger
    with cp.client() as c:
        vision = c.get("/v1/cost", params={"team": "vision"}).json()
        since = c.get("/v1/cost", params={"team": "vision", "since": lg.t0 + 1.75 * H}).json()
        late = c.get("/v1/cost", params={"team": "vision", "since": lg.t0 + 2.75 * H}).json()
        nobody = c.get("/v1/cost", params={"team": "nobody"}).json()
    assert list(vision["by_team"]) == ["vision"]
    assert sorted(vision["by_job"]) == sorted(str(j) for j in (lg.j1, lg.j2, lg.j5))
    assert_line(vision["total"], VISION)
    assert vision["unpriced"] == []
    # From 1.75 h: j1's last 0.25 h, j2's on-demand hour (2 GPUs) and all of j5.
    assert sorted(since["by_job"]) == sorted(str(j) for j in (lg.j1, lg.j2, lg.j5))
    assert_line(
        since["total"], line(2.75, 0.125 + 8.0 + 0.25, {"owned": 0.75, "on_demand": 2.0}, lost_pre=1 / 3)
    )
    assert list(late["by_job"]) == [str(lg.j2)]
    assert_line(late["total"], line(0.5, 2.0, {"on_demand": 0.5}))
    assert nobody["by_job"] == {} and nobody["total"]["gpu_hours"] == 0.0


def test_a_team_token_sees_its_own_teams_cost_only(http_ledger: tuple[CP, Ledger]) -> None:
    cp, _ = http_ledger
    with cp.client(cp.team_token("vision")) as v:
        mine = v.get("/v1/cost").json()
        named = v.get("/v1/cost", params={"team": "vision"}).json()
        other = v.get("/v1/cost", params={"team": "research"})
    assert list(mine["by_team"]) == ["vision"] and mine["unpriced"] == []
    assert_line(mine["total"], VISION)
    assert named == mine
    assert other.status_code == 403 and "vision" in other.json()["detail"]
    with cp.client() as c:
        assert c.get("/v1/cost", params={"since": "yesterday"}).status_code == 422
