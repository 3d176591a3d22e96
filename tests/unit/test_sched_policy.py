"""The queue policy: priorities, quotas and borrowing, fair share, preemption and victim
choice, reservations, spot placement, packing, reasons for waiting, and the FIFO baseline."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from visionloop.core.errors import ConfigError
from visionloop.sched.policy import Order, PolicyConfig, fifo, schedule
from visionloop.sched.view import (
    ActiveJob,
    ClusterView,
    Decision,
    Freed,
    Gpu,
    Node,
    PendingJob,
    Placement,
    PriceClass,
    SpotPolicy,
    Team,
    remaining_gpu_s,
)

LOW, NORMAL, HIGH = 10, 50, 100
NOW = 100_000.0


def node_gpus(node: str, n: int, cls: PriceClass = "owned", up: bool = True, typ: str = "fake") -> list[Gpu]:
    return [Gpu(f"{node}/{i}", node, typ, cls, up) for i in range(n)]


def q(
    id: str,
    gpus: int = 1,
    team: str = "a",
    prio: int = NORMAL,
    t: float = 0.0,
    spot: SpotPolicy = "allowed",
    **kw: float | None,
) -> PendingJob:
    return PendingJob(id, team, prio, gpus, submitted_at=t, spot=spot, **kw)  # type: ignore[arg-type]


def r(
    id: str,
    gpu_ids: Sequence[str],
    team: str = "a",
    prio: int = NORMAL,
    started: float = NOW - 3600,
    ckpt: float | None = None,
    preemptible: bool = True,
    submitted: float | None = None,
    limit: float | None = None,
    attained: float = 0.0,
    ckpt_at_stop: bool = False,
) -> ActiveJob:
    return ActiveJob(
        id,
        team,
        prio,
        tuple(gpu_ids),
        started,
        last_checkpoint_at=ckpt,
        preemptible=preemptible,
        submitted_at=submitted,
        max_runtime_s=limit,
        attained_gpu_s=attained,
        checkpoints_at_stop=ckpt_at_stop,
    )


def view(
    gpus: Sequence[Gpu],
    queued: Sequence[PendingJob] = (),
    running: Sequence[ActiveJob] = (),
    teams: Sequence[Team] = (),
    now: float = NOW,
    nodes: dict[str, Node] | None = None,
) -> ClusterView:
    return ClusterView(now, list(gpus), {t.name: t for t in teams}, list(running), list(queued), nodes or {})


def placed(d: Decision) -> dict[str, tuple[str, ...]]:
    return {p.job_id: p.gpu_ids for p in d.placements}


CFG = PolicyConfig(aging_s=None)  # aging off unless a test is about it


# --------------------------------------------------------------------------- priorities, quotas


def test_higher_priority_first_and_lower_waits_with_reason() -> None:
    d = schedule(view(node_gpus("n0", 2), [q("low", 2, prio=LOW, t=1), q("high", 2, prio=HIGH, t=5)]), CFG)
    assert placed(d) == {"high": ("n0/0", "n0/1")}
    assert d.waiting == {
        "low": "waiting for 2 GPUs: 0 free; 2 GPUs reserved for it as job high end; its start is not "
        "known until job high reports its pace"
    }


def test_blocked_higher_priority_job_is_named_in_reasons_behind_it() -> None:
    running = [r("busy", ["n0/0", "n0/1"], prio=HIGH)]  # nothing can be preempted
    d = schedule(view(node_gpus("n0", 4), [q("big", 4, prio=HIGH), q("mid", 4, prio=NORMAL)], running), CFG)
    assert d.placements == [] and d.evictions == []
    assert d.waiting["big"].startswith("waiting for 4 GPUs: 2 free")
    assert "behind 1 higher-priority job" in d.waiting["mid"]


def test_quota_limit_nominal_plus_borrow() -> None:
    teams = [Team("a", nominal_gpus=2, borrow_limit=1)]
    d = schedule(view(node_gpus("n0", 8), [q(f"j{i}", t=i) for i in range(4)], teams=teams), CFG)
    assert set(placed(d)) == {"j0", "j1", "j2"}
    assert d.waiting["j3"] == (
        "waiting for 1 GPU: team a is at its limit 3 = nominal 2 + borrow 1 (3 in use or reserved)"
    )


def test_a_victims_gpus_leave_its_teams_quota_when_it_is_evicted() -> None:
    # Team b (limit 2) holds 2 GPUs with a low job; its normal job needs 1 more and evicts
    # it, taking one of the victim's GPUs. The victim's GPUs leave b's quota at once (as
    # they would a cycle later while it checkpoints), so b's next low job starts on the free
    # GPU: b holds 3 during the grace period and 2 once the victim has gone. (hypothesis
    # found the case; the invariant below counts quota the same way.)
    teams = [Team("a", 0), Team("b", 0, borrow_limit=2)]
    gpus = [g for n in range(3) for g in node_gpus(f"n{n}", 1)] + node_gpus("n3", 2)
    running = [
        r("r0", ["n0/0", "n1/0"], team="b", prio=LOW, started=NOW - 700),
        r("r1", ["n2/0", "n3/0"], team="a", prio=LOW, started=NOW - 10),
    ]
    queued = [q("q0", team="b", prio=LOW, t=NOW), q("q1", team="b", prio=NORMAL, t=NOW)]
    cfg = PolicyConfig(backfill=False, same_node=False, las_preemption=False, max_evictions_per_cycle=1)
    d = schedule(view(gpus, queued, running, teams), cfg)
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("r0", "q1")]
    assert d.placements == [Placement("q0", ("n3/1",))]
    assert d.waiting["q1"] == (
        "preempting 1 job (r0) to free 1 GPU and to bring team b within its limit of 2; "
        "starts once they have checkpointed and stopped"
    )


def test_borrowing_uses_idle_gpus_of_other_teams() -> None:
    teams = [Team("a", 2, borrow_limit=6), Team("b", 6)]
    d = schedule(view(node_gpus("n0", 8), [q(f"j{i}", t=i) for i in range(8)], teams=teams), CFG)
    assert len(d.placements) == 8 and not d.waiting


def test_entitled_job_goes_before_a_higher_priority_borrower() -> None:
    # b is at its nominal quota: its high job would borrow the GPU a is entitled to.
    teams = [Team("a", 4, borrow_limit=4), Team("b", 4, borrow_limit=4)]
    running = [r(f"b{i}", [f"n0/{i}"], team="b", prio=HIGH) for i in range(4)] + [r("a0", ["n0/4"], team="a")]
    gpus = node_gpus("n0", 6)
    d = schedule(view(gpus, [q("bh", team="b", prio=HIGH), q("al", team="a", prio=LOW)], running, teams), CFG)
    assert placed(d) == {"al": ("n0/5",)}
    assert d.waiting["bh"].startswith("waiting for 1 GPU: 0 free")


def test_reclaim_evicts_only_borrowed_jobs_least_work_lost_first() -> None:
    teams = [Team("a", 4, borrow_limit=4), Team("b", 4, borrow_limit=4)]
    # b holds 6 (2 borrowed); a holds 2 and wants 3 more, 2 of them within its nominal.
    running = [r(f"b{i}", [f"n0/{i}"], team="b", prio=HIGH, ckpt=NOW - 100 * (i + 1)) for i in range(6)] + [
        r("a0", ["n0/6"], team="a"),
        r("a1", ["n0/7"], team="a"),
    ]
    queued = [q("x", team="a", t=1), q("y", team="a", t=2), q("z", team="a", t=3)]
    d = schedule(view(node_gpus("n0", 8), queued, running, teams), CFG)
    assert [e.job_id for e in d.evictions] == ["b0", "b1"]  # most recent checkpoints
    assert all(
        e.reason == f"team a reclaims its nominal quota (4 GPUs) for job {e.for_job}" for e in d.evictions
    )
    assert {e.for_job for e in d.evictions} == {"x", "y"}
    assert d.waiting["x"].startswith("preempting 1 job (b0) to free 1 GPU")
    assert d.waiting["z"].startswith("waiting for 1 GPU: 0 free")  # b is back at nominal: no more


def test_reclaim_takes_borrowed_gpus_from_the_lowest_classes_never_a_high_job_its_nominal_covers() -> None:
    """Trace 6 in miniature: team r (nominal 13) runs a 12-GPU high job and, on borrowed GPUs,
    an 8-GPU low job that started 2 minutes ago. Team d reclaims 8 GPUs of its nominal: with
    `reclaim_preempts_young` (the default) the low job's at once, however young, as it writes
    a checkpoint at SIGTERM; never the high one's."""
    teams = [Team("d", 12, borrow_limit=8), Team("r", 13, borrow_limit=8)]
    gpus = node_gpus("n0", 20)
    ids = [g.id for g in gpus]
    high = r("high", ids[:12], team="r", prio=HIGH, started=NOW - 3600, ckpt_at_stop=True)
    young_low = r("low", ids[12:20], team="r", prio=LOW, started=NOW - 120, ckpt_at_stop=True)
    want = q("d-job", gpus=8, team="d", t=NOW - 10)
    eager = CFG
    assert eager.reclaim_preempts_young
    d = schedule(view(gpus, [want], [high, young_low], teams), eager)
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("low", "d-job")]
    # A young job that would lose all it did (no checkpoint at SIGTERM) keeps min_runtime_s.
    losing = r("low", ids[12:20], team="r", prio=LOW, started=NOW - 120)
    d = schedule(view(gpus, [want], [high, losing], teams), eager)
    assert d.evictions == [] and "become preemptible after 600 s" in d.waiting["d-job"]
    # With it off, d waits for the low job to become preemptible rather than evicting the
    # high one...
    patient = PolicyConfig(aging_s=None, reclaim_preempts_young=False)
    d = schedule(view(gpus, [want], [high, young_low], teams), patient)
    assert d.evictions == []
    assert "lower-priority jobs become preemptible after 600 s of runtime" in d.waiting["d-job"]
    # ...and once the low job has run 10 minutes, it is the one reclaimed.
    old_low = r("low", ids[12:20], team="r", prio=LOW, started=NOW - 700)
    d = schedule(view(gpus, [want], [high, old_low], teams), patient)
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("low", "d-job")]
    # A high job beyond what its team's nominal covers still borrows, and is reclaimed: after
    # the young low job of its team that borrows too, or, waiting for that one, itself.
    wide = r("high", ids[:16], team="r", prio=HIGH, started=NOW - 3600)
    rest = r("low", ids[16:20], team="r", prio=LOW, started=NOW - 120, ckpt_at_stop=True)
    d = schedule(view(gpus, [q("d-job", gpus=4, team="d", t=NOW - 10)], [wide, rest], teams), eager)
    assert [e.job_id for e in d.evictions] == ["low"]
    d = schedule(view(gpus, [q("d-job", gpus=4, team="d", t=NOW - 10)], [wide, rest], teams), patient)
    assert [e.job_id for e in d.evictions] == ["high"]
    # The top class keeps min_runtime_s even then: a young high job on borrowed GPUs waits.
    young_high = r("high", ids[:16], team="r", prio=HIGH, started=NOW - 120, ckpt_at_stop=True)
    own = r("d0", ids[16:20], team="d", prio=NORMAL, started=NOW - 3600)
    d = schedule(view(gpus, [q("d-job", gpus=4, team="d", t=NOW - 10)], [young_high, own], teams), eager)
    assert d.evictions == []


# --------------------------------------------------------------------------- victims


def test_victims_lowest_priority_then_most_recent_checkpoint() -> None:
    running = [
        r("normal", ["n0/0"], prio=NORMAL, ckpt=NOW - 10),
        r("low-old-ckpt", ["n0/1"], prio=LOW, ckpt=NOW - 3000),
        r("low-new-ckpt", ["n0/2"], prio=LOW, ckpt=NOW - 60),
        r("low-no-ckpt", ["n0/3"], prio=LOW, started=NOW - 1200),
    ]
    d = schedule(view(node_gpus("n0", 4), [q("h", prio=HIGH)], running), CFG)
    assert [(e.job_id, e.reason, e.for_job) for e in d.evictions] == [
        ("low-new-ckpt", "preempted for job h (priority high)", "h")
    ]
    d2 = schedule(view(node_gpus("n0", 4), [q("h", 3, prio=HIGH)], running), CFG)
    assert sorted(e.job_id for e in d2.evictions) == ["low-new-ckpt", "low-no-ckpt", "low-old-ckpt"]


def test_victims_by_size_first_with_victim_order_smallest() -> None:
    """Slurm's preempt/qos order: a 1-GPU job needs one victim; by least work lost it takes
    the 4-GPU job that checkpointed a minute ago (240 GPU-s lost, 4 GPUs disturbed), by size
    the 1-GPU job that has not checkpointed for 15 minutes (900 GPU-s)."""
    running = [
        r("big-new-ckpt", ["n0/0", "n0/1", "n0/2", "n0/3"], prio=LOW, ckpt=NOW - 60),
        r("small-old-ckpt", ["n0/4"], prio=LOW, ckpt=NOW - 900),
    ]
    v = view(node_gpus("n0", 5), [q("h", prio=HIGH)], running)
    assert [e.job_id for e in schedule(v, CFG).evictions] == ["big-new-ckpt"]
    smallest = PolicyConfig(aging_s=None, victim_order="smallest")
    assert [e.job_id for e in schedule(v, smallest).evictions] == ["small-old-ckpt"]
    with pytest.raises(ConfigError, match="victim_order"):
        PolicyConfig(victim_order="biggest")  # type: ignore[arg-type]


def test_never_a_young_or_non_preemptible_victim() -> None:
    running = [
        r("young", ["n0/0"], prio=LOW, started=NOW - 599),
        r("leaving", ["n0/1"], prio=LOW, preemptible=False),
    ]
    d = schedule(view(node_gpus("n0", 2), [q("h", prio=HIGH)], running), CFG)
    assert d.evictions == []
    # the releasing GPU of the leaving job is claimed for h instead
    assert d.waiting["h"] == "waiting for 1 GPU being released by jobs that are stopping; 1 GPU held for it"
    # A normal job waits for the young low one to pass min_runtime_s (one that started before
    # it came: else that one would be its tenant, which steps aside however young)...
    d2 = schedule(view(node_gpus("n0", 2), [q("n", 2, prio=NORMAL, t=NOW - 300)], running), CFG)
    assert d2.evictions == []
    assert "lower-priority jobs become preemptible after 600 s of runtime" in d2.waiting["n"]
    d3 = schedule(
        view(node_gpus("n0", 2), [q("n", 2, prio=NORMAL)], running), PolicyConfig(min_runtime_s=500)
    )
    assert [e.job_id for e in d3.evictions] == ["young"]
    # ...the top class does not (`top_class_preempts_young`, on by default), unless it is off.
    d4 = schedule(view(node_gpus("n0", 2), [q("h", 2, prio=HIGH)], running), CFG)
    assert [(e.job_id, e.for_job) for e in d4.evictions] == [("young", "h")]
    off = PolicyConfig(top_class_preempts_young=False)
    d5 = schedule(view(node_gpus("n0", 2), [q("h", 2, prio=HIGH, t=NOW - 300)], running), off)
    assert d5.evictions == []
    assert "lower-priority jobs become preemptible after 600 s of runtime" in d5.waiting["h"]
    # Young jobs of its own class are no victims for it either way.
    same = [r("young-high", ["n0/0"], prio=HIGH, started=NOW - 10), running[1]]
    d6 = schedule(view(node_gpus("n0", 2), [q("h", 2, prio=HIGH)], same), CFG)
    assert d6.evictions == [] and "become preemptible" not in d6.waiting["h"]


def test_no_pointless_evictions_and_never_more_than_needed() -> None:
    gpus = node_gpus("n0", 4) + node_gpus("n1", 4)
    running = [
        r("l0", ["n0/0", "n0/1"], prio=LOW),
        r("n0", ["n0/2", "n0/3"], prio=HIGH),
        r("l1", ["n1/0"], prio=LOW),
        r("n1", ["n1/1", "n1/2", "n1/3"], prio=HIGH),
    ]
    # 4 on one node: no low victim set can free a whole node -> nothing evicted.
    d = schedule(view(gpus, [q("h", 4, prio=HIGH)], running), CFG)
    assert d.evictions == [] and d.waiting["h"].startswith("waiting for 4 GPUs: 0 free")
    # 1 GPU: the single cheapest victim, not both.
    d = schedule(view(gpus, [q("h", 1, prio=HIGH)], running), CFG)
    assert [e.job_id for e in d.evictions] == ["l1"]
    # spanning allowed: 3 GPUs need both low jobs.
    d = schedule(view(gpus, [q("h", 3, prio=HIGH)], running), PolicyConfig(same_node=False, aging_s=None))
    assert sorted(e.job_id for e in d.evictions) == ["l0", "l1"]


def test_max_evictions_per_cycle() -> None:
    running = [r(f"l{i}", [f"n0/{i}"], prio=LOW) for i in range(4)]
    cfg = PolicyConfig(max_evictions_per_cycle=2, aging_s=None)
    d = schedule(view(node_gpus("n0", 4), [q("a", 2, prio=HIGH), q("b", 2, prio=HIGH, t=1)], running), cfg)
    assert len(d.evictions) == 2 and {e.for_job for e in d.evictions} == {"a"}
    assert d.waiting["b"].startswith("waiting for 2 GPUs: 0 free")


def test_preemption_off() -> None:
    running = [r("l", ["n0/0"], prio=LOW)]
    d = schedule(view(node_gpus("n0", 1), [q("h", prio=HIGH)], running), PolicyConfig(preemption=False))
    assert d.evictions == [] and "h" in d.waiting


# --------------------------------------------------------------------------- reservations


def test_freed_gpus_are_reserved_for_the_job_they_were_freed_for() -> None:
    gpus = node_gpus("n0", 4)
    running = [r("l0", ["n0/0", "n0/1"], prio=LOW), r("l1", ["n0/2"], prio=LOW)]
    queue = [q("big", 4, prio=HIGH, t=0), q("small", 1, prio=NORMAL, t=1)]
    # cycle 1: one GPU free; big evicts both low jobs; small must not take the free GPU.
    d1 = schedule(view(gpus, queue, running), CFG)
    assert sorted(e.job_id for e in d1.evictions) == ["l0", "l1"]
    assert placed(d1) == {}
    assert "held for job big" in d1.waiting["small"]
    # cycle 2: the victims are checkpointing (preemptible=False), one GPU still free.
    leaving = [
        r("l0", ["n0/0", "n0/1"], prio=LOW, preemptible=False),
        r("l1", ["n0/2"], prio=LOW, preemptible=False),
    ]
    d2 = schedule(view(gpus, queue, leaving), CFG)
    assert d2.evictions == [] and placed(d2) == {}
    assert d2.waiting["big"].startswith("waiting for 3 GPUs being released")
    # cycle 3: l1 has gone, l0 is still stopping: the 2 free GPUs stay held for big.
    d3 = schedule(view(gpus, [*queue, q("l1", 1, prio=LOW, t=-5)], leaving[:1]), CFG)
    assert placed(d3) == {} and d3.evictions == []
    # cycle 4: all gone: big starts on all four; the rest wait.
    d4 = schedule(view(gpus, [*queue, q("l0", 2, prio=LOW, t=-9), q("l1", 1, prio=LOW, t=-5)]), CFG)
    assert placed(d4) == {"big": ("n0/0", "n0/1", "n0/2", "n0/3")}


def test_own_team_lower_class_takes_gpus_its_borrower_holds_only_as_its_tenant() -> None:
    # a's high job must borrow and waits for b's borrowed (still young) job; a's low job fits
    # in a's nominal. Without `holds_yield_to_quota` it must not take the free GPUs ah holds
    # (ah would preempt it later); with it (the default) it takes one as ah's tenant, since
    # a's quota is a's due at once, and ah evicts it if it needs its GPU once b's job may be
    # preempted.
    teams = [Team("a", 3, borrow_limit=5), Team("b", 1, borrow_limit=7)]
    running = [
        r("a0", ["n0/0", "n0/1"], team="a", prio=HIGH),
        r("b0", ["n0/2", "n0/3", "n0/4"], team="b", prio=LOW, started=NOW - 10),
        r("b1", ["n0/5"], team="b", prio=HIGH),
    ]
    queue = [q("ah", 4, team="a", prio=HIGH), q("al", 1, team="a", prio=LOW)]
    # (The top class evicts young jobs by default: the case is one where it waits for them.)
    off = PolicyConfig(top_class_preempts_young=False, holds_yield_to_quota=False)
    d = schedule(view(node_gpus("n0", 8), queue, running, teams), off)
    assert d.evictions == [] and placed(d) == {}
    assert d.waiting["ah"].endswith(
        "2 free GPUs held for it until lower-priority or borrowed jobs can be preempted"
    )
    assert d.waiting["al"].startswith("waiting for 1 GPU: 0 free")
    d = schedule(
        view(node_gpus("n0", 8), queue, running, teams), PolicyConfig(top_class_preempts_young=False)
    )
    assert d.evictions == [] and placed(d) == {"al": ("n0/6",)}
    assert d.waiting["ah"].endswith(
        "2 free GPUs held for it until lower-priority or borrowed jobs can be preempted; 1 GPU of "
        "those held for it went to its team's lower-class jobs within the team's nominal quota, as "
        "its tenants"
    )
    tenant = r("al", ["n0/6"], team="a", prio=LOW, started=NOW - 5, submitted=NOW - 5)
    old = r("b0", ["n0/2", "n0/3", "n0/4"], team="b", prio=LOW, started=NOW - 700)
    later = view(node_gpus("n0", 8), queue[:1], [*running[::2], old, tenant], teams)
    d = schedule(later, PolicyConfig(top_class_preempts_young=False))
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("b0", "ah")]  # the free GPU and b0's 3
    d = schedule(
        view(node_gpus("n0", 7), queue[:1], [*running[::2], old, tenant], teams),
        PolicyConfig(top_class_preempts_young=False),
    )
    assert sorted((e.job_id, e.for_job) for e in d.evictions) == [("al", "ah"), ("b0", "ah")]


def test_no_class_jumping_lower_classes_start_as_tenants_and_step_aside_for_their_teams_head() -> None:
    # a's high job needs all 8 GPUs of a's limit; a's low jobs hold 4, too young to preempt.
    teams = [Team("a", 6, borrow_limit=2), Team("b", 2, borrow_limit=6)]
    # The case is one where the top class waits for young jobs: with `top_class_preempts_young`
    # (the default) it would evict them all, as the end shows.
    off = PolicyConfig(top_class_preempts_young=False)
    big = q("big", 8, team="a", prio=HIGH, t=NOW - 300)
    before = [r(f"a{i}", [f"n0/{i}"], team="a", prio=LOW, started=NOW - 400) for i in range(4)]
    d = schedule(view(node_gpus("n0", 8), [big, q("low", 1, team="a", prio=LOW)], before, teams), off)
    # The low job uses an idle GPU meanwhile: a tenant of the GPUs big waits for.
    assert d.evictions == [] and placed(d) == {"low": ("n0/4",)}
    assert d.waiting["big"].startswith("waiting for 8 GPUs: team a is at its limit 8")
    # Later: the jobs that ran before big was submitted are gone; the tenants that started
    # since, young as they are, step aside for it (a job started before it is never one).
    tenants = [r(f"t{i}", [f"n0/{i}"], team="a", prio=LOW, started=NOW - 60) for i in range(3)]
    d = schedule(view(node_gpus("n0", 8), [big], tenants, teams), off)
    assert sorted((e.job_id, e.reason) for e in d.evictions) == [
        (f"t{i}", "preempted for job big (priority high)") for i in range(3)
    ]
    assert d.waiting["big"].startswith("preempting 3 jobs")
    d = schedule(view(node_gpus("n0", 8), [big], [*tenants, before[0]], teams), off)
    assert d.evictions == []  # a0 ran before big came and is too young: big waits for it...
    d = schedule(view(node_gpus("n0", 8), [big], [*tenants, before[0]], teams), CFG)
    assert sorted(e.job_id for e in d.evictions) == ["a0", "t0", "t1", "t2"]  # ...but for the top class
    # Another team's young job, or one of a's own class, is no tenant either.
    others = [r("b0", ["n0/0"], team="b", prio=LOW, started=NOW - 60)]
    others.append(r("h0", ["n0/1"], team="a", prio=HIGH, started=NOW - 60))
    d = schedule(view(node_gpus("n0", 8), [big], [*tenants, *others], teams), off)
    assert d.evictions == []


def test_a_borrower_never_takes_a_team_below_its_nominal_quota() -> None:
    # Evicting b0 would leave b under its nominal 2, and b0 would reclaim straight back.
    teams = [Team("a", 1, borrow_limit=7), Team("b", 2, borrow_limit=6)]
    running = [r("a0", ["n0/0"], team="a", prio=LOW), r("b0", ["n0/1", "n0/2"], team="b", prio=LOW)]
    d = schedule(view(node_gpus("n0", 3), [q("ah", 2, team="a", prio=HIGH)], running, teams), CFG)
    assert d.evictions == []  # a0 alone is not enough; b0 is not borrowed
    # With b's nominal at 0 all of b0 is borrowed: it goes (alone: a0 is not needed).
    teams = [Team("a", 1, borrow_limit=7), Team("b", 0, borrow_limit=8)]
    d = schedule(view(node_gpus("n0", 3), [q("ah", 2, team="a", prio=HIGH)], running, teams), CFG)
    assert [(e.job_id, e.reason) for e in d.evictions] == [("b0", "preempted for job ah (priority high)")]


def test_only_a_teams_head_preempts_or_reclaims() -> None:
    # a's head (high, 8 GPUs) must borrow; a's low job would fit in a's nominal 4 but waits
    # behind it: it does not reclaim from b's borrower itself (found as a livelock: it
    # reclaimed GPUs that b's higher-class borrower took straight back, for ever).
    teams = [Team("a", 4, borrow_limit=8), Team("b", 0, borrow_limit=8)]
    running = [r("b0", [f"n0/{i}" for i in range(8)], team="b", prio=NORMAL)]
    queue = [q("head", 8, team="a", prio=HIGH), q("low", 1, team="a", prio=LOW)]
    d = schedule(view(node_gpus("n0", 8), queue, running, teams), CFG)
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("b0", "head")]
    assert "behind job head of team a (priority high)" in d.waiting["low"]
    # without the head, the low job is its team's head and reclaims its nominal quota
    d = schedule(view(node_gpus("n0", 8), queue[1:], running, teams), CFG)
    assert [(e.job_id, e.reason) for e in d.evictions] == [
        ("b0", "team a reclaims its nominal quota (4 GPUs) for job low")
    ]
    # a job that can never run heads nothing
    d = schedule(
        view(node_gpus("n0", 8), [q("huge", 64, team="a", prio=HIGH), queue[1]], running, teams), CFG
    )
    assert [e.for_job for e in d.evictions] == ["low"]


def test_quota_under_head_a_lower_class_reclaims_its_teams_quota_while_its_head_must_borrow() -> None:
    """Trace 7's 61-minute wait in miniature: a's normal head needs 6 GPUs, more than a's
    unused nominal 4, and cannot start; b borrows 4 of a's quota with a low job. a's low job
    (2 GPUs) fits in a's quota: by default it waits behind the head for idle GPUs; with
    `quota_under_head` (the default) it reclaims a's quota from b's borrower."""
    teams = [Team("a", 4, borrow_limit=4), Team("b", 4, borrow_limit=4)]
    gpus = node_gpus("n0", 8)
    borrower = r("b-low", [f"n0/{i}" for i in range(8)], team="b", prio=LOW, started=NOW - 3600)
    queue = [q("head", 6, team="a", prio=NORMAL, t=NOW - 900), q("a-low", 2, team="a", prio=LOW, t=NOW - 600)]
    off = PolicyConfig(aging_s=None, quota_under_head=False)
    d = schedule(view(gpus, queue, [borrower], teams), off)
    assert d.evictions == [] and "behind job head of team a (priority normal)" in d.waiting["a-low"]
    under = CFG
    d = schedule(view(gpus, queue, [borrower], teams), under)
    assert [(e.job_id, e.reason) for e in d.evictions] == [
        ("b-low", "team a reclaims its nominal quota (4 GPUs) for job a-low")
    ]
    assert d.waiting["a-low"].startswith("preempting 1 job (b-low)")
    # A borrower of the head's class (or above) is no victim: back in the queue it would come
    # before a's low job and take the GPUs straight back.
    same = r("b-normal", [f"n0/{i}" for i in range(8)], team="b", prio=NORMAL, started=NOW - 3600)
    d = schedule(view(gpus, queue, [same], teams), under)
    assert d.evictions == [] and "behind job head of team a" in d.waiting["a-low"]
    # Once b's GPUs are free, the head goes first (it takes 6), then the low job (the 2 left).
    d = schedule(view(gpus, queue, [], teams), under)
    assert sorted(placed(d)) == ["a-low", "head"] and len(placed(d)["head"]) == 6


def test_quota_under_head_reclaims_from_a_borrower_of_its_heads_class_whose_team_comes_later() -> None:
    """Trace 7's 61-minute wait had b's borrowers in the head's class. a's low job may reclaim
    such a borrower when b, without it, still holds a larger share than a with the low job:
    next cycle a's turn in that class comes first, so b's job, back in the queue, cannot take
    the GPUs straight back."""
    teams = [Team("a", 4, borrow_limit=4), Team("b", 4, borrow_limit=4)]
    gpus = node_gpus("n0", 8)
    b_own = r("b-own", [f"n0/{i}" for i in range(4)], team="b", prio=NORMAL, started=NOW - 7200)
    b_borrow = r("b-borrow", [f"n0/{i}" for i in range(4, 8)], team="b", prio=NORMAL, started=NOW - 1200)
    queue = [q("head", 6, team="a", prio=NORMAL, t=NOW - 900), q("a-low", 2, team="a", prio=LOW, t=NOW - 600)]
    under = PolicyConfig(aging_s=None, quota_under_head=True)
    d = schedule(view(gpus, queue, [b_own, b_borrow], teams), under)
    # b keeps 4 of 8 GPUs (share 0.5), a takes 2 (0.25): the borrower that loses least goes.
    assert [(e.job_id, e.reason) for e in d.evictions] == [
        ("b-borrow", "team a reclaims its nominal quota (4 GPUs) for job a-low")
    ]
    # When b weighs four times a's, its share without the borrower (0.5 / 4) is below a's.
    heavy = [Team("a", 4, borrow_limit=4), Team("b", 4, borrow_limit=4, weight=4.0)]
    d = schedule(view(gpus, queue, [b_own, b_borrow], heavy), under)
    assert d.evictions == [] and "behind job head of team a" in d.waiting["a-low"]
    # The starvation guard sends its job first in its class whatever the shares: not with it.
    guard = PolicyConfig(aging_s=None, quota_under_head=True, reserve_after_s=7200.0)
    d = schedule(view(gpus, queue, [b_own, b_borrow], teams), guard)
    assert d.evictions == []


def test_quota_under_head_the_head_evicts_its_young_tenants_once_that_lets_it_start() -> None:
    # a's low job started (as a tenant) after a's head was submitted; it is young. b borrows 4.
    teams = [Team("a", 4, borrow_limit=4), Team("b", 4, borrow_limit=4)]
    gpus = node_gpus("n0", 8)
    tenant = r("a-low", ["n0/0", "n0/1"], team="a", prio=LOW, started=NOW - 60)
    b_own = r("b0", ["n0/2", "n0/3"], team="b", prio=NORMAL, started=NOW - 3600)
    head = q("head", 6, team="a", prio=NORMAL, t=NOW - 900)
    under = PolicyConfig(aging_s=None, quota_under_head=True)
    d = schedule(view(gpus, [head], [tenant, b_own], teams), under)
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("a-low", "head")]
    assert d.waiting["head"].startswith("preempting 1 job (a-low)")
    # Without it a young job of a lower class is no victim: the head waits 10 minutes.
    off = PolicyConfig(aging_s=None, quota_under_head=False)
    d = schedule(view(gpus, [head], [tenant, b_own], teams), off)
    assert d.evictions == [] and "become preemptible after 600 s" in d.waiting["head"]
    # A job that started before the head was submitted is no tenant.
    before = r("a-low", ["n0/0", "n0/1"], team="a", prio=LOW, started=NOW - 60, submitted=NOW - 5000)
    d = schedule(view(gpus, [q("head", 6, team="a", t=NOW - 30)], [before, b_own], teams), under)
    assert d.evictions == []


def test_quota_under_head_a_lower_class_waits_for_its_teams_classes_between_it_and_the_head() -> None:
    # a's high head (12 GPUs) must borrow and cannot start. a's small normal job (1) and low
    # job (2) fit in a's unused quota of 4; its big normal job (8) does not, and borrows.
    # The small normal job goes right after the head; the low one after a's normal jobs,
    # so the big one takes 8 of the 9 GPUs left first (it once came after the low one too).
    teams = [Team("a", 4, borrow_limit=8), Team("b", 4, borrow_limit=4)]
    gpus = node_gpus("n0", 12)
    running = [r("b0", ["n0/0", "n0/1"], team="b")]
    queue = [
        q("head", 12, team="a", prio=HIGH, t=NOW - 900),
        q("a-small", 1, team="a", prio=NORMAL, t=NOW - 850),
        q("a-normal", 8, team="a", prio=NORMAL, t=NOW - 800),
        q("a-low", 2, team="a", prio=LOW, t=NOW - 700),
    ]
    under = PolicyConfig(aging_s=None, quota_under_head=True)
    d = schedule(view(gpus, queue, running, teams), under)
    assert set(placed(d)) == {"a-small", "a-normal"} and "behind job head of team a" in d.waiting["a-low"]


def test_quota_under_head_goes_first_in_its_class_when_its_teams_jobs_there_went_already() -> None:
    # a's high head (8) must borrow. a's normal job (1) waits behind it and goes right after
    # it (class high); a's low job (1) goes after a's normal jobs, all of them gone already,
    # so first in the normal class: before b's normal borrower, which once took the last
    # free GPU while a's low job, considered at the end of the class, found none.
    teams = [Team("a", 4, borrow_limit=8), Team("b", 0, borrow_limit=8)]
    running = [r("b-high", [f"n0/{i}" for i in range(6)], team="b", prio=HIGH, started=NOW - 7200)]
    queue = [
        q("head", 8, team="a", prio=HIGH, t=NOW - 900),
        q("a-normal", 1, team="a", prio=NORMAL, t=NOW - 800),
        q("a-low", 1, team="a", prio=LOW, t=NOW - 700),
        q("b-normal", 1, team="b", prio=NORMAL, t=NOW - 1000),
    ]
    under = PolicyConfig(aging_s=None, quota_under_head=True)
    d = schedule(view(node_gpus("n0", 8), queue, running, teams), under)
    assert sorted(placed(d)) == ["a-low", "a-normal"] and d.evictions == []
    assert d.waiting["b-normal"].startswith("waiting for 1 GPU: 0 free")


def test_free_gpus_are_held_for_a_blocked_job_only_when_its_victims_come_due_within_a_minute() -> None:
    """a's normal job (4 GPUs) fits once b's low job (2 GPUs, too young to preempt) leaves:
    the 2 free GPUs beside it are held for it when b's job may be preempted within
    `hold_within_s` (60 s), else a's 1-GPU jobs use them meanwhile (they waited up to 10
    minutes behind the hold). The top class holds whatever the wait; None holds as before."""
    teams = [Team("a", 4, borrow_limit=4), Team("b", 4, borrow_limit=4)]
    gpus = node_gpus("n0", 4)
    queue = [q("a-job", 4, team="a", t=NOW - 100), q("a-1", 1, team="a", t=NOW - 50)]
    held = "2 free GPUs held for it until lower-priority or borrowed jobs can be preempted"
    cfg = dataclasses.replace(CFG, top_class_preempts_young=False)

    def low(age: float) -> list[ActiveJob]:
        return [r("b-low", ["n0/0", "n0/1"], team="b", prio=LOW, started=NOW - age)]

    d = schedule(view(gpus, queue, low(570), teams), cfg)  # due in 30 s
    assert placed(d) == {} and d.waiting["a-job"].endswith(held)
    assert "2 more are held for job a-job" in d.waiting["a-1"]
    d = schedule(view(gpus, queue, low(60), teams), cfg)  # due in 540 s
    assert placed(d) == {"a-1": ("n0/2",)} and not d.waiting["a-job"].endswith(held)
    d = schedule(view(gpus, queue, low(60), teams), dataclasses.replace(cfg, hold_within_s=None))
    assert placed(d) == {} and d.waiting["a-job"].endswith(held)
    top = [q("a-top", 4, team="a", prio=HIGH, t=NOW - 100), queue[1]]
    d = schedule(view(gpus, top, low(60), teams), cfg)
    assert placed(d) == {} and d.waiting["a-top"].endswith(held)


def test_holds_yield_to_the_quota_its_heads_own_hold_takes_a_tenant() -> None:
    """Trace 2's 4-minute wait in miniature: a's normal head (6 GPUs) must borrow; it holds
    the 2 free GPUs until b's young low job may be preempted, and its hold counted all 6
    against a's quota, so a's low job (2 GPUs), which fits in a's unused nominal 4, waited.
    With `holds_yield_to_quota` (the default) it starts on them as the head's tenant."""
    teams = [Team("a", 4, borrow_limit=8), Team("b", 2, borrow_limit=8)]
    gpus = node_gpus("n0", 8)
    b_own = r("b-own", ["n0/0", "n0/1"], team="b", prio=NORMAL, started=NOW - 7200)
    # b's low job may be preempted in 30 s (`hold_within_s`: a longer wait holds nothing).
    young = r("b-low", [f"n0/{i}" for i in range(2, 6)], team="b", prio=LOW, started=NOW - 570)
    queue = [q("head", 6, team="a", prio=NORMAL, t=NOW - 900), q("a-low", 2, team="a", prio=LOW, t=NOW - 600)]
    off = PolicyConfig(aging_s=None, holds_yield_to_quota=False)
    d = schedule(view(gpus, queue, [b_own, young], teams), off)
    assert placed(d) == {} and d.evictions == []
    held = "held for it until lower-priority or borrowed jobs can be preempted"
    assert d.waiting["head"].endswith(f"2 free GPUs {held}")
    assert "2 more are held for job head" in d.waiting["a-low"]
    d = schedule(view(gpus, queue, [b_own, young], teams), CFG)
    assert placed(d) == {"a-low": ("n0/6", "n0/7")} and d.evictions == []
    # Ten minutes on, b's job may be preempted: the head evicts it and its tenant, and starts.
    tenant = r("a-low", ["n0/6", "n0/7"], team="a", prio=LOW, started=NOW - 60)
    old = r("b-low", [f"n0/{i}" for i in range(2, 6)], team="b", prio=LOW, started=NOW - 660)
    d = schedule(view(gpus, queue[:1], [b_own, old, tenant], teams), CFG)
    assert sorted((e.job_id, e.for_job) for e in d.evictions) == [("a-low", "head"), ("b-low", "head")]


def test_holds_yield_to_the_quota_another_teams_borrower_holds_none_of_it() -> None:
    """Trace 3's 6-minute wait in miniature: b's high job borrows and holds the 2 free GPUs
    until its team's young low job may be preempted; a's low job (2 GPUs), behind a's
    borrowing head, fits in a's unused quota. A borrower's hold never keeps a team from its
    quota: by default the low job takes them. The starvation guard's hold it leaves alone."""
    teams = [Team("a", 4, borrow_limit=8), Team("b", 2, borrow_limit=8)]
    gpus = node_gpus("n0", 8)
    young = r("b-low", [f"n0/{i}" for i in range(6)], team="b", prio=LOW, started=NOW - 9970)  # due in 30 s
    queue = [
        q("b-high", 4, team="b", prio=HIGH, t=NOW - 4000),  # after b-low started: no tenant
        q("head", 8, team="a", prio=NORMAL, t=NOW - 900),
        q("a-low", 2, team="a", prio=LOW, t=NOW - 600),
    ]
    kw: dict[str, Any] = {"aging_s": None, "top_class_preempts_young": False, "min_runtime_s": 10_000.0}
    d = schedule(view(gpus, queue, [young], teams), PolicyConfig(**kw, holds_yield_to_quota=False))
    held = "2 free GPUs held for it until lower-priority or borrowed jobs can be preempted"
    assert placed(d) == {} and d.waiting["b-high"].endswith(held)
    assert "2 more are held for job b-high" in d.waiting["a-low"]
    d = schedule(view(gpus, queue, [young], teams), PolicyConfig(**kw))
    assert placed(d) == {"a-low": ("n0/6", "n0/7")} and d.evictions == []
    assert d.waiting["b-high"].endswith(
        f"{held}; 2 GPUs of those held for it went to team a's jobs "
        "within its nominal quota (a team's quota comes before "
        "another team's borrowing)"
    )
    d = schedule(view(gpus, queue, [young], teams), PolicyConfig(**kw, reserve_after_s=3600.0))
    assert placed(d) == {} and "2 more are held for job b-high" in d.waiting["a-low"]


def test_holds_yield_to_the_quota_another_teams_borrower_claims_none_of_it() -> None:
    """Trace 6's 2.2-minute wait in miniature: b's normal job (4 GPUs) borrows and claims the
    2 free GPUs with the 2 its team's leaving job releases; a's low job (2 GPUs), behind a's
    head at its limit, fits in a's unused quota. A borrower's claim is a hold like any
    other: its free part is open to a team taking its quota, as `_hold`'s is."""
    teams = [Team("a", 4, borrow_limit=4, weight=0.1), Team("b", 2, borrow_limit=8, weight=1.0)]
    gpus = node_gpus("n0", 8)
    running = [
        r("b-own", ["n0/0", "n0/1"], team="b", prio=NORMAL, started=NOW - 7200),
        r("b-leaving", ["n0/2", "n0/3"], team="b", prio=NORMAL, started=NOW - 7200, preemptible=False),
        r("a-run", ["n0/4", "n0/5"], team="a", prio=NORMAL, started=NOW - 7200),
    ]
    queue = [
        q("b-big", 4, team="b", prio=NORMAL, t=NOW - 1000),  # b's share is the smaller: first
        q("a-head", 8, team="a", prio=NORMAL, t=NOW - 900),  # 2 + 8 > a's limit 8
        PendingJob("a-low", "a", LOW, 2, submitted_at=NOW - 600, checkpoints_at_stop=True),
    ]
    claimed = "waiting for 2 GPUs being released by jobs that are stopping; 4 GPUs held for it"
    d = schedule(view(gpus, queue, running, teams), PolicyConfig(aging_s=None, holds_yield_to_quota=False))
    assert placed(d) == {} and d.evictions == [] and d.waiting["b-big"] == claimed
    assert "2 more are held for job b-big" in d.waiting["a-low"]
    d = schedule(view(gpus, queue, running, teams), CFG)
    assert placed(d) == {"a-low": ("n0/6", "n0/7")} and d.evictions == []
    assert d.waiting["b-big"] == (
        f"{claimed}; 2 GPUs of those held for it went to team a's jobs within its nominal quota "
        "(a team's quota comes before another team's borrowing)"
    )
    # The top class's claim it leaves alone: its waits stay the shortest.
    top = [dataclasses.replace(queue[0], priority=HIGH), *queue[1:]]
    d = schedule(view(gpus, top, running, teams), CFG)
    assert placed(d) == {} and "2 more are held for job b-big" in d.waiting["a-low"]


def test_holds_yield_to_the_quota_its_teams_other_borrower_holds_none_of_it() -> None:
    """Trace 5's 10-minute wait in miniature: a's high head is at a's limit and holds
    nothing; a's normal job (4 GPUs) borrows and holds the 2 free GPUs until b's young job
    may be preempted, its hold counting all 4 against a's quota. a's low job (1 GPU) fits
    in a's unused nominal quota: it starts on a held GPU, as the borrowers' tenant, if it
    writes a checkpoint when asked to stop (stepping aside then costs it nothing)."""
    teams = [Team("a", 4, borrow_limit=4), Team("b", 2, borrow_limit=8)]
    gpus = node_gpus("n0", 8)
    running = [
        r("a-run", ["n0/0"], team="a", prio=NORMAL, started=NOW - 7200),
        r("b-own", ["n0/1", "n0/2"], team="b", prio=NORMAL, started=NOW - 7200),
        r("b-low", [f"n0/{i}" for i in range(3, 6)], team="b", prio=LOW, started=NOW - 570),  # due in 30 s
    ]
    low = PendingJob("a-low", "a", LOW, 1, submitted_at=NOW - 600, checkpoints_at_stop=True)
    queue = [
        q("a-high", 8, team="a", prio=HIGH, t=NOW - 900),  # 1 + 8 > a's limit 8
        q("a-normal", 4, team="a", prio=NORMAL, t=NOW - 800),
        low,
    ]
    kw: dict[str, Any] = {"aging_s": None, "top_class_preempts_young": False}
    held = "2 free GPUs held for it until lower-priority or borrowed jobs can be preempted"
    for cfg, job in (
        (PolicyConfig(**kw, holds_yield_to_quota=False), low),
        (PolicyConfig(**kw), dataclasses.replace(low, checkpoints_at_stop=False)),
    ):
        d = schedule(view(gpus, [*queue[:2], job], running, teams), cfg)
        assert placed(d) == {} and d.evictions == []
        assert d.waiting["a-normal"].endswith(held)
        assert "2 more are held for job a-normal" in d.waiting["a-low"]
    d = schedule(view(gpus, queue, running, teams), PolicyConfig(**kw))
    assert placed(d) == {"a-low": ("n0/6",)} and d.evictions == []
    assert d.waiting["a-high"].startswith("waiting for 8 GPUs: team a is at its limit 8")


def test_a_job_behind_its_head_reclaims_a_borrower_of_the_heads_class_that_checkpoints_at_sigterm() -> None:
    """Trace 1's 10-minute wait in miniature: a's low job (3 GPUs) fits in a's unused quota
    behind a's normal head; the GPUs it needs beyond the 2 free ones are b's normal borrower's.
    Without it b's share would be smaller than a's: back in the queue it would go first and
    take them back, so the share rule keeps it. One that checkpoints at SIGTERM cannot: what
    it frees stays the low job's (`hold_freed_for_job`), which reclaims it."""
    teams = [Team("a", 4, borrow_limit=8, weight=0.5), Team("b", 2, borrow_limit=8, weight=0.2)]
    gpus = node_gpus("n0", 8)
    big = r(
        "b-big", [f"n0/{i}" for i in range(6)], team="b", prio=NORMAL, started=NOW - 7200, ckpt_at_stop=True
    )
    queue = [
        q("a-head", 6, team="a", prio=NORMAL, t=NOW - 900),
        q("a-low", 3, team="a", prio=LOW, t=NOW - 600),
    ]
    cfg = PolicyConfig(aging_s=None)
    d = schedule(view(gpus, queue, [big], teams), cfg)
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("b-big", "a-low")]
    assert d.waiting["a-low"].startswith("preempting 1 job (b-big)")
    for running, c in (
        (dataclasses.replace(big, checkpoints_at_stop=False), cfg),
        (big, dataclasses.replace(cfg, hold_freed_for_job=False)),
    ):
        d = schedule(view(gpus, queue, [running], teams), c)
        assert d.evictions == [] and placed(d) == {}
        assert d.waiting["a-low"].endswith("behind job a-head of team a (priority normal)")
    # Not a borrower of the top class: ahead of every other class, it would take back what
    # the low job claims besides its GPUs (the livelock fuzz).
    top = dataclasses.replace(big, priority=HIGH)
    d = schedule(view(gpus, [dataclasses.replace(queue[0], priority=HIGH), queue[1]], [top], teams), cfg)
    assert d.evictions == []


def test_a_job_that_never_runs_on_spot_reclaims_a_borrower_on_gpus_it_can_use() -> None:
    """b borrows 4 GPUs beyond its nominal 2: a job mostly on spot GPUs (3 of 4), which lost
    less since its last checkpoint and comes first in the victim order, and one on 2 fixed
    GPUs. a's job never runs on spot: taking the first used up what b could give (a reclaim
    stops at b's nominal) and freed 1 GPU it runs on. It reclaims the fixed one."""
    teams = [Team("a", 4, borrow_limit=4), Team("b", 2, borrow_limit=8)]
    gpus = node_gpus("n0", 3) + node_gpus("s", 3, "spot")
    running = [
        r("b-mixed", ["n0/0", "s/0", "s/1", "s/2"], team="b", ckpt=NOW - 30),
        r("b-fixed", ["n0/1", "n0/2"], team="b", ckpt=NOW - 3000),
    ]
    d = schedule(view(gpus, [q("a-never", 2, spot="never")], running, teams), CFG)
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("b-fixed", "a-never")]
    # A job that may run on spot takes the victim that lost least.
    d = schedule(view(gpus, [q("a-any", 2)], running, teams), CFG)
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("b-mixed", "a-any")]


def test_a_never_spot_reclaim_that_needs_a_partly_spot_borrower_takes_the_one_with_most_fixed_gpus() -> None:
    """Trace 8's 5-minute wait in miniature: b (nominal 4) holds 8, so it can give back 4.
    a's job never runs on spot and needs 3 fixed GPUs, none free. The one borrower wholly on
    fixed GPUs frees 1. The victim order's first, on 1 fixed and 3 spot GPUs, used up all
    b could give and freed 1 more: a waited. Partly spot borrowers now go by the share of
    their GPUs a's job can use: the one on 2 fixed and 1 spot GPU."""
    teams = [Team("a", 4, borrow_limit=4), Team("b", 4, borrow_limit=8)]
    gpus = node_gpus("n0", 4) + node_gpus("s", 4, "spot")
    running = [
        r("b-mixed", ["n0/0", "s/0", "s/1", "s/2"], team="b", ckpt=NOW - 30),
        r("b-fixed", ["n0/1"], team="b", ckpt=NOW - 3000),
        r("b-part", ["n0/2", "n0/3", "s/3"], team="b", ckpt=NOW - 2000),
    ]
    d = schedule(view(gpus, [q("a-never", 3, spot="never")], running, teams), CFG)
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("b-fixed", "a-never"), ("b-part", "a-never")]
    assert d.waiting["a-never"].startswith("preempting 2 jobs (b-fixed, b-part) to free 3 GPUs")
    # A job that may run on spot takes the victim that lost least.
    d = schedule(view(gpus, [q("a-any", 3)], running, teams), CFG)
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("b-mixed", "a-any")]


def test_a_never_spot_reclaim_takes_the_lenders_higher_class_when_only_its_spot_low_job_borrows() -> None:
    """Trace 3 in miniature: b (nominal 4) holds 6: a low job on 3 spot GPUs, a normal one
    on 3 fixed GPUs. By classes b borrows only through the low job, on spot, which a's job
    that never runs on spot cannot use: the 2 fixed GPUs it needs (1 free) stayed b's. Its
    spot GPUs now cover b's nominal first, so a takes back the fixed GPUs b lends; a job
    that may run on spot still takes the low job's. (Jobs on one node: `same_node`.)"""
    teams = [Team("a", 4, borrow_limit=4), Team("b", 4, borrow_limit=8)]
    gpus = node_gpus("n0", 4) + node_gpus("s", 3, "spot")
    running = [
        r("b-low", ["s/0", "s/1", "s/2"], team="b", prio=LOW, ckpt=NOW - 30),
        r("b-normal", ["n0/0", "n0/1", "n0/2"], team="b", ckpt=NOW - 3000),
    ]
    d = schedule(view(gpus, [q("a-never", 2, spot="never")], running, teams), CFG)
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("b-normal", "a-never")]
    assert d.evictions[0].reason == "team a reclaims its nominal quota (4 GPUs) for job a-never"
    d = schedule(view(gpus, [q("a-any", 3)], running, teams), CFG)
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("b-low", "a-any")]
    # b at its nominal lends nothing: no eviction, whatever GPUs its jobs are on.
    at_nominal = [running[0], r("b-normal", ["n0/0"], team="b")]
    d = schedule(view(gpus, [q("a-never", 4, spot="never")], at_nominal, teams), CFG)
    assert d.evictions == [] and d.waiting["a-never"].startswith("waiting for 4 GPUs: 3 free")


def test_another_teams_quota_is_not_a_higher_classs_when_its_jobs_checkpoint_at_sigterm() -> None:
    """A spot node down in miniature: 6 GPUs for nominal quotas of 4 and 4. b runs a low job
    within its quota; a's normal job fits in a's. With SIGTERM checkpoints a reclaim gets
    borrowed GPUs back at once, so b keeps its quota and a's job waits. The top class still
    takes it, and so does any higher class from a job that does not checkpoint at SIGTERM,
    as before; and every one with `quota_keeps_lower_classes` off. Beyond b's nominal, its
    low job holds borrowed GPUs: reclaimed."""
    teams = [Team("a", 4, borrow_limit=4), Team("b", 4, borrow_limit=4)]
    gpus = node_gpus("n0", 6)
    mine = [r(f"a{i}", [f"n0/{i}"], team="a", ckpt_at_stop=True) for i in range(2)]
    low = r("b-low", ["n0/2", "n0/3", "n0/4", "n0/5"], team="b", prio=LOW, ckpt_at_stop=True)

    def evicted(
        job: PendingJob, running: list[ActiveJob], cfg: PolicyConfig = CFG
    ) -> list[tuple[str, str | None]]:
        d = schedule(view(gpus, [job], running, teams), cfg)
        if not d.evictions:
            assert d.waiting[job.id].startswith("waiting for 2 GPUs: 0 free"), d.waiting
        return [(e.job_id, e.for_job) for e in d.evictions]

    assert evicted(q("a-job", 2), [*mine, low]) == []
    assert evicted(q("a-top", 2, prio=HIGH), [*mine, low]) == [("b-low", "a-top")]
    losing = r("b-low", ["n0/2", "n0/3", "n0/4", "n0/5"], team="b", prio=LOW)
    assert evicted(q("a-job", 2), [*mine, losing]) == [("b-low", "a-job")]
    off = dataclasses.replace(CFG, quota_keeps_lower_classes=False)
    assert evicted(q("a-job", 2), [*mine, low], off) == [("b-low", "a-job")]
    # b over its nominal (a 1-GPU job of its own in a's place): its low job is borrowed.
    over = [mine[0], r("b-n", ["n0/1"], team="b", ckpt_at_stop=True), low]
    assert evicted(q("a-job", 2), over) == [("b-low", "a-job")]


def test_gpus_freed_for_a_reclaim_stay_with_it_while_a_higher_class_fitting_job_reclaims_its_own() -> None:
    """Trace 2's chain in miniature: a's low job J reclaimed 2 GPUs from b's borrower, which
    is on its way out; c's high job K, which also fits in its team's quota, came meanwhile.
    K once took the GPUs being released (first in the cycle's order) and J had to reclaim
    again a grace period later. With `hold_freed_for_job` (the default) they stay J's, free
    or still being released, and K takes back its own quota at once."""
    teams = [Team("a", 2, borrow_limit=4), Team("b", 2, borrow_limit=4), Team("c", 2, borrow_limit=4)]
    gpus = node_gpus("n0", 4)
    b0 = r("b0", ["n0/0", "n0/1"], team="b", prio=NORMAL)
    leaving = dataclasses.replace(
        r("b1", ["n0/2", "n0/3"], team="b", prio=NORMAL, preemptible=False, ckpt_at_stop=True),
        leaving_for="J",
    )
    queue = [q("J", 2, team="a", prio=LOW, t=NOW - 300), q("K", 2, team="c", prio=HIGH, t=NOW - 30)]
    coming = view(gpus, queue, [b0, leaving], teams)
    d = schedule(coming, CFG)
    assert d.waiting["J"].startswith("waiting for 2 GPUs being released by jobs that are stopping")
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("b0", "K")]
    off = PolicyConfig(aging_s=None, hold_freed_for_job=False)
    d = schedule(coming, off)
    assert d.waiting["K"].startswith("waiting for 2 GPUs being released") and d.evictions == []
    # A victim that did not checkpoint at SIGTERM frees its GPUs for whoever comes first:
    # a fitting job that took them could not have reclaimed a young borrower of that kind.
    plain = dataclasses.replace(leaving, checkpoints_at_stop=False)
    d = schedule(view(gpus, queue, [b0, plain], teams), CFG)
    assert d.waiting["K"].startswith("waiting for 2 GPUs being released") and d.evictions == []
    # Once they are free, for one cycle (`ClusterView.freed_for`): J starts on them.
    by_b = {"n0/2": Freed("J", "b"), "n0/3": Freed("J", "b")}
    freed = dataclasses.replace(view(gpus, queue, [b0], teams), freed_for=by_b)
    d = schedule(freed, CFG)
    assert placed(d) == {"J": ("n0/2", "n0/3")} and [e.job_id for e in d.evictions] == ["b0"]
    assert placed(schedule(freed, off)) == {"K": ("n0/2", "n0/3")}
    # Not for a job beyond its team's quota: a's job of 4 GPUs borrows.
    big = [q("J", 4, team="a", prio=LOW, t=NOW - 300), queue[1]]
    d = schedule(dataclasses.replace(freed, queued=big), CFG)
    assert placed(d) == {"K": ("n0/2", "n0/3")}
    # Nor GPUs its own team's victim frees (its team's own order: its quota is the same).
    own = dataclasses.replace(freed, freed_for={"n0/2": Freed("J", "a"), "n0/3": Freed("J", "a")})
    assert placed(schedule(own, CFG)) == {"K": ("n0/2", "n0/3")}
    mine = dataclasses.replace(leaving, team="a")
    d = schedule(view(gpus, queue, [b0, mine], teams), CFG)
    assert d.waiting["K"].startswith("waiting for 2 GPUs being released") and d.evictions == []


def test_gpus_freed_for_a_job_that_never_runs_on_spot_are_only_those_it_can_use() -> None:
    """Trace 2's 3-minute wait (jittered) in miniature: b's borrower leaves for a's job J,
    which never runs on spot, from one fixed and one spot GPU. Only the fixed one is J's:
    the spot one, held for J, was held for nobody, and c's job K, which fits in c's quota
    and comes first (c's share is the smaller), waited for a running job's end instead."""
    teams = [Team("a", 2, borrow_limit=4), Team("b", 1, borrow_limit=4), Team("c", 1, borrow_limit=4)]
    gpus = node_gpus("n0", 3) + node_gpus("s", 1, "spot")
    leaving = dataclasses.replace(
        r("b1", ["n0/1", "s/0"], team="b", prio=NORMAL, preemptible=False, ckpt_at_stop=True),
        leaving_for="J",
    )
    running = [r("a0", ["n0/2"], team="a", prio=NORMAL), r("b0", ["n0/0"], team="b", prio=NORMAL), leaving]
    queue = [
        q("J", 1, team="a", prio=NORMAL, t=NOW - 300, spot="never"),
        q("K", 1, team="c", prio=NORMAL, t=NOW - 30),
    ]
    d = schedule(view(gpus, queue, running, teams), CFG)
    coming = "waiting for 1 GPU being released by jobs that are stopping; 1 GPU held for it"
    assert placed(d) == {} and d.evictions == []
    assert d.waiting == {"J": coming, "K": coming}
    # Once free (`ClusterView.freed_for`, one cycle): J starts on the fixed GPU, K on spot.
    by_b = {"n0/1": Freed("J", "b"), "s/0": Freed("J", "b")}
    freed = dataclasses.replace(view(gpus, queue, running[:2], teams), freed_for=by_b)
    assert placed(schedule(freed, CFG)) == {"J": ("n0/1",), "K": ("s/0",)}


def test_quota_under_head_is_refused_with_easy_backfill() -> None:
    with pytest.raises(ConfigError, match="quota_under_head and easy_backfill do not go together"):
        PolicyConfig(quota_under_head=True, easy_backfill=True)


def test_starving_job_holds_free_gpus_when_configured() -> None:
    gpus = node_gpus("n0", 4)
    running = [r("busy", ["n0/0", "n0/1"], prio=NORMAL)]
    queue = [q("old-big", 4, t=NOW - 5 * 3600), q("small", 1, t=NOW - 60)]
    d = schedule(view(gpus, queue, running), CFG)
    assert set(placed(d)) == {"small"}  # backfill
    cfg = PolicyConfig(reserve_after_s=4 * 3600, aging_s=None)
    d = schedule(view(gpus, queue, running), cfg)
    assert placed(d) == {}
    assert "waiting for a long time, so 2 free GPUs are held for it" in d.waiting["old-big"]


def test_backfill_off_blocks_behind_the_first_waiting_job() -> None:
    running = [r("busy", ["n0/0", "n0/1"], prio=HIGH)]
    queue = [q("big", 4, t=0), q("small", 1, t=1)]
    d = schedule(view(node_gpus("n0", 4), queue, running), PolicyConfig(backfill=False, aging_s=None))
    assert placed(d) == {} and d.waiting["small"] == "waiting behind job big (backfill is off)"
    d = schedule(view(node_gpus("n0", 4), queue, running), CFG)
    assert set(placed(d)) == {"small"}


# --------------------------------------------------------------------------- spot and placement


def spot_cluster(spot_up: bool = True) -> list[Gpu]:
    return node_gpus("own", 2) + node_gpus("od", 2, "on_demand") + node_gpus("spot", 2, "spot", up=spot_up)


@pytest.mark.parametrize(
    ("spot", "n", "expected"),
    [
        ("allowed", 2, ("own/0", "own/1")),
        ("allowed", 4, ("spot/0", "spot/1", "own/0", "own/1")),
        ("preferred", 2, ("spot/0", "spot/1")),
        ("never", 4, ("own/0", "own/1", "od/0", "od/1")),
    ],
)
def test_spot_placement_order(spot: SpotPolicy, n: int, expected: tuple[str, ...]) -> None:
    d = schedule(view(spot_cluster(), [q("j", n, spot=spot)]), PolicyConfig(same_node=False))
    assert sorted(placed(d)["j"]) == sorted(expected)


def test_allowed_takes_on_demand_last() -> None:
    d = schedule(view(spot_cluster(), [q("j", 5)]), PolicyConfig(same_node=False))
    assert sum(g.startswith("od/") for g in placed(d)["j"]) == 1


def test_spot_never_never_lands_on_spot() -> None:
    running = [r("x", ["own/0", "own/1", "od/0", "od/1"], prio=HIGH)]
    d = schedule(view(spot_cluster(), [q("j", 1, spot="never")], running), CFG)
    assert placed(d) == {}
    assert d.waiting["j"].startswith(
        "waiting for 1 GPU: 0 free (not counting 2 spot, which this job never uses)"
    )


def test_preferred_falls_back_when_spot_is_down() -> None:
    d = schedule(view(spot_cluster(spot_up=False), [q("j", 2, spot="preferred")]), CFG)
    assert placed(d)["j"] == ("own/0", "own/1")


def test_one_gpu_type_when_possible() -> None:
    gpus = [Gpu("n0/0", "n0", "A"), Gpu("n0/1", "n0", "B"), Gpu("n0/2", "n0", "B"), Gpu("n0/3", "n0", "A")]
    d = schedule(view(gpus, [q("j", 2)]), CFG)
    assert placed(d)["j"] in (("n0/0", "n0/3"), ("n0/1", "n0/2"))


def test_same_node_packing_best_fit_and_spanning_fewest_nodes() -> None:
    gpus = node_gpus("n0", 4) + node_gpus("n1", 4) + node_gpus("n2", 4)
    running = [r("x", ["n0/0"], prio=HIGH), r("y", ["n1/0", "n1/1"], prio=HIGH)]
    d = schedule(view(gpus, [q("two", 2)], running), CFG)
    assert placed(d)["two"] == ("n1/2", "n1/3")  # the tightest node that fits
    d = schedule(view(gpus, [q("five", 5)], running), CFG)
    assert d.waiting["five"].startswith("can never run: needs 5 GPUs on one node but the largest node has 4")
    d = schedule(view(gpus, [q("five", 5)], running), PolicyConfig(same_node=False))
    nodes = {g.split("/")[0] for g in placed(d)["five"]}
    assert nodes in ({"n2", "n0"}, {"n2", "n1"}) and len(placed(d)["five"]) == 5


def test_node_cpu_and_memory_limits() -> None:
    gpus = node_gpus("n0", 4) + node_gpus("n1", 4)
    nodes = {"n0": Node("n0", cpus=8, memory_gb=64), "n1": Node("n1", cpus=32, memory_gb=256)}
    job = PendingJob("j", "a", NORMAL, 2, 0.0, cpus=16, memory_gb=32)
    d = schedule(view(gpus, [job], nodes=nodes), CFG)
    assert {g.split("/")[0] for g in placed(d)["j"]} == {"n1"}


# --------------------------------------------------------------------------- reasons and odd input


def test_not_before_is_honoured() -> None:
    d = schedule(view(node_gpus("n0", 2), [q("j", not_before=NOW + 42)]), CFG)
    assert placed(d) == {} and d.waiting["j"] == "retry back-off until t=100042 s (in 42 s)"
    d = schedule(view(node_gpus("n0", 2), [q("j", not_before=1_800_000_042.0)], now=1_800_000_000.0), CFG)
    assert d.waiting["j"] == "retry back-off until 08:00:42 UTC (in 42 s)"
    d = schedule(view(node_gpus("n0", 2), [q("j", not_before=NOW)]), CFG)
    assert "j" in placed(d)


def test_impossible_jobs_are_reported_not_looped() -> None:
    teams = [Team("a", 2, borrow_limit=1)]
    queue = [q("huge", 100, team="b"), q("nonspot", 3, spot="never", team="b"), q("quota", 4, team="a")]
    d = schedule(
        view(node_gpus("n0", 2) + node_gpus("s", 8, "spot"), queue, teams=teams),
        PolicyConfig(same_node=False),
    )
    assert d.waiting["huge"].startswith("can never run: needs 100 GPUs but the cluster has 10 GPUs")
    assert d.waiting["nonspot"].startswith("can never run: needs 3 GPUs but the cluster has 2 non-spot GPUs")
    assert d.waiting["quota"].startswith("can never run: needs 4 GPUs but team a may use at most 3")


def test_cpu_only_job_starts_without_gpus() -> None:
    d = schedule(view([], [q("cpu", 0)]), CFG)
    assert placed(d) == {"cpu": ()}


def test_fair_share_by_weighted_dominant_share() -> None:
    teams = [Team("a", 0, borrow_limit=8, weight=2.0), Team("b", 0, borrow_limit=8, weight=1.0)]
    queue = [q(f"a{i}", team="a", t=i) for i in range(6)] + [q(f"b{i}", team="b", t=i) for i in range(6)]
    d = schedule(view(node_gpus("n0", 6), queue, teams=teams), CFG)
    got = sorted(placed(d))
    assert got == ["a0", "a1", "a2", "a3", "b0", "b1"]


def test_fair_share_counts_the_dominant_resource() -> None:
    # b uses few GPUs but most of the memory: a goes first.
    teams = [Team("a", 0, borrow_limit=8), Team("b", 0, borrow_limit=8)]
    nodes = {"n0": Node("n0", cpus=64, memory_gb=100)}
    running = [ActiveJob("bm", "b", NORMAL, ("n0/0",), NOW - 3600, memory_gb=80)]
    queue = [q("b1", team="b", t=0), q("a1", team="a", t=5)]
    d = schedule(view(node_gpus("n0", 2), queue, running, teams, nodes=nodes), CFG)
    assert placed(d) == {"a1": ("n0/1",)}


def test_las_order_puts_fresh_jobs_before_ones_that_already_ran() -> None:
    queue = [q("ran", t=0, attained_gpu_s=7200.0), q("fresh", t=10)]
    assert set(placed(schedule(view(node_gpus("n0", 1), queue), CFG))) == {"fresh"}
    fifo_cfg = PolicyConfig(order="fifo", aging_s=None)
    assert set(placed(schedule(view(node_gpus("n0", 1), queue), fifo_cfg))) == {"ran"}


def test_remaining_gpu_time_by_the_limit() -> None:
    assert remaining_gpu_s(2, 3600.0, 1800.0) == 5400.0
    assert remaining_gpu_s(1, None, 1800.0) is None
    assert remaining_gpu_s(1, 600.0, 600.0) == 600.0  # its limit used up: what it received
    assert remaining_gpu_s(1, 600.0, 5000.0) == 5000.0


def test_srpt_order_starts_the_job_with_the_least_gpu_time_left_by_its_limit() -> None:
    srpt = PolicyConfig(order="srpt")
    # Both fresh: the later job with the shorter limit goes first ("las" keeps submission order).
    queue = [q("long", t=0, max_runtime_s=8 * 3600.0), q("short", t=10, max_runtime_s=3600.0)]
    assert set(placed(schedule(view(node_gpus("n0", 1), queue), srpt))) == {"short"}
    assert set(placed(schedule(view(node_gpus("n0", 1), queue), CFG))) == {"long"}
    # GPU-time, not hours: 2 GPUs x 1 h left is more than 1 GPU x 1.5 h.
    queue = [q("wide", t=0, gpus=2, max_runtime_s=3600.0), q("narrow", t=10, max_runtime_s=5400.0)]
    assert set(placed(schedule(view(node_gpus("n0", 2), queue), srpt))) == {"narrow"}
    # What a job received counts down its limit: preempted 7 h into an 8 h limit, it has 1 h
    # left, less than a fresh job's 2 h (under "las" the fresh one goes first).
    queue = [
        q("ran", t=0, attained_gpu_s=7 * 3600.0, max_runtime_s=8 * 3600.0),
        q("fresh", t=10, max_runtime_s=7200.0),
    ]
    assert set(placed(schedule(view(node_gpus("n0", 1), queue), srpt))) == {"ran"}
    assert set(placed(schedule(view(node_gpus("n0", 1), queue), CFG))) == {"fresh"}
    # Without limits it is "las": what a job received is its expected remaining time.
    queue = [q("ran", t=0, attained_gpu_s=7200.0), q("fresh", t=10)]
    assert set(placed(schedule(view(node_gpus("n0", 1), queue), srpt))) == {"fresh"}
    # A limit understated (never enforced) does not keep a job first: past it, a job counts
    # what it received (3 h), behind a fresh job with 2 h.
    queue = [
        q("overran", t=0, attained_gpu_s=3 * 3600.0, max_runtime_s=60.0),
        q("fresh", t=10, max_runtime_s=7200.0),
    ]
    assert set(placed(schedule(view(node_gpus("n0", 1), queue), srpt))) == {"fresh"}


def test_srpt_plans_a_job_without_a_limit_with_its_history_and_a_limit_comes_first() -> None:
    srpt = PolicyConfig(order="srpt")
    # No limit, but the runs of its spec before it took an hour: ahead of a 2 h limit. With
    # no history it would count what it received (nothing) and go first anyway, so the
    # history job is the one that has run a while.
    queue = [
        q("limited", t=0, max_runtime_s=7200.0),
        q("known", t=10, attained_gpu_s=1800.0, expected_runtime_s=3600.0),
    ]
    assert set(placed(schedule(view(node_gpus("n0", 1), queue), srpt))) == {"known"}
    # Its history says 4 h (3.5 h left): behind the 2 h limit.
    queue[1] = q("known", t=10, attained_gpu_s=1800.0, expected_runtime_s=4 * 3600.0)
    assert set(placed(schedule(view(node_gpus("n0", 1), queue), srpt))) == {"limited"}
    # The owner's limit comes before the history: 1 h limit, 9 h history, 2 h for the other.
    queue = [
        q("other", t=0, max_runtime_s=7200.0),
        q("both", t=10, max_runtime_s=3600.0, expected_runtime_s=9 * 3600.0),
    ]
    assert set(placed(schedule(view(node_gpus("n0", 1), queue), srpt))) == {"both"}


def test_las_preemption_evicts_a_job_of_its_team_and_class_past_the_threshold_for_a_fresh_one() -> None:
    """Tiresias' two queues within a team and class: a job that has had less than
    `las_threshold_gpu_s` GPU-seconds evicts one that has had more, and says why."""
    cfg = PolicyConfig(aging_s=None)
    assert cfg.las_preemption and cfg.las_threshold_gpu_s == 3250.0  # on by default
    old = r("old", ["n0/0"], started=NOW - 3600, attained=3600.0, ckpt_at_stop=True)
    fresh = q("fresh", t=NOW - 60)
    d = schedule(view(node_gpus("n0", 1), [fresh], [old]), cfg)
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("old", "fresh")]
    assert d.evictions[0].reason == (
        "preempted for job fresh of its team and class: this job has had over 0.9 GPU-hours and "
        "that one less (least attained service first); it resumes from its checkpoint"
    )
    assert d.waiting["fresh"].startswith("preempting 1 job (old)")
    # At its team's limit too: the team gives its own GPU to the fresh job.
    limited = [Team("a", 1)]
    d = schedule(view(node_gpus("n0", 1), [fresh], [old], limited), cfg)
    assert [e.job_id for e in d.evictions] == ["old"]


@pytest.mark.parametrize(
    ("running", "waiting", "teams", "cfg", "why"),
    [
        (
            r("old", ["n0/0"], attained=3600.0, ckpt_at_stop=True),
            q("f"),
            (),
            PolicyConfig(aging_s=None, las_preemption=False),
            "switched off",
        ),
        (
            r("old", ["n0/0"], attained=3000.0, ckpt_at_stop=True),
            q("f"),
            (),
            PolicyConfig(aging_s=None),
            "the victim is under the threshold",
        ),
        (
            r("old", ["n0/0"], attained=9000.0, ckpt_at_stop=True),
            q("f", attained_gpu_s=3300.0),
            (),
            PolicyConfig(aging_s=None),
            "the waiting job is past it too",
        ),
        (
            r("old", ["n0/0"], team="b", attained=9000.0, ckpt_at_stop=True),
            q("f"),
            (Team("a", 0, 1), Team("b", 1)),
            PolicyConfig(aging_s=None),
            "another team's, within its quota",
        ),
        (
            r(
                "old",
                ["n0/0"],
                prio=LOW,
                attained=9000.0,
                ckpt_at_stop=True,
                submitted=NOW - 12000,
                started=NOW - 4000,
            ),
            q("f"),
            (),
            PolicyConfig(aging_s=3600.0),
            "a low job that aging let in defends with normal",
        ),
        (
            r("old", ["n0/0"], started=NOW - 3000, attained=9000.0, ckpt_at_stop=True),
            q("f"),
            (),
            PolicyConfig(aging_s=None),
            "under the threshold in this allocation",
        ),
        (
            r("old", ["n0/0"], attained=9000.0, ckpt=NOW - 3400),
            q("f"),
            (),
            PolicyConfig(aging_s=None),
            "it would lose more than the threshold",
        ),
        (
            r("old", ["n0/0"], attained=9000.0, ckpt_at_stop=True, submitted=NOW - 9000),
            q("f"),
            (),
            PolicyConfig(aging_s=None, reserve_after_s=7200.0),
            "the starvation guard would restart it first",
        ),
    ],
)
def test_las_preemption_leaves_alone(
    running: ActiveJob, waiting: PendingJob, teams: tuple[Team, ...], cfg: PolicyConfig, why: str
) -> None:
    d = schedule(view(node_gpus("n0", 1), [waiting], [running], teams), cfg)
    assert d.evictions == [], why
    assert placed(d) == {}, why


def test_within_a_class_a_job_evicts_only_if_it_starts_before_its_victims_start_again() -> None:
    """A victim of the job's own team and class goes back to the queue in the pass its
    team's quota puts it in. Within the nominal quota it would start again, in the entitled
    pass, before a job that borrows: the eviction would only be repeated (in the benchmark a
    32-GPU job evicted 129 jobs that way before it started)."""
    old = r("old", ["n0/0", "n0/1"], attained=9000.0, ckpt_at_stop=True)
    big = q("big", 4, t=NOW - 60)
    cfg = PolicyConfig(aging_s=None)
    # Nominal 2: without its victim the team holds 0, so `big` (4) would borrow, while the
    # victim (2) would be back within the nominal, first.
    borrowing = schedule(view(node_gpus("n0", 4), [big], [old], [Team("a", 2, 8)]), cfg)
    assert borrowing.evictions == [] and placed(borrowing) == {}
    # Nominal 4: `big` is entitled too, and goes first (least attained service).
    entitled = schedule(view(node_gpus("n0", 4), [big], [old], [Team("a", 4, 8)]), cfg)
    assert [e.job_id for e in entitled.evictions] == ["old"]


def test_las_preemption_loses_little_without_a_checkpoint_at_stop() -> None:
    # No checkpoint at SIGTERM: evicted 200 s after its last periodic checkpoint, it loses
    # 200 GPU-seconds, under the threshold: it may go.
    recent = r("old", ["n0/0"], attained=9000.0, ckpt=NOW - 200)
    d = schedule(view(node_gpus("n0", 1), [q("f")], [recent]), PolicyConfig(aging_s=None))
    assert [e.job_id for e in d.evictions] == ["old"]
    # Once it has run, the evicted job waits: it is past the threshold, so it evicts nothing.
    back = q("old", t=0, attained_gpu_s=9000.0)
    now_running = r("f", ["n0/0"], started=NOW - 4000, attained=4000.0, ckpt_at_stop=True)
    d = schedule(view(node_gpus("n0", 1), [back], [now_running]), PolicyConfig(aging_s=None))
    assert d.evictions == [] and placed(d) == {}


def test_srpt_preemption_evicts_a_job_of_the_same_class_with_far_more_time_left() -> None:
    # "las" preemption off: the long job has run past its threshold, which alone would let
    # any fresh job of its class evict it (tested on its own below).
    cfg = PolicyConfig(order="srpt", srpt_preemption=True, aging_s=None, las_preemption=False)
    # 10 h limit, 1 h done: 9 GPU-hours left against the waiting job's 1 h (more than twice).
    long = r("long", ["n0/0"], started=NOW - 3600, limit=36000.0, attained=3600.0)
    short = q("short", t=NOW - 60, max_runtime_s=3600.0)
    d = schedule(view(node_gpus("n0", 1), [short], [long]), cfg)
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("long", "short")]
    assert d.waiting["short"].startswith("preempting 1 job (long)")
    # Not twice as much left (1.5 h against 1 h), no limit on either side, another team,
    # or the switch off: it waits.
    close = r("close", ["n0/0"], started=NOW - 3600, limit=9000.0, attained=3600.0)
    unknown = r("unknown", ["n0/0"], started=NOW - 3600, attained=3600.0)
    teams = [Team("a", 1), Team("b", 1)]
    other = r("other", ["n0/0"], team="b", started=NOW - 3600, limit=36000.0, attained=3600.0)
    for running, c, ts in (
        (close, cfg, ()),
        (unknown, cfg, ()),
        (other, cfg, teams),
        (long, PolicyConfig(order="srpt", aging_s=None, las_preemption=False), ()),
    ):
        assert schedule(view(node_gpus("n0", 1), [short], [running], ts), c).evictions == []
    no_limit = q("short", t=NOW - 60)
    assert schedule(view(node_gpus("n0", 1), [no_limit], [long]), cfg).evictions == []
    # Once evicted, the long job does not take its GPU back: its 9 h left are never less
    # than half of what the short one has left.
    back = q("long", t=0, attained_gpu_s=3600.0, max_runtime_s=36000.0)
    running = r("short", ["n0/0"], started=NOW - 700, limit=3600.0, attained=700.0)
    assert schedule(view(node_gpus("n0", 1), [back], [running]), cfg).evictions == []
    # A running job past its limit counts as ending now: never an "srpt" victim (were it to
    # count what it ran, it would be evicted again after every restart; the livelock test
    # found that).
    overran = r("overran", ["n0/0"], started=NOW - 3 * 3600, limit=60.0, attained=3 * 3600.0)
    assert schedule(view(node_gpus("n0", 1), [short], [overran]), cfg).evictions == []


def test_aging_lifts_order_and_protects_the_aged_job() -> None:
    cfg = PolicyConfig(aging_s=3600)
    queue = [q("old-low", prio=LOW, t=NOW - 3 * 3600), q("new-normal", prio=NORMAL, t=NOW - 10)]
    assert set(placed(schedule(view(node_gpus("n0", 1), queue), cfg))) == {"old-low"}
    assert set(placed(schedule(view(node_gpus("n0", 1), queue), CFG))) == {"new-normal"}
    # once started after that wait it is not preempted by a normal job, only by a high one
    running = [r("old-low", ["n0/0"], prio=LOW, started=NOW - 1800, submitted=NOW - 3 * 3600 - 1800)]
    assert schedule(view(node_gpus("n0", 1), [q("n", prio=NORMAL)], running), cfg).evictions == []
    assert len(schedule(view(node_gpus("n0", 1), [q("h", prio=HIGH)], running), cfg).evictions) == 1
    # aging never lifts into the top class
    queue = [q("ancient", prio=LOW, t=0.0), q("high", prio=HIGH, t=NOW - 1)]
    assert set(placed(schedule(view(node_gpus("n0", 1), queue), cfg))) == {"high"}


def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="order must be 'fifo', 'las' or 'srpt'"):
        PolicyConfig(order="sjf")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="min_runtime_s"):
        PolicyConfig(min_runtime_s=-1)
    with pytest.raises(ConfigError, match="aging_s must be a positive"):
        PolicyConfig(aging_s=0)


# --------------------------------------------------------------------------- FIFO baseline


def test_fifo_blocks_behind_the_first_job_and_ignores_priority_and_quota() -> None:
    running = [r("busy", ["n0/0", "n0/1"], prio=LOW)]
    teams = [Team("a", 0, borrow_limit=0)]
    queue = [q("first", 4, t=0), q("high", 1, prio=HIGH, t=1), q("ok", 1, t=2)]
    d = fifo(view(node_gpus("n0", 4), queue, running, teams))
    assert d.placements == [] and d.evictions == []
    assert d.waiting == {
        "first": "waiting for 4 GPUs: 2 free",
        "high": "waiting behind job first (first come, first served)",
        "ok": "waiting behind job first (first come, first served)",
    }
    d = fifo(view(node_gpus("n0", 4), queue[1:], running, teams))
    assert set(placed(d)) == {"high", "ok"}  # no quota: team a has 0 GPUs and still runs


def test_fifo_skips_backoff_and_impossible_jobs() -> None:
    queue = [q("later", not_before=NOW + 5, t=0), q("huge", 64, t=1), q("ok", 2, t=2)]
    d = fifo(view(node_gpus("n0", 2), queue))
    assert placed(d) == {"ok": ("n0/0", "n0/1")}
    assert d.waiting["later"].startswith("retry back-off") and d.waiting["huge"].startswith("can never run")


# --------------------------------------------------------------------------- invariants


LIMITS = [None, None, 600.0, 3600.0, 36000.0]
ORDERS: list[Order] = ["las", "fifo", "srpt"]


@st.composite
def random_views(draw: st.DrawFn) -> tuple[ClusterView, PolicyConfig]:
    n_nodes = draw(st.integers(1, 4))
    gpus: list[Gpu] = []
    for k in range(n_nodes):
        cls: PriceClass = draw(st.sampled_from(["owned", "on_demand", "spot"]))
        up = draw(st.booleans()) if cls == "spot" else True
        gpus += node_gpus(f"n{k}", draw(st.integers(1, 4)), cls, up)
    teams = [
        Team(t, draw(st.integers(0, 6)), draw(st.integers(0, 6)), draw(st.sampled_from([0.5, 1.0, 2.0])))
        for t in "ab"
    ]
    free = [g.id for g in gpus]
    running: list[ActiveJob] = []
    for i in range(draw(st.integers(0, 6))):
        if not free:
            break
        take = free[: draw(st.integers(1, min(3, len(free))))]
        free = free[len(take) :]
        running.append(
            r(
                f"r{i}",
                take,
                team=draw(st.sampled_from("abc")),
                prio=draw(st.sampled_from([LOW, NORMAL, HIGH])),
                started=NOW - draw(st.sampled_from([10, 700, 5000])),
                ckpt=draw(st.sampled_from([None, NOW - 30, NOW - 900])),
                preemptible=draw(st.booleans()),
                limit=draw(st.sampled_from(LIMITS)),
                attained=float(draw(st.integers(0, 3)) * 1000),
                ckpt_at_stop=draw(st.booleans()),
            )
        )
    queued = [
        q(
            f"q{i}",
            draw(st.integers(0, 9)),
            team=draw(st.sampled_from("abc")),
            prio=draw(st.sampled_from([LOW, NORMAL, HIGH])),
            t=NOW - draw(st.integers(0, 20_000)),
            spot=draw(st.sampled_from(["never", "allowed", "preferred"])),
            not_before=draw(st.sampled_from([0.0, 0.0, NOW + 30])),
            attained_gpu_s=float(draw(st.integers(0, 3)) * 1000),
            max_runtime_s=draw(st.sampled_from(LIMITS)),
            checkpoints_at_stop=draw(st.booleans()),
        )
        for i in range(draw(st.integers(0, 12)))
    ]
    # Victims on their way out for a queued job, and free GPUs just freed for one.
    ids = [j.id for j in queued] or ["gone"]
    running = [
        j if j.preemptible else dataclasses.replace(j, leaving_for=draw(st.sampled_from([None, *ids])))
        for j in running
    ]
    freed_for = {
        g: Freed(draw(st.sampled_from(ids)), draw(st.sampled_from("abc")))
        for g in free
        if draw(st.booleans())
    }
    cfg = PolicyConfig(
        same_node=draw(st.booleans()),
        backfill=draw(st.booleans()),
        order=(order := draw(st.sampled_from(ORDERS))),
        srpt_preemption=order == "srpt" and draw(st.booleans()),
        max_evictions_per_cycle=draw(st.integers(0, 3)),
        reserve_after_s=draw(st.sampled_from([None, 3600.0])),
        top_class_preempts_young=draw(st.booleans()),
        las_preemption=draw(st.booleans()),
        las_threshold_gpu_s=draw(st.sampled_from([1500.0, 3250.0])),
        reclaim_preempts_young=draw(st.booleans()),
        quota_under_head=draw(st.booleans()),
        holds_yield_to_quota=draw(st.booleans()),
        hold_freed_for_job=draw(st.booleans()),
    )
    return dataclasses.replace(view(gpus, queued, running, teams), freed_for=freed_for), cfg


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_views())
def test_invariants(vc: tuple[ClusterView, PolicyConfig]) -> None:
    v, cfg = vc
    for d in (schedule(v, cfg), fifo(v, same_node=cfg.same_node)):
        by_id = {g.id: g for g in v.gpus}
        held = {gid for j in v.running for gid in j.gpu_ids}
        queued = {j.id: j for j in v.queued}
        seen: set[str] = set()
        for p in d.placements:
            job = queued[p.job_id]
            assert len(p.gpu_ids) == job.gpus
            for gid in p.gpu_ids:
                g = by_id[gid]
                assert g.up, "placed on a down GPU"
                assert gid not in held and gid not in seen, "double-booked GPU"
                assert not (job.spot == "never" and g.spot), "spot: never job on spot"
                seen.add(gid)
            assert job.not_before <= v.now
            if cfg.same_node and p.gpu_ids:
                assert len({by_id[g].node for g in p.gpu_ids}) == 1
        # every queued job: placed, or waiting with a reason, never both
        assert set(placed(d)) | set(d.waiting) == set(queued)
        assert not set(placed(d)) & set(d.waiting)
        assert all(reason for reason in d.waiting.values())
    d = schedule(v, cfg)
    running = {j.id: j for j in v.running}
    for e in d.evictions:
        victim = running[e.job_id]
        # Young victims only as tenants: a lower class of the preemptor's own team that
        # started while it waited (no class jumping, preemption.py); or of a lower class
        # than a preemptor of the top class, with `top_class_preempts_young`.
        head = queued.get(e.for_job or "")
        tenant = (
            head is not None
            and victim.team == head.team
            and victim.priority < head.priority
            and victim.started_at >= head.submitted_at
        )
        for_top = (
            cfg.top_class_preempts_young
            and head is not None
            and head.priority == max(cfg.priorities.values())
            and victim.priority < head.priority
        )
        # ...or, with `reclaim_preempts_young`, another team's borrower below the top class
        # that checkpoints at SIGTERM (it loses only the grace period).
        nominal = v.teams[victim.team].nominal_gpus if victim.team in v.teams else 0
        reclaimed = (
            cfg.reclaim_preempts_young
            and head is not None
            and victim.checkpoints_at_stop
            and victim.team != head.team
            and victim.priority < max(cfg.priorities.values())
            and sum(len(j.gpu_ids) for j in v.running if j.team == victim.team) > nominal
        )
        young_ok = tenant or for_top or reclaimed
        assert victim.preemptible and (v.now - victim.started_at >= cfg.min_runtime_s or young_ok)
        assert e.for_job in queued and e.reason and head is not None
        if victim.team == head.team and victim.priority >= head.priority:
            # Within a team and class only "srpt" preemption evicts, and only a job with more
            # than twice the waiting job's GPU-time left by its limit; or "las" preemption,
            # and only a job that has received the threshold's GPU-time, that much in this
            # allocation, for a job that has not.
            assert victim.priority == head.priority
            t = cfg.las_threshold_gpu_s
            since = victim.started_at if victim.last_checkpoint_at is None else victim.last_checkpoint_at
            las = (
                cfg.las_preemption
                and head.attained_gpu_s < t <= victim.attained_gpu_s
                and len(victim.gpu_ids) * (v.now - victim.started_at) >= t
                and (
                    victim.checkpoints_at_stop
                    or len(victim.gpu_ids) * (v.now - max(since, victim.started_at)) <= t
                )
            )
            if not las:
                assert cfg.order == "srpt" and cfg.srpt_preemption
                assert victim.max_runtime_s is not None
                left = len(victim.gpu_ids) * victim.max_runtime_s - victim.attained_gpu_s
                own = remaining_gpu_s(head.gpus, head.max_runtime_s, head.attained_gpu_s)
                assert own is not None and left > 2 * own
    assert len(d.evictions) <= cfg.max_evictions_per_cycle
    # No team beyond nominal + borrow because of this cycle's placements. Its quota counts
    # the jobs that are not on their way out (as Kueue releases a preempted workload's quota
    # once it is evicted): jobs leaving from an earlier cycle are not preemptible in the view,
    # and this cycle's victims leave too, so their GPUs may go to the team's next job while
    # they checkpoint.
    evicted = {e.job_id for e in d.evictions}
    for name, team in v.teams.items():
        staying = sum(
            len(j.gpu_ids) for j in v.running if j.team == name and j.preemptible and j.id not in evicted
        )
        added = sum(queued[p.job_id].gpus for p in d.placements if queued[p.job_id].team == name)
        if added:
            assert staying + added <= team.nominal_gpus + team.borrow_limit
