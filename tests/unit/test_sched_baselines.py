"""The baselines the queue is measured against (Slurm multifactor + EASY backfill + preempt/qos,
Kueue's ClusterQueues in a cohort, Tiresias' discretized 2D-LAS): single cycles checked by hand
against what their documentation and source say, and whole simulations in which every decision
is checked by the simulator."""

from __future__ import annotations

import random

import pytest

from visionloop.sched.sim import (
    ClusterSpec,
    NodeSpec,
    SimConfig,
    TraceJob,
    default_cluster,
    simulate,
    spot_trace,
)
from visionloop.sched.sim.kueue import Kueue, KueueConfig
from visionloop.sched.sim.slurm import Slurm, SlurmConfig
from visionloop.sched.sim.tiresias import Tiresias, TiresiasConfig
from visionloop.sched.view import ActiveJob, ClusterView, Gpu, PendingJob, Team

HIGH, NORMAL, LOW = 100, 50, 10
TEAMS = {"a": Team("a", 4, 4, 0.5), "b": Team("b", 4, 4, 0.5)}


def gpus(n: int) -> list[Gpu]:
    return [Gpu(f"n0/{i}", "n0", "fake") for i in range(n)]


def q(
    id: str, n: int, prio: int = NORMAL, t: float = 0.0, team: str = "a", attained: float = 0.0
) -> PendingJob:
    return PendingJob(id, team, prio, n, t, attained_gpu_s=attained)


def r(
    id: str, ids: range, prio: int = NORMAL, start: float = 0.0, attained: float = 0.0, leaving: bool = False
) -> ActiveJob:
    gpu_ids = tuple(f"n0/{i}" for i in ids)
    return ActiveJob(
        id, "a", prio, gpu_ids, start, attained_gpu_s=attained, submitted_at=start, preemptible=not leaving
    )


def view(now: float, n: int, running: list[ActiveJob], queued: list[PendingJob]) -> ClusterView:
    return ClusterView(now, gpus(n), TEAMS, running, queued)


# --------------------------------------------------------------------------- Slurm


def test_slurm_easy_backfill_starts_only_what_does_not_delay_the_blocked_job() -> None:
    # 8 GPUs; A (high: no one may preempt it) holds 4 until its limit at t=100. B (high, 8 GPUs)
    # is blocked: reserved at 100,
    # with no GPU to spare. C (2 GPUs, limit 50) ends at 60 and backfills; D (limit 500) would
    # end after 100 on GPUs B needs, so it waits.
    slurm = Slurm({"A": 100, "B": 10, "C": 50, "D": 500})
    d = slurm(view(10, 8, [r("A", range(4), HIGH)], [q("B", 8, HIGH), q("C", 2, t=1), q("D", 2, t=2)]))
    assert [p.job_id for p in d.placements] == ["C"] and d.evictions == []
    assert "delay its start at t=100 s" in d.waiting["D"] and "highest priority" in d.waiting["B"]


def test_slurm_backfill_may_use_gpus_the_reservation_does_not_need() -> None:
    # B needs 6 of the 8 at t=100: 2 to spare, so D (2 GPUs, long) starts; E (1 more) does not.
    slurm = Slurm({"A": 100, "B": 10, "D": 500, "E": 500})
    d = slurm(view(10, 8, [r("A", range(4), HIGH)], [q("B", 6, HIGH), q("D", 2, t=1), q("E", 1, t=2)]))
    assert [p.job_id for p in d.placements] == ["D"]
    assert "delay" in d.waiting["E"]


def test_slurm_preempt_qos_requeues_the_lowest_qos_then_smallest_and_only_what_is_needed() -> None:
    # 4 GPUs: L1 (low, 2 GPUs), L2 (low, 1 GPU), N (normal, 1 GPU). preempt/qos orders the
    # candidates by QOS, then size: L2, L1, N. For 1 GPU, the smallest low job goes.
    running = [r("L1", range(2), LOW), r("L2", range(2, 3), LOW), r("N", range(3, 4), NORMAL)]
    assert [e.job_id for e in Slurm({})(view(10, 4, running, [q("H", 1, HIGH)])).evictions] == ["L2"]
    # For 2: L2 alone frees too little, L2 + L1 fits, and then L2 is not needed: only L1 goes.
    slurm = Slurm({})
    d = slurm(view(10, 4, running, [q("H", 2, HIGH)]))
    assert [e.job_id for e in d.evictions] == ["L1"] and d.placements == []
    assert "requeued" in d.waiting["H"]
    # Next cycle, L1 is leaving: H waits for its GPUs and requeues nothing more.
    running[0] = r("L1", range(2), LOW, leaving=True)
    d = slurm(view(20, 4, running, [q("H", 2, HIGH)]))
    assert d.evictions == [] and "being released" in d.waiting["H"]


def test_slurm_backfill_preemption_requeues_for_a_job_that_ends_before_the_reservation() -> None:
    # 8 GPUs: A (high, 4, limit 100), L and L2 (low, 2 each, limit 1000). B (high, 8) is
    # blocked: it may requeue L and L2 but not A, and is reserved at 1000. C (normal, 2 GPUs,
    # limit 50) ends before that: real Slurm's backfill requeues L for it; the model does
    # only with the option.
    limits = {"A": 100, "L": 1000, "L2": 1000, "B": 500, "C": 50, "D": 5000}
    running = [r("A", range(4), HIGH), r("L", range(4, 6), LOW), r("L2", range(6, 8), LOW)]
    queue = [q("B", 8, HIGH), q("C", 2, t=1), q("D", 2, t=2)]
    d = Slurm(limits)(view(10, 8, running, queue))
    assert d.evictions == [] and "waiting behind job B" in d.waiting["C"]
    d = Slurm(limits, SlurmConfig(backfill_preemption=True))(view(10, 8, running, queue))
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("L", "C")]
    assert "requeued" in d.waiting["C"]
    # D would end after the reservation: it waits, and does not requeue L2.
    assert "waiting behind job B" in d.waiting["D"]


def test_slurm_does_not_preempt_for_an_equal_qos_and_honours_preempt_exempt_time() -> None:
    running = [r("N", range(4), NORMAL, start=0)]
    assert Slurm({})(view(10, 4, running, [q("M", 2, NORMAL)])).evictions == []
    exempt = Slurm({}, SlurmConfig(preempt_exempt_s=600))
    assert exempt(view(10, 4, [r("L", range(4), LOW)], [q("H", 2, HIGH)])).evictions == []
    assert [e.job_id for e in exempt(view(700, 4, [r("L", range(4), LOW)], [q("H", 2, HIGH)])).evictions] == [
        "L"
    ]


def test_slurm_fair_share_factor_is_two_to_the_minus_usage_over_shares() -> None:
    slurm = Slurm({}, SlurmConfig(decay_half_life_s=1000.0))
    slurm(view(0, 8, [r("A", range(4))], []))  # team a holds 4 GPUs from t=0
    v = view(1000, 8, [r("A", range(4))], [q("x", 1, team="a"), q("y", 1, team="b")])
    slurm(v)
    # a's usage: 4 GPUs x 1000 s (then decayed; b has none): U_a = 1, S_a = 0.5 -> 2^-2.
    assert slurm.usage["a"] == pytest.approx(4000.0)
    assert slurm.fairshare("a", v) == pytest.approx(0.25) and slurm.fairshare("b", v) == pytest.approx(1.0)
    # So b's job goes first, at the same QOS, size and age.
    assert slurm.priority(q("y", 1, team="b"), 1, v) - slurm.priority(
        q("x", 1, team="a"), 1, v
    ) == pytest.approx(10000 * 0.75)
    # Usage decays with the half-life. x and y started at t=1000, so a held 5 GPUs until 2000;
    # then nothing runs for 1000 s, which halves it.
    slurm(view(2000, 8, [], []))
    slurm(view(3000, 8, [], []))
    assert slurm.usage["a"] == pytest.approx((4000.0 * 0.5 + 5000.0) * 0.5)
    assert slurm.usage["b"] == pytest.approx(1000.0 * 0.5)


# --------------------------------------------------------------------------- Kueue


def rt(
    id: str, team: str, ids: range, prio: int = NORMAL, start: float = 0.0, leaving: bool = False
) -> ActiveJob:
    gpu_ids = tuple(f"n0/{i}" for i in ids)
    return ActiveJob(id, team, prio, gpu_ids, start, submitted_at=start, preemptible=not leaving)


def test_kueue_reclaims_borrowed_gpus_most_recently_admitted_first() -> None:
    # 8 GPUs, teams a and b with 4 each. b borrows: B1 (4 GPUs, admitted at 0) and B2 (2, at 10).
    # a is under its nominal quota, so its job reclaims (reclaimWithinCohort: Any), taking the
    # most recently admitted borrower first: B2 is enough.
    running = [rt("B1", "b", range(4)), rt("B2", "b", range(4, 6), start=10)]
    d = Kueue()(view(100, 8, running, [q("A", 4, team="a")]))
    assert [e.job_id for e in d.evictions] == ["B2"] and d.placements == []
    # A job that would then borrow may not reclaim (borrowWithinCohort: Never).
    d = Kueue()(view(100, 8, running, [q("A", 6, team="a")]))
    assert d.evictions == [] and "ClusterQueue a uses 0 of 4" in d.waiting["A"]


def test_kueue_preempts_lower_priority_within_its_cluster_queue_only() -> None:
    running = [rt("L", "b", range(4), LOW), rt("N", "a", range(4, 8), NORMAL)]
    d = Kueue()(view(100, 8, running, [q("H", 4, HIGH, team="b")]))
    assert [e.job_id for e in d.evictions] == ["L"]
    # a's normal job is not borrowing and in another queue: a high job of b cannot take it.
    running = [rt("N2", "b", range(4), HIGH), rt("N", "a", range(4, 8), NORMAL)]
    assert Kueue()(view(100, 8, running, [q("H", 4, HIGH, team="b")])).evictions == []


def test_kueue_admitted_job_keeps_its_quota_until_its_pods_start() -> None:
    # a's second job A (borrowing) is admitted by quota while X's GPUs are being released, so
    # its pods wait. When they come free, A's pods take them, before b's high job D, which
    # arrived meanwhile and would be admitted first if A had not been already.
    k = Kueue()
    a0, x = rt("A0", "a", range(4)), rt("X", "b", range(4, 8), leaving=True)
    d = k(view(130, 8, [a0, x], [q("A", 4, team="a", t=120)]))
    assert "admitted; its pods wait" in d.waiting["A"] and d.placements == []
    d = k(view(160, 8, [a0], [q("A", 4, team="a", t=120), q("D", 4, HIGH, team="b", t=150)]))
    assert [p.job_id for p in d.placements] == ["A"] and "D" in d.waiting


def test_kueue_never_reclaims_to_borrow() -> None:
    # Three queues of 4 in a 12-GPU cohort; b borrows 4 (B2, B3), 4 GPUs are free. a's 6-GPU
    # job would fit after reclaiming B3, but would then borrow: borrowWithinCohort Never.
    teams = {n: Team(n, 4, 8) for n in "abc"}
    running = [
        rt("B1", "b", range(4)),
        rt("B2", "b", range(4, 6), start=10),
        rt("B3", "b", range(6, 8), start=20),
    ]
    v = ClusterView(100, gpus(12), teams, running, [q("A", 6, team="a")])
    d = Kueue()(v)
    assert d.evictions == [] and "A" in d.waiting
    # Within its nominal quota it may: with no GPU free (C holds c's 4), a 4-GPU job takes the
    # most recently admitted borrowers, B3 then B2, and stops there (b is back at its nominal).
    v = ClusterView(100, gpus(12), teams, [*running, rt("C", "c", range(8, 12))], [q("A", 4, team="a")])
    assert [e.job_id for e in Kueue()(v).evictions] == ["B3", "B2"]


# --------------------------------------------------------------------------- Tiresias


def test_tiresias_demotes_past_the_threshold_and_preempts_for_queue_zero() -> None:
    # X has run 4 GPUs x 1000 s = 4000 GPU-s (past 3,250: queue 1). Y arrives (queue 0, 2 GPUs):
    # the allocation goes queue 0 first, so X (4 GPUs) no longer fits and is preempted.
    t = Tiresias()
    d = t(view(1000, 4, [r("X", range(4), attained=4000)], [q("Y", 2, t=1000)]))
    assert t.queue_of == {"X": 1, "Y": 0}
    assert [e.job_id for e in d.evictions] == ["X"] and d.placements == []
    assert "given 2 GPUs in queue 0" in d.waiting["Y"]


def test_tiresias_keeps_a_young_running_job_and_lets_a_small_job_pass_a_big_one() -> None:
    # R (queue 0, running) keeps its 4 GPUs; B (8 GPUs) does not fit in the 4 left; S (2) does.
    t = Tiresias()
    d = t(view(10, 8, [r("R", range(4), attained=100)], [q("B", 8, t=1), q("S", 2, t=2)]))
    assert d.evictions == [] and [p.job_id for p in d.placements] == ["S"]
    assert "queue 0" in d.waiting["B"]


def test_tiresias_never_preempts_a_running_job_for_a_waiting_one_of_the_same_queue() -> None:
    # P was submitted first but is waiting; R runs. Running jobs come first in their queue.
    t = Tiresias()
    running = [
        ActiveJob("R", "a", NORMAL, tuple(f"n0/{i}" for i in range(4)), 5, submitted_at=5, attained_gpu_s=20)
    ]
    d = t(view(10, 4, running, [q("P", 4, t=0)]))
    assert d.evictions == [] and d.placements == [] and "queue 0" in d.waiting["P"]


def test_tiresias_demoted_running_job_goes_behind_the_waiting_jobs_of_its_new_queue() -> None:
    # As run_sim.py's dlas-gpu: a job demoted while it runs is appended to the next queue,
    # behind the jobs already waiting there, and the queue is walked in that order.
    t = Tiresias(TiresiasConfig(reference_rounds=False))
    # W (queue 1: 5,000 GPU-s) runs; X arrives in queue 0 and takes the 4 GPUs.
    d = t(view(100, 4, [r("W", range(4), attained=5000)], [q("X", 4, t=100)]))
    assert [e.job_id for e in d.evictions] == ["W"]
    d = t(view(101, 4, [], [q("X", 4, t=100), q("W", 4, attained=5000)]))
    assert [p.job_id for p in d.placements] == ["X"]
    # X passes 3,250 GPU-s while it runs: demoted behind W, which gets the GPUs back.
    d = t(view(1000, 4, [r("X", range(4), start=101, attained=3596)], [q("W", 4, attained=5000)]))
    assert t.queues[1] == ["W", "X"]
    assert [e.job_id for e in d.evictions] == ["X"] and "given 4 GPUs in queue 1" in d.waiting["W"]


def test_tiresias_decides_only_when_its_authors_simulator_does() -> None:
    # run_sim.py decides at arrivals, completions and the demotion check it schedules after a
    # round: (3,250 - executed seconds) // GPUs later. A 16-GPU job started at 0 is checked at
    # 203 s (3,248 GPU-s: still queue 0), next at 203 + 3,047 // 16 = 393 s.
    t = Tiresias()
    w = q("W", 16, t=0, attained=5000)  # queue 1, waiting
    d = t(view(0, 16, [], [q("A", 16, t=0), w]))
    assert [p.job_id for p in d.placements] == ["A"] and t.next_round == 203
    running = lambda now: [r("A", range(16), attained=16 * now)]  # noqa: E731
    d = t(view(203, 16, running(203), [w]))
    assert t.queue_of["A"] == 0 and d.evictions == [] and t.next_round == 393
    # Past the threshold at 300 s, but no event: nothing is decided.
    d = t(view(300, 16, running(300), [w]))
    assert t.queue_of["A"] == 0 and d.evictions == [] and d.waiting["W"]
    d = t(view(393, 16, running(393), [w]))
    assert t.queue_of["A"] == 1 and [e.job_id for e in d.evictions] == ["A"]
    # Every cycle instead: demoted at the first cycle past the threshold.
    t = Tiresias(TiresiasConfig(reference_rounds=False))
    t(view(0, 16, [], [q("A", 16, t=0), w]))
    d = t(view(300, 16, running(300), [w]))
    assert t.queue_of["A"] == 1 and [e.job_id for e in d.evictions] == ["A"]


def test_tiresias_ignores_priority_classes() -> None:
    # A high-class job that arrives to a full cluster of queue-0 jobs waits: no classes.
    t = Tiresias()
    d = t(view(10, 4, [r("L", range(4), LOW, attained=40)], [q("H", 2, HIGH, t=5)]))
    assert d.evictions == [] and d.placements == []


# --------------------------------------------------------------------------- whole simulations


def random_trace(seed: int, n: int = 40) -> list[TraceJob]:
    rng = random.Random(seed)
    return [
        TraceJob(
            f"j{i}",
            rng.uniform(0, 7200),
            rng.choice([1, 1, 2, 4, 6, 8]),
            rng.uniform(60, 8000),
            rng.choice(["detection", "segmentation", "research"]),
            rng.choice(["low", "normal", "normal", "high"]),
            rng.choice(["never", "allowed", "preferred"]),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_baseline_finishes_every_job_with_only_valid_decisions(seed: int) -> None:
    spot = spot_trace("s", [1, 1, 0, 1, 1, 1, 0, 1] * 10, gap_s=900)
    cluster = ClusterSpec(
        (
            NodeSpec("a", 8, "fake"),
            NodeSpec("b", 4, "fake", "on_demand"),
            NodeSpec("s", 4, "fake", "spot", spot),
        ),
        default_cluster(gpus_per_node=2).teams,
    )
    trace = random_trace(seed)
    limits = {j.id: j.duration_s for j in trace}
    schedulers = (
        Slurm(limits),
        Slurm({k: 2 * v for k, v in limits.items()}),
        Kueue(),
        Kueue(KueueConfig(fair_sharing=True)),
        Tiresias(),
    )
    for scheduler in schedulers:
        # The simulator raises SimError on any decision the cluster cannot carry out.
        res = simulate(trace, cluster, scheduler, SimConfig(max_time_s=20 * 86400))
        assert res.unfinished == [], type(scheduler).__name__
        assert res.useful_gpu_s == pytest.approx(sum(j.gpus * j.duration_s for j in trace))


def test_easy_backfill_never_delays_the_reserved_job_when_limits_are_exact() -> None:
    # One 8-GPU node, no preemption, exact limits: the 8-GPU job J starts the moment the jobs
    # running when it was blocked have ended, whatever backfills around it.
    cluster = ClusterSpec((NodeSpec("n", 8, "fake"),))
    trace = [
        TraceJob("A", 0, 4, 1000, "t", "normal", "allowed"),
        TraceJob("B", 0, 2, 400, "t", "normal", "allowed"),
        TraceJob("J", 10, 8, 100, "t", "normal", "allowed"),
        *(TraceJob(f"s{i}", 20 + i, 2, 300 + 500 * (i % 3), "t", "normal", "allowed") for i in range(6)),
    ]
    slurm = Slurm({j.id: j.duration_s for j in trace}, SlurmConfig(preemption=False))
    res = simulate(trace, cluster, slurm, SimConfig())
    by_id = {j.id: j for j in res.jobs}
    assert by_id["J"].first_start == 1000  # when A ends; backfilled jobs ended by then
    starts = [by_id[f"s{i}"].first_start for i in range(6)]
    assert any(t is not None and t < 1000 for t in starts), starts  # some did backfill
