"""The scheduler simulator: traces, spot traces, the event loop (arrivals, completions,
preemptions with grace and checkpoint loss, spot interruptions) and the metrics, on small
synthetic traces whose results are checked by hand."""

from __future__ import annotations

import json
import random
from collections import Counter
from functools import partial
from pathlib import Path

import pytest

from visionloop.core.errors import DataError
from visionloop.sched.policy import PolicyConfig, fifo, schedule
from visionloop.sched.prices import load_catalog
from visionloop.sched.sim import (
    ClusterSpec,
    NodeSpec,
    SimConfig,
    SimError,
    TraceJob,
    default_cluster,
    entitlement_teams,
    load_spot_trace,
    load_trace,
    simulate,
    spot_trace,
    summarize,
)
from visionloop.sched.sim.quota import waiting_in_quota
from visionloop.sched.view import (
    ActiveJob,
    ClusterView,
    Decision,
    Eviction,
    Freed,
    PendingJob,
    Placement,
    Team,
)

VL = partial(schedule, config=PolicyConfig(same_node=False))
FIFO = partial(fifo, same_node=False)


def job(id: str, t: float, gpus: int, dur: float, prio: str = "normal", spot: str = "allowed") -> TraceJob:
    return TraceJob(id, t, gpus, dur, "a", prio, spot)  # type: ignore[arg-type]


def jct(result: object, id: str) -> float | None:
    return next(j.jct for j in result.jobs if j.id == id)  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- traces


def test_load_trace(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text(
        "job_id,submit_time,gpus,duration_s,team,priority,spot\n"
        "b,20,2,60,research,high,never\n"
        "a,10,1,30,detection,normal,preferred\n"
    )
    jobs = load_trace(p)
    assert [j.id for j in jobs] == ["a", "b"]
    assert jobs[1] == TraceJob("b", 20.0, 2, 60.0, "research", "high", "never")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("job_id,submit_time,gpus\nx,1,1\n", "lacks column(s) duration_s, team, priority, spot"),
        ("job_id,submit_time,gpus,duration_s,team,priority,spot\nx,1,zero,5,a,low,never\n", "line 2"),
        ("job_id,submit_time,gpus,duration_s,team,priority,spot\nx,1,1,5,a,low,sometimes\n", "spot must be"),
        ("job_id,submit_time,gpus,duration_s,team,priority,spot\nx,1,0,5,a,low,never\n", "gpus must be >= 1"),
    ],
)
def test_load_trace_errors(tmp_path: Path, text: str, expected: str) -> None:
    p = tmp_path / "t.csv"
    p.write_text(text)
    with pytest.raises(DataError, match="job trace") as e:
        load_trace(p)
    assert expected in str(e.value)


def test_spot_trace_runs_offset_and_wrap(tmp_path: Path) -> None:
    tr = spot_trace("t", [1, 1, 0, 0, 1, 1], gap_s=100)  # up 0-200, down 200-400, up 400-600, repeats
    assert [tr.up_at(t) for t in (0, 199, 200, 399, 400, 599, 600, 850)] == [1, 1, 0, 0, 1, 1, 1, 0]
    assert tr.next_change(0) == 200 and tr.next_change(200) == 400 and tr.next_change(450) == 800
    assert tr.uptime(0, 1200) == 800
    shifted = spot_trace("t", [1, 1, 0, 0, 1, 1], gap_s=100, offset_s=150)
    assert shifted.up_at(0) and not shifted.up_at(60) and shifted.next_change(0) == 50
    assert spot_trace("flat", [1, 1], 10).next_change(5) == float("inf")
    p = tmp_path / "z.json"
    p.write_text(json.dumps({"metadata": {"gap_seconds": 60}, "data": [0, 2, 1]}))
    loaded = load_spot_trace(p, offset_s=60)
    assert loaded.name == "z" and loaded.up_at(0) and loaded.next_change(0) == 120
    p.write_text("{}")
    with pytest.raises(DataError, match="is not"):
        load_spot_trace(p)


def test_default_cluster_and_teams() -> None:
    c = default_cluster()
    assert c.total_gpus == 64 and len(c.nodes) == 8
    assert [n.price_class for n in c.nodes].count("spot") == 2
    assert sum(n.gpus for n in c.nodes if n.price_class == "owned") == 32
    assert {t.name: (t.nominal_gpus, t.borrow_limit, t.weight) for t in c.teams} == {
        "detection": (32, 32, 0.5),
        "segmentation": (19, 45, 0.3),
        "research": (13, 51, 0.2),
    }
    assert sum(t.nominal_gpus for t in entitlement_teams(10)) == 10


# --------------------------------------------------------------------------- hand-checked runs


def four_gpus() -> ClusterSpec:
    return ClusterSpec((NodeSpec("n0", 4, "fake"),))


def test_backfill_against_fifo_by_hand() -> None:
    trace = [job("A", 0, 2, 100), job("B", 1, 4, 50), job("C", 2, 1, 30)]
    f = simulate(trace, four_gpus(), FIFO)
    v = simulate(trace, four_gpus(), VL)
    # FIFO: A 0-100, B waits for A: 100-150, C waits behind B: 150-180.
    assert [jct(f, i) for i in "ABC"] == [100, 149, 178]
    # visionloop: C backfills at once (2-32); B still starts when A ends.
    assert [jct(v, i) for i in "ABC"] == [100, 149, 30]
    fm, vm = summarize(f, four_gpus(), load_catalog()), summarize(v, four_gpus(), load_catalog())
    assert fm["avg_jct_s"] == pytest.approx(427 / 3) and vm["avg_jct_s"] == pytest.approx(93)
    assert fm["makespan_s"] == 180 and vm["makespan_s"] == 150
    assert vm["by_size"]["1"] == {"jobs": 1, "avg_jct_s": 30, "avg_queue_s": 0, "max_queue_s": 0}
    assert vm["by_size"][">8"]["jobs"] == 0 and vm["by_size"]["2-4"]["max_queue_s"] == 99
    # busy GPU-seconds: 2*100 + 4*50 + 1*30 over 4 GPUs * 150 s
    assert vm["utilisation"] == pytest.approx(430 / 600)
    assert vm["cost_usd"] == pytest.approx(430 / 3600 * 0.5)  # "fake" owned: 0.5 USD/GPU-h


def test_preemption_grace_and_checkpoint_loss_by_hand() -> None:
    cluster = ClusterSpec((NodeSpec("n0", 2, "fake"),))
    trace = [job("L", 0, 2, 10_000, prio="low"), job("H", 1000, 2, 100, prio="high")]
    r = simulate(trace, cluster, VL)
    recs = {j.id: j for j in r.jobs}
    # L is evicted at 1000 (ran 1000 s > 600 s), checkpointed at 600 s of progress; after
    # its 60 s grace H runs 1060-1160; L restarts at 1160, pays 60 s overhead, 9,400 s left.
    assert recs["H"].jct == 160 and recs["H"].queued_s == 60
    assert recs["L"].finish == 1160 + 60 + 9400 and recs["L"].preemptions == 1 and recs["L"].queued_s == 100
    # lost: 2 GPUs * (1060 s held - 600 s kept) + 2 * 60 s restart overhead
    assert r.lost_gpu_s == {"preempted": 2 * 460 + 2 * 60, "interrupted": 0.0}
    assert r.useful_gpu_s == 2 * 10_000 + 2 * 100
    f = simulate(trace, cluster, FIFO)
    assert jct(f, "H") == 10_000 + 100 - 1000  # FIFO waits for L to finish


def test_spot_interruption_requeues_and_prices_by_hand() -> None:
    spot = spot_trace("s", [1, 1, 0] + [1] * 17, gap_s=500)  # down 1000-1500
    cluster = ClusterSpec((NodeSpec("own", 1, "fake"), NodeSpec("s", 2, "fake", "spot", spot)))
    r = simulate([job("S", 0, 2, 2000, spot="preferred")], cluster, VL)
    rec = r.jobs[0]
    # on spot at 0; interrupted at 1000 (checkpoint at 600); back at 1500: 60 s + 1,400 s.
    assert rec.finish == 1500 + 60 + 1400 and rec.interruptions == 1 and rec.preemptions == 0
    assert r.lost_gpu_s["interrupted"] == 2 * 460 + 2 * 60
    m = summarize(r, cluster, load_catalog())
    assert m["spot_gpu_h"] == pytest.approx((2 * 1060 + 2 * 1460) / 3600)
    assert m["cost_usd"] == pytest.approx(m["spot_gpu_h"] * 1.0)
    assert m["spot_savings_usd"] == pytest.approx(m["spot_gpu_h"] * (2.0 - 1.0))
    # available: 1 owned GPU all along, 2 spot GPUs except 500 s
    assert m["utilisation"] == pytest.approx(5040 / (2960 + 2 * 2460))
    assert m["fleet_cost_usd"] == pytest.approx((2960 * 0.5 + 2 * 2460 * 1.0) / 3600)


def test_team_shares_against_entitlement() -> None:
    cluster = ClusterSpec((NodeSpec("n0", 4, "fake"),), (Team("a", 3, 1), Team("b", 1, 3)))
    trace = [TraceJob("x", 0, 3, 100, "a", "normal"), TraceJob("y", 0, 1, 100, "b", "normal")]
    m = summarize(simulate(trace, cluster, VL), cluster, load_catalog())
    assert m["teams"]["a"] == {
        "gpu_h": pytest.approx(300 / 3600),
        "share": 0.75,
        "share_contended": None,  # b never waited
        "entitlement": 0.75,
    }
    assert m["teams"]["b"]["share"] == 0.25


def test_share_under_contention_follows_entitlement() -> None:
    # Both teams keep 4 one-GPU jobs of 100 s queued; a is entitled to 3 of 4 GPUs.
    cluster = ClusterSpec((NodeSpec("n0", 4, "fake"),), (Team("a", 3, 1), Team("b", 1, 3)))
    trace = [TraceJob(f"{t}{i}", 0, 1, 100, t, "normal") for t in "ab" for i in range(4)]
    r = simulate(trace, cluster, VL)
    m = summarize(r, cluster, load_catalog())
    # 0-100: a runs 3, b 1 (both wait); 100-200: a's last job and 3 of b's, nobody waits.
    assert m["contended_h"] == pytest.approx(100 / 3600)
    assert m["teams"]["a"]["share_contended"] == 0.75 and m["teams"]["b"]["share_contended"] == 0.25


# --------------------------------------------------------------------------- guard rails


def test_bad_decisions_raise_sim_error() -> None:
    trace = [job("A", 0, 1, 10), job("B", 0, 1, 10)]

    def double_book(view: ClusterView) -> Decision:
        return Decision(placements=[Placement(j.id, ("n0/0",)) for j in view.queued])

    with pytest.raises(SimError, match="busy, down or wrong count"):
        simulate(trace, four_gpus(), double_book)
    with pytest.raises(SimError, match="neither placed nor given a reason"):
        simulate(trace, four_gpus(), lambda view: Decision())
    with pytest.raises(SimError, match="priority class"):
        simulate([job("A", 0, 1, 10, prio="urgent")], four_gpus(), VL)


def test_impossible_job_ends_the_run_as_unfinished() -> None:
    r = simulate([job("A", 0, 1, 10), job("huge", 0, 9, 10)], four_gpus(), VL)
    assert r.unfinished == ["huge"] and jct(r, "A") == 10


def test_random_trace_completes_under_both_policies() -> None:
    rng = random.Random(7)
    cluster = default_cluster(gpus_per_node=2)  # 16 GPUs, 4 of them spot (never interrupted)
    trace = [
        TraceJob(
            f"j{i}",
            rng.uniform(0, 3600),
            rng.choice([1, 1, 2, 4, 6]),
            rng.uniform(60, 4000),
            rng.choice(["detection", "segmentation", "research"]),
            rng.choice(["low", "normal", "normal", "high"]),
            rng.choice(["never", "allowed", "preferred"]),
        )
        for i in range(30)
    ]
    for policy in (VL, FIFO):
        r = simulate(trace, cluster, policy)
        assert r.unfinished == [] and all(j.finish is not None for j in r.jobs)
        assert r.useful_gpu_s == pytest.approx(sum(j.gpus * j.duration_s for j in trace))


# Seed 101 once had a job evicted 50 times for one that never started: the GPUs it freed were
# held for an earlier reservation, and it backfilled back onto them (preemption._victim_gpus).
# Seeds 161 and 287 had the starvation guard start its job ahead of a higher class, which
# evicted it again at once, 9 and 14 times (cycle.py: it goes first within its class).
# Seed 270, with SIGTERM checkpoints (young borrowers reclaimed), had two teams' starving
# jobs take turns: each was the guard's choice while the other waited (cycle.py: one behind
# its team's head no longer reclaims). Seed 63, without the guard: a job behind its head
# reclaimed a GPU that a job aged into the class it follows took straight back, 7 times
# (cycle.py: with none of its team's jobs left in that class, it goes first).
@pytest.mark.parametrize("seed", [3, 17, 29, 41, 43, 63, 90, 101, 123, 126, 161, 162, 270, 283, 287])
@pytest.mark.parametrize(
    ("easy", "tenants", "limit", "srpt", "under", "sigterm", "guard"),
    [
        (False, False, None, False, False, False, True),
        (True, False, 2.0, False, False, False, True),
        (True, True, None, False, False, False, True),
        (True, True, 1.5, False, False, False, True),
        (False, False, 2.0, True, False, False, True),
        (True, False, 1.0, True, False, False, True),
        # quota_under_head: in the entitled pass, reclaiming from the class it follows, or
        # right after the head, its jobs thrashed in 121, 17 and 2 of 1,800 runs of this fuzz.
        (False, False, None, False, True, False, True),
        (False, False, 2.0, True, True, False, True),
        # Jobs that checkpoint at SIGTERM: young borrowers are reclaimed (the default).
        (False, False, None, False, False, True, True),
        (False, False, None, False, True, True, True),
        # Without the starvation guard (the default), which reorders a class: a job behind its
        # head then also reclaims borrowers of the class it follows (preemption._after_head).
        (False, False, None, False, True, False, False),
        (False, False, None, False, True, True, False),
    ],
)
def test_no_livelock_on_random_clusters_and_configs(
    seed: int,
    easy: bool,
    tenants: bool,
    limit: float | None,
    srpt: bool,
    under: bool,
    sigterm: bool,
    guard: bool,
) -> None:
    """Whatever the quotas and knobs, every job that can run finishes, and no job is
    preempted without end (found: borrowers and reclaimers taking GPUs back and forth).
    With reservations holding GPUs (EASY backfill, tenants) the simulator checks every
    decision too: a GPU promised twice would be placed twice and raise SimError."""
    rng = random.Random(seed)
    spot = spot_trace("s", [rng.choice([1, 1, 1, 0]) for _ in range(50)], gap_s=600)
    teams = (
        Team("detection", rng.randint(0, 6), rng.randint(0, 12), 0.5),
        Team("research", rng.randint(0, 6), rng.randint(0, 12), 0.2),
    )
    cluster = ClusterSpec(
        (
            NodeSpec("a", 4, "fake"),
            NodeSpec("b", 4, "fake", "on_demand"),
            NodeSpec("s", 4, "fake", "spot", spot),
        ),
        teams,
    )
    trace = [
        TraceJob(
            f"j{i}",
            rng.uniform(0, 7200),
            rng.choice([1, 1, 2, 3, 4, 6, 8]),
            rng.uniform(60, 6000),
            rng.choice(["detection", "research", "other"]),
            rng.choice(["low", "normal", "high"]),
            rng.choice(["never", "allowed", "preferred"]),
        )
        for i in range(30)
    ]
    cfg = PolicyConfig(
        same_node=False,
        min_runtime_s=rng.choice([0, 300]),
        max_evictions_per_cycle=rng.randint(1, 4),
        aging_s=1800.0,
        reserve_after_s=3600.0 if guard else None,
        easy_backfill=easy,
        reservation_tenants=tenants,
        order="srpt" if srpt else "las",
        srpt_preemption=srpt,
        quota_under_head=under,
    )
    sim = SimConfig(max_time_s=10 * 86400, time_limit=limit, time_limit_share=0.5, sigterm_checkpoint=sigterm)
    evicted_for: Counter[tuple[str, str | None]] = Counter()

    def policy(view: ClusterView) -> Decision:
        decision = schedule(view, cfg)
        evicted_for.update((e.job_id, e.for_job) for e in decision.evictions)
        return decision

    r = simulate(trace, cluster, policy, sim)
    limits = {t.name: t.nominal_gpus + t.borrow_limit for t in teams}
    never_fits = {j.id for j in trace if j.team in limits and j.gpus > limits[j.team]}
    never_fits |= {j.id for j in trace if j.spot == "never" and j.gpus > 8}
    assert set(r.unfinished) == never_fits
    assert max(j.preemptions for j in r.jobs) < 50
    if not easy:
        # A job evicted again and again for the same job means that job did not start on
        # what it freed (EASY's holds still allow it: a tenant steps aside each time a
        # reservation falls due).
        assert max(evicted_for.values(), default=0) <= 5, evicted_for.most_common(3)


def test_command_line_runs_a_trace_from_a_data_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from visionloop.sched.sim.__main__ import main
    from visionloop.sched.sim.cluster import DEFAULT_SPOT_TRACES

    (tmp_path / "sched" / "traces").mkdir(parents=True)
    (tmp_path / "sched" / "traces" / "trace-1.csv").write_text(
        "job_id,submit_time,gpus,duration_s,team,priority,spot\n"
        "a,0,8,600,detection,normal,allowed\nb,30,2,300,research,high,never\n"
    )
    for rel, _ in DEFAULT_SPOT_TRACES:
        (tmp_path / "spot" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "spot" / rel).write_text(
            json.dumps({"metadata": {"gap_seconds": 3600}, "data": [1] * 100})
        )
    assert main(["--trace", "1", "--data", str(tmp_path), "--json"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["finished"] == 2 and metrics["avg_jct_s"] == pytest.approx((600 + 300) / 2)
    assert main(["--trace", "1", "--data", str(tmp_path / "missing")]) == 1
    assert "pass --data DIR" in capsys.readouterr().err


def test_the_28_hour_class_jump_in_miniature() -> None:
    """Issue 16's case: a high-class job waited 28 h while its own team's lower classes kept
    starting. Here team a runs a stream of short low jobs (one every 2 min, 8 min each, so
    always too young to preempt) for 10 h; its 8-GPU high job arrives after 1 h. It must start
    once a's running jobs drain (minutes), not when the stream ends (it waited 9.1 h)."""
    hour = 3600.0
    trace = [TraceJob(f"low{i}", i * 120.0, 1, 480.0, "a", "low", "allowed") for i in range(300)]
    trace.append(TraceJob("big", hour, 8, hour, "a", "high", "allowed"))
    cluster = ClusterSpec((NodeSpec("n0", 8),), (Team("a", 6, 2), Team("b", 2, 6)))
    result = simulate(trace, cluster, VL, SimConfig())
    big = next(j for j in result.jobs if j.id == "big")
    assert big.queued_s <= 480.0 + 60.0  # the longest low job left, and one cycle
    assert all(j.finish is not None for j in result.jobs)  # and the stream still runs to its end


def test_the_policy_sees_expected_ends_from_the_pace_with_an_error_never_the_true_duration() -> None:
    """A running job's expected end appears once it has reported its pace (60 s into an
    allocation), off by its allocation's pace error; with no error it is the true end."""
    seen: dict[float, list[float | None]] = {}

    def watching(view: ClusterView) -> Decision:
        if view.running:
            seen.setdefault(view.now, []).extend(v.expected_end for v in view.running)
        return VL(view)

    # b waits for a's GPU: of a lower class, it may not preempt a.
    trace = [job("a", 0, 1, 3600.0), job("b", 0, 1, 3600.0, prio="low")]
    cluster = ClusterSpec((NodeSpec("n0", 1),))
    simulate(trace, cluster, watching, SimConfig(pace_error=0.0, tick_s=30.0))
    early = [e for t, ends in seen.items() if t < 60.0 for e in ends]
    assert early and all(e is None for e in early)  # nothing reported yet
    late = [(t, e) for t, ends in seen.items() if 60.0 <= t < 3600.0 for e in ends]
    assert late and all(e == 3600.0 for _, e in late)  # exact pace: the true end

    def ends(seed: int) -> list[float]:
        seen.clear()
        simulate(trace, cluster, watching, SimConfig(pace_error=0.2, tick_s=30.0, seed=seed))
        return [e for t, es in sorted(seen.items()) if 60.0 <= t < 3600.0 for e in es if e is not None]

    first = ends(0)
    assert first == ends(0) and first != ends(1)  # seeded
    # One error per allocation: the remaining time is off by the same factor all along.
    factors = {round((e - t) / (3600.0 - t), 9) for (t, _), e in zip(late, first, strict=True)}
    assert len(factors) == 1 and factors != {1.0} and 0.3 < factors.pop() < 3.0


def test_an_eviction_is_wasted_when_the_job_it_was_for_does_not_start_soon_after() -> None:
    # high arrives at 1,500 s and preempts low, then starts after the 60 s grace: not wasted.
    trace = [job("low", 0, 1, 3600.0, prio="low"), job("high", 1500.0, 1, 100.0, prio="high")]
    one_gpu = ClusterSpec((NodeSpec("n0", 1),))
    r = simulate(trace, one_gpu, VL, SimConfig(tick_s=30.0))
    assert (r.named_evictions, r.wasted_evictions) == (1, 0)
    assert (summarize(r, one_gpu, load_catalog(None))["wasted_evictions"]) == 0

    # A scheduler that evicts a for b, then gives the GPU back to a: b starts only when a
    # ends, long after the grace period. Wasted.
    evicted: list[float] = []

    def fickle(view: ClusterView) -> Decision:
        d = Decision()
        queued = [j.id for j in view.queued]
        held = {g for r in view.running for g in r.gpu_ids}
        free = [g.id for g in view.gpus if g.id not in held]
        if not evicted and "b" in queued and [r.id for r in view.running] == ["a"]:
            evicted.append(view.now)
            d.evictions.append(Eviction("a", "for b", for_job="b"))
        for jid in sorted(queued):  # a first: it takes its GPU back
            if free:
                d.placements.append(Placement(jid, (free.pop(),)))
            else:
                d.waiting[jid] = "waiting for a GPU"
        return d

    trace = [job("a", 0, 1, 3600.0), job("b", 600.0, 1, 100.0)]
    r = simulate(trace, one_gpu, fickle, SimConfig(tick_s=30.0))
    b = next(j for j in r.jobs if j.id == "b")
    assert evicted and b.first_start is not None and b.first_start > evicted[0] + 60 + 300
    assert (r.named_evictions, r.wasted_evictions) == (1, 1)


@pytest.mark.parametrize(("sigterm", "kept"), [(False, 1200.0), (True, 1500.0)])
def test_a_victim_keeps_its_last_periodic_checkpoint_or_all_its_progress_when_it_checkpoints_at_sigterm(
    sigterm: bool, kept: float
) -> None:
    # low runs from 0; high arrives at 1,500 s and preempts it (low is past min_runtime_s).
    # Periodic checkpoints every 600 s keep 1,200 s of progress; a checkpoint at SIGTERM keeps
    # all 1,500. Grace 60 s, high runs 1,560-1,660, low restarts with 60 s of overhead.
    trace = [job("low", 0, 1, 3600.0, prio="low"), job("high", 1500.0, 1, 100.0, prio="high")]
    cfg = SimConfig(sigterm_checkpoint=sigterm, tick_s=30.0)
    result = simulate(trace, ClusterSpec((NodeSpec("n0", 1),)), VL, cfg)
    low = next(j for j in result.jobs if j.id == "low")
    assert low.preemptions == 1
    assert low.finish == pytest.approx(1660.0 + 60.0 + (3600.0 - kept))
    # GPU-seconds that produced nothing kept: the grace (and the unsaved work) plus the restart.
    assert result.lost_gpu_s["preempted"] == pytest.approx((1560.0 - kept) + 60.0)


def test_quota_guarantee_hours_count_a_fitting_job_kept_waiting() -> None:
    # Team a is entitled to 2 GPUs and holds 1 (A2). Under FIFO, b's 3-GPU job A holds the rest
    # until 100. a's 2-GPU job C (at 10) does not fit in a's unused quota of 1, so its wait does
    # not count; a's 1-GPU job B (at 20, behind C) does fit, and waits 80 s. Over-quota jobs
    # (A: 3 GPUs against b's nominal 2) are reported apart.
    teams = (Team("a", 2, 2), Team("b", 2, 2))
    cluster = ClusterSpec((NodeSpec("n0", 4, "fake"),), teams)
    trace = [
        TraceJob("A", 0, 3, 100, "b", "normal", "allowed"),
        TraceJob("A2", 0, 1, 200, "a", "normal", "allowed"),
        TraceJob("C", 10, 2, 50, "a", "normal", "allowed"),
        TraceJob("B", 20, 1, 50, "a", "normal", "allowed"),
    ]
    r = simulate(trace, cluster, FIFO)
    assert r.quota_wait_s == {"a": 80.0}
    # One stretch of 80 s: within a cycle (60 s) plus the grace period (60 s).
    assert r.quota_wait_longest_s == {"a": 80.0} and r.quota_wait_late == 0
    s = summarize(r, cluster, load_catalog())
    assert s["quota_wait_h"] == {"a": pytest.approx(80 / 3600)}
    assert s["quota_wait_longest_s"] == {"a": 80.0} and s["quota_wait_late"] == 0
    assert s["over_quota"] == {"jobs": 1, "avg_jct_s": 100.0, "avg_queue_s": 0.0, "max_queue_s": 0.0}
    # A holding on to 300 s keeps B waiting 280 s: longer than the guarantee allows.
    trace[0] = TraceJob("A", 0, 3, 300, "b", "normal", "allowed")
    r = simulate(trace, cluster, FIFO)
    assert r.quota_wait_longest_s == {"a": 280.0} and r.quota_wait_late == 1
    # ...and one a policy could have kept: b lent out 1 GPU beyond its nominal 2, which B fits.
    assert r.quota_wait_late_reclaimable == 1 and r.quota_wait_longest_reclaimable_s == {"a": 280.0}


def test_quota_guarantee_job_by_job_tells_a_chain_of_jobs_served_in_time_from_one_kept_waiting() -> None:
    # Team a is entitled to 3 GPUs and holds 1 (A0); b holds the other 4 (2 beyond its
    # nominal): B1 until 100, B2 until 200. Under FIFO a's X (at 5) starts at 100, a's Y (at
    # 90) at 200: a had a fitting job waiting for 195 s, a late stretch, but each job waited
    # less than the guarantee allows (95 s and 110 s).
    teams = (Team("a", 3, 2), Team("b", 2, 3))
    cluster = ClusterSpec((NodeSpec("n0", 5, "fake"),), teams)
    trace = [
        TraceJob("A0", 0, 1, 1000, "a", "normal", "allowed"),
        TraceJob("B1", 0, 1, 100, "b", "normal", "allowed"),
        TraceJob("B2", 0, 3, 200, "b", "normal", "allowed"),
        TraceJob("X", 5, 1, 1000, "a", "normal", "allowed"),
        TraceJob("Y", 90, 1, 50, "a", "normal", "allowed"),
    ]
    r = simulate(trace, cluster, FIFO)
    assert r.quota_wait_longest_reclaimable_s == {"a": 195.0} and r.quota_wait_late_reclaimable == 1
    assert (r.quota_jobs_late, r.quota_jobs_late_short, r.quota_job_longest_s) == (0, 0, 110.0)
    # Y submitted with X waits 195 s itself: late job by job too.
    trace[4] = TraceJob("Y", 5, 1, 50, "a", "normal", "allowed")
    r = simulate(trace, cluster, FIFO)
    assert (r.quota_jobs_late, r.quota_job_longest_s) == (1, 195.0)
    assert summarize(r, cluster, load_catalog())["quota_jobs_late"] == 1


def test_quota_stretches_begun_with_gpus_down_are_told_apart() -> None:
    # The quotas (2 + 2) add up to the 4 GPUs, but the spot node's 2 are down until 600 s. b's
    # B holds the other 2 until 300; a's A (never on spot) fits in a's unused quota and waits
    # 290 s: late, and begun while fewer GPUs were up than the quotas promise.
    spot = spot_trace("s", [0, 1, 1, 1], gap_s=600)
    cluster = ClusterSpec(
        (NodeSpec("n0", 2, "fake"), NodeSpec("s", 2, "fake", "spot", spot)),
        (Team("a", 2, 2), Team("b", 2, 2)),
    )
    trace = [
        TraceJob("B", 0, 2, 300, "b", "normal", "never"),
        TraceJob("A", 10, 1, 50, "a", "normal", "never"),
    ]
    r = simulate(trace, cluster, FIFO)
    assert r.quota_wait_longest_s == {"a": 290.0}
    assert r.quota_wait_late == 1 and r.quota_wait_late_short == 1
    # No policy could have kept it: b holds only its nominal, and nothing is free.
    assert r.quota_wait_late_reclaimable == 0 and r.quota_wait_longest_reclaimable_s == {}
    # With the spot node up, the free GPUs are spot ones, which A never uses: late with every
    # GPU up, yet still not a policy's failure.
    up = ClusterSpec((NodeSpec("n0", 2, "fake"), NodeSpec("s", 2, "fake", "spot")), cluster.teams)
    r = simulate(trace, up, FIFO)
    assert r.quota_wait_late == 1 and r.quota_wait_late_short == 0
    assert r.quota_wait_late_reclaimable == 0
    # A job that may run on spot runs on it at once: no stretch at all.
    trace[1] = TraceJob("A", 10, 1, 50, "a", "normal", "allowed")
    r = simulate(trace, up, FIFO)
    assert r.quota_wait_late == 0 and r.quota_wait_late_short == 0 and r.quota_wait_longest_s == {}


def test_stretches_a_policy_could_have_kept_are_told_apart_when_begun_short_of_gpus() -> None:
    # The quotas (2 + 2) add up to 4 GPUs; only 3 are up until 600 s. b's B holds all 3 (1
    # beyond its nominal) until 300; a's A fits in a's quota and waits 290 s: late, a policy
    # could have reclaimed b's lent GPU, and it began short of GPUs (giving a its quota then
    # may leave b below its own).
    spot = spot_trace("s", [0, 1, 1, 1], gap_s=600)
    teams = (Team("a", 2, 2), Team("b", 2, 2))
    trace = [
        TraceJob("B", 0, 3, 300, "b", "normal", "never"),
        TraceJob("A", 10, 1, 50, "a", "normal", "never"),
    ]
    short = ClusterSpec((NodeSpec("n0", 3, "fake"), NodeSpec("s", 1, "fake", "spot", spot)), teams)
    r = simulate(trace, short, FIFO)
    assert (r.quota_wait_late_reclaimable, r.quota_wait_late_reclaimable_short) == (1, 1)
    assert summarize(r, short, load_catalog())["quota_wait_late_reclaimable_short"] == 1
    # The spot node up from the start: the same stretch, not begun short.
    up = ClusterSpec((NodeSpec("n0", 3, "fake"), NodeSpec("s", 1, "fake", "spot")), teams)
    r = simulate(trace, up, FIFO)
    assert (r.quota_wait_late_reclaimable, r.quota_wait_late_reclaimable_short) == (1, 0)


@pytest.mark.parametrize("sigterm", [True, False])
def test_a_victim_is_shown_leaving_for_its_job_and_its_gpus_freed_for_it_once_checkpointed(
    sigterm: bool,
) -> None:
    # b borrows a's 2 GPUs with B; a's A comes at 100 and reclaims them. B is shown leaving
    # for A through its grace period; once gone, its GPUs are shown freed for A for one
    # cycle, if it wrote a checkpoint at SIGTERM (else any job may take them first).
    teams = (Team("a", 2, 0), Team("b", 0, 2))
    cluster = ClusterSpec((NodeSpec("n0", 2, "fake"),), teams)
    trace = [
        TraceJob("B", 0, 2, 3600, "b", "normal", "allowed"),
        TraceJob("A", 100, 2, 100, "a", "normal", "allowed"),
    ]
    views: list[ClusterView] = []
    cfg = PolicyConfig(same_node=False, min_runtime_s=0)

    def policy(view: ClusterView) -> Decision:
        views.append(view)
        return schedule(view, cfg)

    r = simulate(trace, cluster, policy, SimConfig(sigterm_checkpoint=sigterm, tick_s=30.0))
    leaving = {(v.now, j.id, j.leaving_for) for v in views for j in v.running if j.leaving_for}
    assert leaving == {(130.0, "B", "A")}  # the cycle in its grace period
    freed = [(v.now, dict(v.freed_for)) for v in views if v.freed_for]
    b_gpus = {g.id for g in views[0].gpus}
    assert freed == ([(160.0, dict.fromkeys(sorted(b_gpus), Freed("A", "b")))] if sigterm else [])
    a = next(j for j in r.jobs if j.id == "A")
    assert a.first_start == 160.0


def test_what_a_policy_could_give_counts_free_and_lent_gpus_of_a_kind_the_job_accepts() -> None:
    teams = {"a": Team("a", 4), "b": Team("b", 2)}
    # b holds 4 (2 beyond its nominal), 1 on a fixed GPU and 3 on spot; 1 GPU is free.
    held = {"b": (1, 3)}
    assert waiting_in_quota([("a", 4, "allowed")], held, (1, 0), teams) == ({"a"}, set())  # fits, not there
    assert waiting_in_quota([("a", 3, "allowed")], held, (1, 0), teams)[1] == {"a"}  # 1 + 2 lent
    assert waiting_in_quota([("a", 4, "allowed")], held, (1, 0), teams)[1] == set()
    assert waiting_in_quota([("a", 2, "never")], held, (1, 0), teams)[1] == {"a"}  # the fixed one
    assert waiting_in_quota([("a", 3, "never")], held, (1, 0), teams)[1] == set()
    # A job that does not fit in its team's unused quota is not the guarantee's business.
    assert waiting_in_quota([("a", 3, "allowed")], {**held, "a": (2, 0)}, (1, 0), teams) == (set(), set())
    # Another of the team's jobs may still fit.
    assert waiting_in_quota([("a", 5, "allowed"), ("a", 1, "never")], held, (0, 0), teams)[1] == {"a"}


@pytest.mark.parametrize("history", [True, False], ids=["history", "no-history"])
def test_history_plans_a_job_with_the_runs_of_its_application_and_gpu_count_before_it(history: bool) -> None:
    """With SimConfig.history, a job is planned with the median time that the finished jobs of
    its application (the id's prefix) on as many GPUs held their GPUs; never its own duration
    (5,000 s here, where the two before it ran 600 and 1,000 s)."""
    seen: dict[str, set[float | None]] = {}

    def watching(view: ClusterView) -> Decision:
        jobs: list[ActiveJob | PendingJob] = [*view.queued, *view.running]
        for j in jobs:
            seen.setdefault(j.id, set()).add(j.expected_runtime_s)
        return VL(view)

    trace = [
        job("cifar10-0", 0, 1, 600.0),
        job("cifar10-1", 0, 1, 1000.0),
        job("cifar10-2", 5000.0, 1, 5000.0),  # after both finished: their median
        job("cifar10-3", 5000.0, 2, 300.0),  # two GPUs: another key, nothing ran
        job("resnet-4", 5000.0, 1, 300.0),  # another application
    ]
    result = simulate(
        trace, ClusterSpec((NodeSpec("n0", 4),)), watching, SimConfig(tick_s=30.0, history=history)
    )
    held = {j.id: j.finish - j.first_start for j in result.jobs if j.id in ("cifar10-0", "cifar10-1")}  # type: ignore[operator]
    assert seen["cifar10-0"] == seen["cifar10-1"] == {None}  # nothing finished before them
    assert seen["cifar10-3"] == seen["resnet-4"] == {None}
    if history:
        (planned,) = seen["cifar10-2"]
        assert planned == pytest.approx((held["cifar10-0"] + held["cifar10-1"]) / 2)
    else:
        assert seen["cifar10-2"] == {None}
