"""Reservations from progress with EASY backfill (`visionloop.sched.reservation`), through the
policy: where a blocked job's reservation falls, which later jobs may start around it, a
preemptible tenant stepping aside when the reservation falls due, and (hypothesis) that no
GPU is promised to two reservations or held by two jobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from visionloop.sched.policy import PolicyConfig, schedule
from visionloop.sched.view import ActiveJob, ClusterView, Gpu, PendingJob, Team

LOW, NORMAL, HIGH = 10, 50, 100
NOW = 100_000.0
HOUR = 3600.0
EASY = PolicyConfig(same_node=False, easy_backfill=True)
TENANTS = PolicyConfig(same_node=False, easy_backfill=True, reservation_tenants=True)


def gpus(n: int, node: str = "n0") -> list[Gpu]:
    return [Gpu(f"{node}/{i}", node, "fake") for i in range(n)]


def running(
    id: str,
    ids: Sequence[str],
    end: float | None,
    prio: int = NORMAL,
    started: float = NOW - HOUR,
    **kw: object,
) -> ActiveJob:
    return ActiveJob(id, "a", prio, tuple(ids), started, expected_end=end, **kw)  # type: ignore[arg-type]


def view(
    g: list[Gpu], queued: Sequence[PendingJob], run: Sequence[ActiveJob], now: float = NOW
) -> ClusterView:
    return ClusterView(now, g, {"a": Team("a", 100)}, list(run), list(queued))


def minute(t: float) -> float:
    return math.ceil(t / 60) * 60


def test_reservation_is_honoured_and_later_jobs_backfill_only_where_they_do_not_delay_it() -> None:
    g = gpus(10)
    # 4 GPUs come free in an hour (the running job's pace says so); 6 are free now.
    busy = running("r", [x.id for x in g[:4]], end=NOW + HOUR)
    head = PendingJob("head", "a", NORMAL, 8, submitted_at=0.0)
    long_ = PendingJob("long", "a", NORMAL, 2, submitted_at=1.0, max_runtime_s=2 * HOUR)
    short = PendingJob("short", "a", NORMAL, 2, submitted_at=2.0, max_runtime_s=HOUR / 2)
    unknown = PendingJob("unknown", "a", NORMAL, 2, submitted_at=3.0)
    v = view(g, [head, short, long_, unknown], [busy])

    d = schedule(v, EASY)
    # The head gets the 4 GPUs of the running job and 4 free ones, from its expected end.
    assert d.starts == {"head": minute(NOW + HOUR)}
    assert set(d.reserved["head"]) >= {x.id for x in g[:4]} and len(d.reserved["head"]) == 8
    assert d.waiting["head"] == (
        f"expected start t={minute(NOW + HOUR):.0f} s; waiting for 8 GPUs: 6 free; "
        "8 GPUs reserved for it as job r end"
    )
    placed = {p.job_id: set(p.gpu_ids) for p in d.placements}
    # 2 free GPUs the reservation does not need: the first job behind it takes them whatever
    # its length; the next one ends before the reservation starts, so it may use reserved
    # ones; the job with no time limit would delay it, and waits.
    assert set(placed) == {"short", "long"}
    spare = {x.id for x in g[4:]} - set(d.reserved["head"])
    assert placed["short"] <= set(d.reserved["head"]) and placed["long"] == spare
    assert "unknown" in d.waiting

    # Without EASY backfill (the default) the head is told the same expected start, but
    # nothing is held for it: the later jobs take every free GPU.
    d_off = schedule(v, PolicyConfig(same_node=False))
    assert {p.job_id for p in d_off.placements} == {"short", "long", "unknown"}
    assert d_off.starts == d.starts and d_off.reserved == d.reserved
    assert not schedule(v, PolicyConfig(same_node=False, reservations=False)).starts


def test_a_running_job_with_no_pace_plans_with_its_time_limit_else_the_default() -> None:
    g = gpus(4)
    head = PendingJob("head", "a", NORMAL, 4, submitted_at=0.0)
    limited = running("r", [x.id for x in g[:2]], end=None, started=NOW - 600, max_runtime_s=HOUR)
    d = schedule(view(g, [head], [limited]), EASY)
    assert d.starts == {"head": minute(NOW - 600 + HOUR)}
    # No pace, no limit: GPUs are still promised, but no start is made up.
    unknown = running("r", [x.id for x in g[:2]], end=None)
    d = schedule(view(g, [head], [unknown]), EASY)
    assert d.starts == {} and len(d.reserved["head"]) == 4
    assert d.waiting["head"].endswith(
        "4 GPUs reserved for it as job r end; its start is not known until job r reports its pace"
    )


def test_without_pace_or_limit_a_running_job_plans_with_its_history_and_backfill_too() -> None:
    g = gpus(4)
    head = PendingJob("head", "a", NORMAL, 4, submitted_at=0.0)
    hist = running("r", [x.id for x in g[:2]], end=None, started=NOW - 600, expected_runtime_s=HOUR)
    d = schedule(view(g, [head], [hist]), EASY)
    assert d.starts == {"head": minute(NOW - 600 + HOUR)}
    # A limit its owner gave comes first; a reported pace before both.
    both = running(
        "r",
        [x.id for x in g[:2]],
        end=None,
        started=NOW - 600,
        max_runtime_s=2 * HOUR,
        expected_runtime_s=HOUR,
    )
    assert schedule(view(g, [head], [both]), EASY).starts == {"head": minute(NOW - 600 + 2 * HOUR)}
    paced = running("r", [x.id for x in g[:2]], end=NOW + 60, expected_runtime_s=HOUR)
    assert schedule(view(g, [head], [paced]), EASY).starts == {"head": minute(NOW + 60)}
    # Backfill: a job whose history ends it before the head's start may use the head's free
    # GPUs; one whose history runs past it, or with none, may not.
    short = PendingJob("short", "a", NORMAL, 2, submitted_at=1.0, expected_runtime_s=HOUR / 4)
    long_ = PendingJob("long", "a", NORMAL, 2, submitted_at=2.0, expected_runtime_s=2 * HOUR)
    unknown = PendingJob("unknown", "a", NORMAL, 2, submitted_at=3.0)
    for later, starts in ((short, True), (long_, False)):
        d = schedule(view(g, [head, later], [hist]), EASY)
        assert ({p.job_id for p in d.placements} == {later.id}) is starts, later.id
    assert schedule(view(g, [head, long_, unknown], [hist]), EASY).placements == []


def test_a_tenant_starts_on_reserved_gpus_and_steps_aside_when_the_reservation_falls_due() -> None:
    g = gpus(8)
    head = PendingJob("head", "a", NORMAL, 8, submitted_at=0.0)
    tenant = PendingJob("tenant", "a", LOW, 4, submitted_at=10.0)
    busy = running("r", [x.id for x in g[:4]], end=NOW + HOUR)
    late = PendingJob("late", "a", LOW, 4, submitted_at=30.0, max_runtime_s=2 * HOUR)
    # Cycle 1: the head waits an hour for r; a low job with no time limit, and one whose
    # limit ends after that, would delay it, so plain backfill keeps both out; with tenants
    # the first of them starts on the 4 lent GPUs.
    assert schedule(view(g, [head, tenant, late], [busy]), EASY).placements == []
    d = schedule(view(g, [head, tenant, late], [busy]), TENANTS)
    assert [(p.job_id, set(p.gpu_ids)) for p in d.placements] == [("tenant", {x.id for x in g[4:]})]
    assert d.starts == {"head": minute(NOW + HOUR)}

    started = ActiveJob("tenant", "a", LOW, tuple(x.id for x in g[4:]), NOW, submitted_at=10.0)
    # Half an hour later r still runs: the reservation is not due, the tenant stays, and the
    # plan counts its GPUs as the head's (it will step aside), not its own expected end.
    later = view(g, [head], [busy, started], now=NOW + HOUR / 2)
    d = schedule(later, TENANTS)
    assert d.evictions == [] and d.starts == {"head": minute(NOW + HOUR)}
    assert "tenant tenant step aside then" in d.waiting["head"]
    # r has ended: the reservation is due and the tenant, young as it is, steps aside.
    due = view(g, [head], [started], now=NOW + HOUR + 60)
    d = schedule(due, TENANTS)
    assert [(e.job_id, e.for_job) for e in d.evictions] == [("tenant", "head")]
    assert "reservation is due" in d.evictions[0].reason and d.placements == []
    assert d.waiting["head"].startswith("its reservation is due: job tenant")
    assert d.reserved["head"] == tuple(sorted(x.id for x in g))


def test_a_job_ahead_of_the_head_in_its_class_is_no_tenant() -> None:
    """Only jobs queued behind the head step aside: an earlier job of its class that started
    while it waited started by right, so the plan waits for its expected end instead."""
    g = gpus(8)
    head = PendingJob("head", "a", NORMAL, 8, submitted_at=50.0)
    earlier = ActiveJob(
        "earlier",
        "a",
        NORMAL,
        tuple(x.id for x in g[4:]),
        NOW,
        submitted_at=10.0,
        expected_end=NOW + 2 * HOUR,
    )
    d = schedule(view(g, [head], [earlier], now=NOW + 60), TENANTS)
    assert d.evictions == [] and d.starts == {"head": minute(NOW + 2 * HOUR)}


def test_a_job_too_big_to_plan_does_not_keep_a_smaller_one_from_its_reservation() -> None:
    # Every GPU busy, ends known. The high job is promised 8 of the 10; the normal job's 6
    # cannot be planned on the 2 left (and, remembered, no later 6-GPU plan is tried this
    # cycle), but the low job's 2 can: a failure rules out only jobs at least as big.
    g = gpus(10)
    busy = [running(f"r{i}", [g[i].id], end=NOW + (i + 1) * HOUR, prio=HIGH) for i in range(10)]
    high = PendingJob("high", "a", HIGH, 8, submitted_at=0.0)
    normal = PendingJob("normal", "a", NORMAL, 6, submitted_at=1.0)
    normal2 = PendingJob("normal2", "a", NORMAL, 6, submitted_at=2.0)
    low = PendingJob("low", "a", LOW, 2, submitted_at=3.0)
    d = schedule(view(g, [high, normal, normal2, low], busy), PolicyConfig(same_node=False, preemption=False))
    assert set(d.reserved) == {"high", "low"}
    assert d.starts == {"high": minute(NOW + 8 * HOUR), "low": minute(NOW + 10 * HOUR)}
    assert not set(d.reserved["high"]) & set(d.reserved["low"])
    assert d.waiting["normal"] == "waiting for 6 GPUs: 0 free; behind 1 higher-priority job"
    assert d.waiting["normal2"] == d.waiting["normal"]


def test_a_job_beyond_its_teams_quota_gets_a_reservation_once_it_has_waited_the_aging_time() -> None:
    """Besides the first blocked job of each class, a job bigger than its team's nominal
    quota gets one after `aging_s` (3,600 s): the jobs that otherwise starve. The GPUs are
    promised in the cycle's order, so the second reservation comes after the first."""
    g = gpus(8)
    busy = [
        ActiveJob("r1", "b", HIGH, tuple(x.id for x in g[:4]), NOW - HOUR, expected_end=NOW + HOUR),
        ActiveJob("r2", "b", HIGH, tuple(x.id for x in g[4:]), NOW - HOUR, expected_end=NOW + 2 * HOUR),
    ]
    teams = {"a": Team("a", 2, 6), "b": Team("b", 16)}
    first = PendingJob("first", "b", NORMAL, 4, submitted_at=NOW - 10)  # entitled: considered first
    aged = PendingJob("aged", "a", NORMAL, 4, submitted_at=NOW - 2 * HOUR)  # 4 > nominal 2, 2 h
    fresh = PendingJob("fresh", "a", NORMAL, 4, submitted_at=NOW - 600)  # as big, 10 minutes
    d = schedule(ClusterView(NOW, g, teams, busy, [first, aged, fresh]), EASY)
    assert d.starts == {"first": minute(NOW + HOUR), "aged": minute(NOW + 2 * HOUR)}
    assert set(d.reserved["first"]) == {x.id for x in g[:4]} and set(d.reserved["aged"]) == {
        x.id for x in g[4:]
    }
    assert "expected start" not in d.waiting["fresh"]


# --------------------------------------------------------------------------- invariants


@st.composite
def random_views(draw: st.DrawFn) -> tuple[ClusterView, PolicyConfig]:
    g: list[Gpu] = []
    for k in range(draw(st.integers(1, 3))):
        g += gpus(draw(st.integers(1, 6)), f"n{k}")
    free = [x.id for x in g]
    run: list[ActiveJob] = []
    for i in range(draw(st.integers(0, 6))):
        if not free:
            break
        take = free[: draw(st.integers(1, min(4, len(free))))]
        free = free[len(take) :]
        run.append(
            ActiveJob(
                f"r{i}",
                draw(st.sampled_from("ab")),
                draw(st.sampled_from([LOW, NORMAL, HIGH])),
                tuple(take),
                NOW - draw(st.sampled_from([10, 700, 5000])),
                preemptible=draw(st.booleans()),
                submitted_at=NOW - draw(st.sampled_from([6000, 3000, 100])),
                expected_end=draw(st.sampled_from([None, NOW - 5, NOW + 600, NOW + 7200])),
                max_runtime_s=draw(st.sampled_from([None, 3600.0])),
            )
        )
    queued = [
        PendingJob(
            f"q{i}",
            draw(st.sampled_from("ab")),
            draw(st.sampled_from([LOW, NORMAL, HIGH])),
            draw(st.integers(1, 9)),
            submitted_at=NOW - draw(st.integers(0, 8000)),
            max_runtime_s=draw(st.sampled_from([None, 300.0, 3600.0, 10_000.0])),
        )
        for i in range(draw(st.integers(0, 12)))
    ]
    teams = {t: Team(t, draw(st.integers(0, 8)), draw(st.integers(0, 8))) for t in "ab"}
    cfg = PolicyConfig(
        same_node=draw(st.booleans()),
        easy_backfill=draw(st.booleans()),
        reservation_tenants=draw(st.booleans()),
        max_evictions_per_cycle=draw(st.integers(0, 4)),
    )
    return ClusterView(NOW, g, teams, run, queued), cfg


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_views())
def test_no_gpu_is_promised_twice_or_held_by_two_jobs(vc: tuple[ClusterView, PolicyConfig]) -> None:
    v, cfg = vc
    d = schedule(v, cfg)
    queued = {j.id: j for j in v.queued}
    held = {gid for j in v.running for gid in j.gpu_ids}
    promised: dict[str, str] = {}
    for job_id, ids in d.reserved.items():
        assert job_id in d.waiting and d.starts.get(job_id, v.now) >= v.now
        assert len(ids) == queued[job_id].gpus
        for gid in ids:
            assert gid not in promised, f"GPU {gid} promised to {promised.get(gid)} and {job_id}"
            promised[gid] = job_id
    seen: set[str] = set()
    for p in d.placements:
        job = queued[p.job_id]
        for gid in p.gpu_ids:
            assert gid not in held and gid not in seen, "GPU held by two jobs"
            seen.add(gid)
            owner = promised.get(gid)
            if owner is not None and owner in d.starts and cfg.easy_backfill and not cfg.reservation_tenants:
                # EASY: a job on a reserved GPU ends before the reservation starts (by its
                # time limit; else the plan counted the default end of a job placed first).
                assert v.now + (job.max_runtime_s or cfg.default_runtime_s) <= d.starts[owner]
    assert {p.job_id for p in d.placements} | set(d.waiting) == set(queued)
    assert len(d.evictions) <= cfg.max_evictions_per_cycle
