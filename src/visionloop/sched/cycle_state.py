"""What one scheduling cycle knows and changes: the free GPUs and those being released, by
node; each team's standing (GPUs in use or reserved against its quota, its dominant share);
the victims it may choose; and the decision being built. The layers above (`preemption.py`,
`cycle.py`) change this state only through the actions here, so the accounting of GPUs,
quota and fair share lives in one place.

Nothing here outlives the cycle: the policy is a pure function of the `ClusterView`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from visionloop.sched.owed import owed_gpus
from visionloop.sched.placement import CLASS_ORDER, capacities, free_pool, held_by, take, usable
from visionloop.sched.view import (
    ActiveJob,
    ClusterView,
    Decision,
    Gpu,
    PendingJob,
    Placement,
    SpotPolicy,
    Team,
    planned_runtime_s,
)

if TYPE_CHECKING:
    from visionloop.sched.policy import PolicyConfig

_UNLIMITED = 1 << 40  # the borrow limit of a team without a configured quota


@dataclass
class TeamState:
    """A team's standing during one cycle: what it holds or has been given so far."""

    team: Team
    used: int = 0  # GPUs held (not counting jobs on their way out) + placed/claimed this cycle
    cpus: float = 0.0
    memory_gb: float = 0.0

    @property
    def limit(self) -> int:
        return self.team.nominal_gpus + self.team.borrow_limit

    def over_nominal(self, minus: int = 0) -> bool:
        return self.used - minus > self.team.nominal_gpus


class CycleState:
    """The state of one cycle, built from the view; see the module docstring."""

    def __init__(self, view: ClusterView, cfg: PolicyConfig) -> None:
        self.view, self.cfg, self.now = view, cfg, view.now
        self.decision = Decision()
        self.names = {rank: name for name, rank in cfg.priorities.items()}
        self.ranks = sorted(set(cfg.priorities.values()))
        self.top_rank = self.ranks[-1] if self.ranks else math.inf  # the top class's rank
        self.aged: dict[tuple[int, int], int] = {}  # memo of _aged()
        self.total_gpus = max(1, len(view.gpus))
        self.caps = capacities(view.gpus)
        self.free = free_pool(view)
        gpu_by_id = {g.id: g for g in view.gpus}
        # GPUs of jobs already on their way out: free soon, claimable now.
        self.releasing = held_by((j for j in view.running if not j.preemptible), gpu_by_id)
        self.free_count = dict.fromkeys(("owned", "on_demand", "spot"), 0)
        self.reserved_count = dict.fromkeys(("owned", "on_demand", "spot"), 0)  # free, but claimed or held
        for gs in self.free.values():
            for g in gs:
                self.free_count[g.price_class] += 1
        # GPUs owed to a queued job: free ones its victim just released, and those its
        # victims are still releasing (`ClusterView.freed_for`, `ActiveJob.leaving_for`). Only
        # it may take them (`Cycle._consider` opens them for it): else a job ahead of it in
        # the cycle's order takes what it evicted for, and it must evict again.
        self.owed = owed_gpus(view, self._free_ids(), gpu_by_id) if cfg.hold_freed_for_job else {}
        for free, coming in self.owed.values():
            self._reserve_free(free)
            take(self.releasing, coming)
        self.releasing_left = sum(len(gs) for gs in self.releasing.values())
        self.gpu_by_id = gpu_by_id
        # Node CPU/memory left, where the node declares limits.
        self.node_cpu: dict[str, float] = {n: nd.cpus for n, nd in view.nodes.items() if nd.cpus is not None}
        self.node_mem: dict[str, float] = {
            n: nd.memory_gb for n, nd in view.nodes.items() if nd.memory_gb is not None
        }
        self.total_cpus = sum(self.node_cpu.values())
        self.total_mem = sum(self.node_mem.values())
        self.teams: dict[str, TeamState] = {n: TeamState(t) for n, t in view.teams.items()}
        for j in view.running:
            self._share_nodes(j, sign=-1.0)
            if j.preemptible:
                ts = self._team(j.team)
                ts.used += len(j.gpu_ids)
                ts.cpus += j.cpus
                ts.memory_gb += j.memory_gb
        # Victims: old enough, not already leaving; lowest priority, then least work lost.
        self.victims = sorted(
            (j for j in view.running if j.preemptible and self.now - j.started_at >= cfg.min_runtime_s),
            key=self._victim_order,
        )
        # "srpt" preemption: each victim's GPU-time left by its limit, and the most of it
        # among a team's victims of each class (the cheap test before a search).
        self.srpt_left: dict[str, float] = {}
        # Each team's preemptible running jobs (preemption's `_borrowing`): built on first use.
        self.team_stacks: dict[str, list[ActiveJob]] = {}
        self.srpt_most: dict[tuple[str, float], float] = {}
        if cfg.order == "srpt" and cfg.srpt_preemption:
            # A running job past its limit counts as ending now (nothing left), not as one that
            # has run long: that would make it a victim again after every restart, for ever
            # (the least-attained-service livelock); its place in the queue, once it is back
            # there, is what `remaining_gpu_s` judges.
            for j in self.victims:
                if (runtime := planned_runtime_s(j)) is not None:
                    left = max(0.0, len(j.gpu_ids) * runtime - j.attained_gpu_s)
                    self.srpt_left[j.id] = left
                    k = (j.team, self._held_rank(j))
                    self.srpt_most[k] = max(self.srpt_most.get(k, -math.inf), left)
        # "las" preemption: the (team, class) pairs with a victim for it.
        self.las_old: set[tuple[str, int]] = set()
        if cfg.las_preemption:
            self.las_old = {(j.team, j.priority) for j in self.victims if self._las_victim(j)}
        # Running jobs too young to be victims, in victim order: the top class's extra
        # victims (`top_class_preempts_young`) and a reclaim's (`reclaim_preempts_young`);
        # not sorted when nothing would read them.
        self.top = self.top_rank if cfg.top_class_preempts_young else math.inf
        self.young = (
            sorted(
                (j for j in view.running if j.preemptible and self.now - j.started_at < cfg.min_runtime_s),
                key=self._victim_order,
            )
            if (self.top < math.inf or cfg.reclaim_preempts_young) and cfg.preemption
            else []
        )
        # The lowest class among jobs too young to preempt (for the reasons shown).
        self.young_min = min(
            (
                self._held_rank(j)
                for j in view.running
                if j.preemptible and self.now - j.started_at < cfg.min_runtime_s
            ),
            default=math.inf,
        )
        self.evicted: set[str] = set()
        # Per team, the GPUs, CPUs and memory of its jobs evicted this cycle, and of its
        # running jobs (preemption.py's `_next_share`).
        self.evicted_use: dict[str, list[float]] = {}
        self.running_use: dict[str, list[float]] | None = None
        self.evictions_left = cfg.max_evictions_per_cycle if cfg.preemption else 0
        self.claimants: list[PendingJob] = []  # jobs holding reserved GPUs, in order
        self.starving_id: str | None = None  # the long-blocked job that holds free GPUs
        self.blocker: PendingJob | None = None  # first blocked job when backfill is off
        self.behind: dict[str, PendingJob] = {}  # job -> its team's head it waits behind
        self.tenant_teams: set[str] = set()  # teams whose head looked for tenants (preemption.py)
        # `quota_under_head`: per team, its jobs behind a higher-class head that must borrow
        # which fit in its unused nominal quota (job, class)...
        self.unders: dict[str, list[tuple[PendingJob, int]]] = {}
        # ...by team and its next class up, which they go right after (under_head.py)...
        self.under_after: dict[tuple[str, int], list[tuple[PendingJob, int]]] = {}
        self.under_done: set[str] = set()  # ...those considered after their team's next class up...
        # ...and so may reclaim: job -> that class (its victims' must be lower: `_after_head`)
        self.under_head: dict[str, int] = {}
        # Free GPUs held idle (`_hold`) for a job whose team borrows with it: (job, GPUs), and
        # the ids of those such a job then took (`UnderHead._open_holds`).
        self.borrower_holds: list[tuple[PendingJob, list[Gpu]]] = []
        self.holds_taken: set[str] = set()
        # Each team's first job sent to the borrowing pass (job, class): its head.
        self.heads: dict[str, tuple[PendingJob, int]] = {}
        self.blocked: dict[int, int] = {}  # blocked jobs so far, by (effective) class
        self.fail_soon: dict[tuple[object, ...], int] = {}  # smallest job _soon() found no room for
        self.impossible: dict[tuple[SpotPolicy, int], str | None] = {}  # memo of impossible_reason()
        self.tails: dict[tuple[int, int, bool, int, int], str] = {}  # memo of _tail() per position
        self.tail_parts: dict[tuple[int, int, bool], tuple[str, str]] = {}  # memo of its fixed parts
        # memo of _wait(): (GPUs, spot, higher, same, young, reserved, claimants, head) -> reason
        self.reasons: dict[tuple[int, SpotPolicy, int, int, bool, int, int, str | None], str] = {}
        self.saturated = False
        # Reservations (reservation.py): GPUs promised to a waiting job, free ones lent out
        # until the reservation starts (GPU id -> (start, GPU, the job it is reserved for)),
        # and where the jobs started this cycle free their GPUs.
        self.reserved_for: dict[int, int] = {}  # effective class -> reservations made
        self.promised: dict[str, float] = {}  # GPU -> the start of the reservation it is promised to
        self.lend: dict[str, tuple[float, Gpu, PendingJob]] = {}
        self.placed_ends: list[tuple[float, str, bool, Sequence[Gpu]]] = []  # end, job, known?
        self.fail_lend: dict[tuple[object, ...], int] = {}
        self.may_hold: bool | None = None  # memo of Reservations._may_hold()
        self.version = 0  # bumped whenever a team's usage or the victims change
        self.victim_cache: tuple[int, float, bool] = (-1, math.inf, False)
        # Failure memos: the pools only shrink within a cycle, so a job shape that did not fit
        # will not fit later in the cycle either. Keys hold what decides fitting.
        self.fail_free: dict[tuple[object, ...], int] = {}
        self.fail_release: dict[tuple[object, ...], int] = {}
        self.fail_evict: dict[tuple[object, ...], int] = {}
        # (spot, nodes) -> the fewest GPUs a reservation found no plan for (`_plan`): with the
        # GPUs of a spot node down and the rest promised, thousands of jobs asked again.
        self.fail_plan: dict[tuple[object, ...], int] = {}

    # ----------------------------------------------------------------- bookkeeping

    def _team(self, name: str) -> TeamState:
        ts = self.teams.get(name)
        if ts is None:  # not configured: no entitlement, no limit (only what is idle)
            ts = self.teams[name] = TeamState(Team(name, 0, borrow_limit=_UNLIMITED))
        return ts

    def _open_owed(self, job: PendingJob) -> None:
        """Put the GPUs owed to `job` back in the free and releasing pools as it is
        considered; those it does not take stay there for the jobs after it."""
        owed = self.owed.pop(job.id, None)
        if owed is None:
            return
        free, coming = owed
        self._unreserve(free)
        for g in coming:
            self.releasing.setdefault(g.node, []).append(g)
        self.releasing_left += len(coming)
        self._pools_grew()

    def _reserve_free(self, gpus: Sequence[Gpu]) -> None:
        """Free GPUs out of the free pool, claimed or held for a job (`reserved_count`)."""
        take(self.free, gpus)
        for g in gpus:
            self.free_count[g.price_class] -= 1
            self.reserved_count[g.price_class] += 1

    def _unreserve(self, gpus: Sequence[Gpu]) -> None:
        """Reserved free GPUs back into the free pool (`_reserve_free` undone)."""
        for g in gpus:
            self.free.setdefault(g.node, []).append(g)
            self.free_count[g.price_class] += 1
            self.reserved_count[g.price_class] -= 1

    def _pools_grew(self) -> None:
        """The failure memos and `saturated` assume the pools only shrink within a cycle:
        forget them when GPUs go back in."""
        self.fail_free.clear()
        self.fail_release.clear()
        self.fail_evict.clear()
        self.fail_plan.clear()
        self.fail_lend.clear()
        self.saturated = False

    def _may_hold(self) -> bool:
        """Does a reservation keep its free GPUs from jobs that would delay it? Only if some
        queued job could still use them: one with a time limit (it may end first), or any
        job when tenants are on. Else holding them only idles them (with no time limits in
        the benchmark's traces, average completion time rose 34% on one trace): the plan is
        still made, for the expected start users see, and the cycle runs as without it."""
        if self.may_hold is None:
            cfg = self.cfg
            self.may_hold = cfg.easy_backfill and (
                cfg.reservation_tenants or any(planned_runtime_s(j) is not None for j in self.view.queued)
            )
        return self.may_hold

    def _las_victim(self, v: ActiveJob) -> bool:
        """May `v` step aside for a fresh job of its team and class ("las" preemption)? It
        holds that class as its own, not one aging gave it; it has received the threshold's
        GPU-time, that much in this allocation (so every allocation makes progress); and it
        loses little: it checkpoints when asked to stop, or has run less than the threshold
        since its last checkpoint (evicting jobs that lose their work since a periodic
        checkpoint cost 1,469 GPU-hours in the benchmark, against 127 without "las"
        preemption)."""
        t = self.cfg.las_threshold_gpu_s
        return (
            v.priority == self._held_rank(v)
            and v.attained_gpu_s >= t
            and len(v.gpu_ids) * (self.now - v.started_at) >= t
            and (v.checkpoints_at_stop or self._lost_gpu_s(v) <= t)
        )

    def _victim_order(self, j: ActiveJob) -> tuple[float, float, float, str]:
        """Victims are tried lowest class first, then least work lost (or fewest GPUs, with
        `victim_order = "smallest"`), then youngest."""
        second = len(j.gpu_ids) if self.cfg.victim_order == "smallest" else self._lost_gpu_s(j)
        return (self._held_rank(j), second, -j.started_at, j.id)

    def _lost_gpu_s(self, j: ActiveJob) -> float:
        since = j.started_at if j.last_checkpoint_at is None else max(j.started_at, j.last_checkpoint_at)
        return max(0.0, self.now - since) * len(j.gpu_ids)

    def _share_nodes(self, j: ActiveJob | PendingJob, sign: float, gpus: Sequence[Gpu] = ()) -> None:
        """Add (sign=+1) or take (-1) a job's CPUs/memory to the free amounts of its nodes,
        split by how many of its GPUs each node holds."""
        if not (self.node_cpu or self.node_mem) or not (j.cpus or j.memory_gb):
            return
        nodes = (
            [g.node for g in gpus]
            if gpus
            else [self.gpu_by_id[gid].node for gid in getattr(j, "gpu_ids", ()) if gid in self.gpu_by_id]
        )
        for node in nodes:
            if node in self.node_cpu:
                self.node_cpu[node] += sign * j.cpus / len(nodes)
            if node in self.node_mem:
                self.node_mem[node] += sign * j.memory_gb / len(nodes)

    def _node_cap(self, job: PendingJob) -> dict[str, int] | None:
        if not (self.node_cpu or self.node_mem) or job.gpus <= 0 or not (job.cpus or job.memory_gb):
            return None
        cap: dict[str, int] = {}
        for node in set(self.node_cpu) | set(self.node_mem):
            c = job.gpus
            if job.cpus and node in self.node_cpu:
                c = min(c, math.floor(self.node_cpu[node] / (job.cpus / job.gpus) + 1e-9))
            if job.memory_gb and node in self.node_mem:
                c = min(c, math.floor(self.node_mem[node] / (job.memory_gb / job.gpus) + 1e-9))
            cap[node] = max(0, c)
        return cap

    def _share(self, ts: TeamState) -> float:
        """A team's weighted dominant share, what the fair-share order goes by."""
        return self._dominant_share(ts.used, ts.cpus, ts.memory_gb, ts.team.weight)

    def _dominant_share(self, gpus: float, cpus: float, memory_gb: float, weight: float) -> float:
        """The largest of the cluster's GPUs, CPUs and memory that this much takes, over
        the team's weight."""
        s = gpus / self.total_gpus
        if self.total_cpus > 0:
            s = max(s, cpus / self.total_cpus)
        if self.total_mem > 0:
            s = max(s, memory_gb / self.total_mem)
        return s / max(weight, 1e-9)

    def _usable_free(self, spot: SpotPolicy) -> int:
        fc = self.free_count
        return fc["owned"] + fc["on_demand"] + (fc["spot"] if spot != "never" else 0)

    def _reserved_usable(self, spot: SpotPolicy) -> int:
        rc = self.reserved_count
        return rc["owned"] + rc["on_demand"] + (rc["spot"] if spot != "never" else 0)

    def _free_total(self) -> int:
        return sum(self.free_count.values())

    def _free_ids(self) -> set[str]:
        return {g.id for gs in self.free.values() for g in gs}

    def _prio(self, rank: int) -> str:
        return self.names.get(rank, str(rank))

    def _effective_priority(self, job: PendingJob) -> int:
        """The class a queued job is ordered in: its own, aged by its wait."""
        return self._aged(job.priority, self.now - job.submitted_at)

    def _held_rank(self, v: ActiveJob) -> int:
        """The class a running job defends its GPUs with: its own, aged by the wait before
        it started (so a job that aging let in is not preempted straight away by the class
        it was aged into). Aging never gives the right to preempt: waiting jobs use their
        own class for that."""
        if v.submitted_at is None:
            return v.priority
        return self._aged(v.priority, v.started_at - v.submitted_at)

    def _aged(self, rank: int, waited: float) -> int:
        if self.cfg.aging_s is None or waited < self.cfg.aging_s:
            return rank
        steps = int(waited // self.cfg.aging_s)
        aged = self.aged.get((rank, steps))
        if aged is None:
            ranks = self.ranks if rank in self.ranks else sorted(set(self.ranks) | {rank})
            i = ranks.index(rank)
            top = max(i, len(ranks) - 2)  # aging never lifts a job into the top class
            aged = self.aged[(rank, steps)] = ranks[min(i + steps, top)]
        return aged

    # ----------------------------------------------------------------- actions

    def _place(self, job: PendingJob, ts: TeamState, gpus: Sequence[Gpu]) -> None:
        take(self.free, gpus)
        for g in gpus:
            self.free_count[g.price_class] -= 1
        self._account(job, ts, gpus)
        self.decision.placements.append(Placement(job.id, tuple(g.id for g in gpus)))
        if self.cfg.reservations:  # a later reservation this cycle plans with its end
            runtime = planned_runtime_s(job)
            end = self.now + (runtime or self.cfg.default_runtime_s)
            self.placed_ends.append((end, job.id, runtime is not None, gpus))

    def _account(self, job: PendingJob, ts: TeamState, gpus: Sequence[Gpu] | None) -> None:
        """Count a placed or claimed job against its team (quota, fair share) and, when
        placed, against its nodes' CPU and memory."""
        ts.used += job.gpus
        ts.cpus += job.cpus
        ts.memory_gb += job.memory_gb
        self.version += 1
        if gpus is not None:
            self._share_nodes(job, sign=-1.0, gpus=gpus)

    def _claim(self, job: PendingJob, ts: TeamState, gpus: Sequence[Gpu]) -> None:
        """Reserve GPUs (free now, being released, or about to be freed by victims) for a job
        that will start on them in a later cycle."""
        free_ids = self._free_ids()
        free_now = [g for g in gpus if g.id in free_ids]
        self._reserve_free(free_now)
        before = sum(len(gs) for gs in self.releasing.values())
        take(self.releasing, [g for g in gpus if g.id not in free_ids])
        self.releasing_left -= before - sum(len(gs) for gs in self.releasing.values())
        self._account(job, ts, None)
        self.claimants.append(job)
        if free_now and ts.over_nominal() and job.id != self.starving_id and job.priority < self.top_rank:
            # A borrower's claim holds its free part idle as `_hold` does: the same hold,
            # open to another team's jobs that fit in their quota (`_open_holds`). Not the
            # top class's: its waits are the shortest of all and stay so.
            self.borrower_holds.append((job, free_now))

    def _hold(self, job: PendingJob, ts: TeamState, target: Sequence[Gpu] | None = None) -> int:
        """Hold free GPUs for a blocked job so that backfill stops taking them: the free
        GPUs it can use on the nodes of `target` (where it will run; free ones first, so
        fewer victims are needed), or without a target on its best node when it must fit on
        one, anywhere otherwise. At most as many as it needs; returns how many."""
        cand = {nd: [g for g in gs if usable(g, job.spot)] for nd, gs in self.free.items()}
        cand = {nd: gs for nd, gs in cand.items() if gs}
        if target is not None:
            nodes = {g.node for g in target}
            cand = {nd: gs for nd, gs in cand.items() if nd in nodes}
        elif self.cfg.same_node and cand:
            best = max(cand, key=lambda nd: (len(cand[nd]), nd))
            cand = {best: cand[best]}
        rank = {c: i for i, c in enumerate(CLASS_ORDER[job.spot])}
        held = sorted((g for gs in cand.values() for g in gs), key=lambda g: (rank[g.price_class], g.id))
        held = held[: job.gpus]
        if not held:
            return 0
        self._reserve_free(held)
        if job not in self.claimants:
            self.claimants.append(job)
            self._account(job, ts, None)  # its team's standing counts the reservation
            if ts.over_nominal() and job.id != self.starving_id:
                self.borrower_holds.append((job, held))
        return len(held)
