"""The cost ledger's arithmetic: GPU-hours and money per job and team, from the store's
allocation rows and the price catalog.

An allocation is one GPU held by one attempt from `start` to `end` (now, while it runs). Its
price is the catalog's per-GPU-hour price for its type and price class. Work *lost* to a
preemption or a spot interruption is the GPU time between the job's last checkpoint before
the attempt ended (or the attempt's start, without one) and its end: the part that will be
computed again. What spot *saved* is what the spot GPU-hours would have cost on demand.
A report `since` a time counts only the GPU time from then on (as `cost report --since`
says): an allocation that started earlier counts from `since`, its lost work too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from visionloop.core.errors import ConfigError
from visionloop.sched.prices import PriceCatalog
from visionloop.sched.records import LabellingCost

CURRENCY = "USD"  # the catalog's prices are USD per GPU-hour


class _Allocation(Protocol):
    job_id: int
    team: str
    attempt: int
    gpu_type: str
    price_class: str
    start: float
    end: float | None
    outcome: str | None


@dataclass
class CostLine:
    gpu_hours: float = 0.0
    cost: float = 0.0
    lost_gpu_hours_preemption: float = 0.0
    lost_gpu_hours_interruption: float = 0.0
    spot_gpu_hours: float = 0.0
    spot_saved: float = 0.0
    by_price_class: dict[str, float] = field(default_factory=dict)  # GPU-hours

    def add(self, other: CostLine) -> None:
        self.gpu_hours += other.gpu_hours
        self.cost += other.cost
        self.lost_gpu_hours_preemption += other.lost_gpu_hours_preemption
        self.lost_gpu_hours_interruption += other.lost_gpu_hours_interruption
        self.spot_gpu_hours += other.spot_gpu_hours
        self.spot_saved += other.spot_saved
        for k, v in other.by_price_class.items():
            self.by_price_class[k] = self.by_price_class.get(k, 0.0) + v


@dataclass
class CostReport:
    currency: str
    total: CostLine
    by_team: dict[str, CostLine]
    by_job: dict[int, CostLine]
    # GPU types the catalog has no price for: their hours count, at no cost, and the report
    # says so instead of failing (`jobs show` must work before the catalog is complete).
    unpriced: list[str] = field(default_factory=list)
    # What labelling cost, per dataset version it produced (`visionloop data add
    # --cost-per-image`), oldest first; with its total per team, apart from the GPU lines.
    labelling: list[LabellingCost] = field(default_factory=list)
    labelling_by_team: dict[str, float] = field(default_factory=dict)
    labelling_total: float = 0.0


def _price(catalog: PriceCatalog, gpu_type: str, price_class: str, unpriced: set[str]) -> float:
    try:
        return catalog.per_gpu_hour(gpu_type, price_class)  # type: ignore[arg-type]
    except ConfigError:
        unpriced.add(f"{gpu_type} ({price_class})")
        return 0.0


def _line(
    a: _Allocation,
    catalog: PriceCatalog,
    now: float,
    checkpoints: dict[int, list[float]],
    unpriced: set[str],
    since: float | None = None,
) -> CostLine:
    end = a.end if a.end is not None else now
    start = a.start if since is None else max(a.start, since)
    hours = max(0.0, end - start) / 3600.0
    price = _price(catalog, a.gpu_type, a.price_class, unpriced)
    line = CostLine(gpu_hours=hours, cost=hours * price, by_price_class={a.price_class: hours})
    if a.price_class == "spot":
        line.spot_gpu_hours = hours
        line.spot_saved = hours * max(0.0, _price(catalog, a.gpu_type, "on_demand", unpriced) - price)
    if a.outcome in ("preempted", "interrupted", "lost") and a.end is not None:
        saved = [t for t in checkpoints.get(a.job_id, []) if a.start <= t <= a.end]
        last = max(saved) if saved else a.start
        lost = max(0.0, a.end - max(last, start)) / 3600.0
        if a.outcome == "interrupted":
            line.lost_gpu_hours_interruption = lost
        else:
            line.lost_gpu_hours_preemption = lost
    return line


def summarise(
    allocations: Iterable[_Allocation],
    catalog: PriceCatalog,
    now: float,
    checkpoints: dict[int, list[float]] | None = None,
    since: float | None = None,
) -> CostReport:
    total = CostLine()
    by_team: dict[str, CostLine] = {}
    by_job: dict[int, CostLine] = {}
    unpriced: set[str] = set()
    for a in allocations:
        line = _line(a, catalog, now, checkpoints or {}, unpriced, since)
        total.add(line)
        by_team.setdefault(a.team, CostLine()).add(line)
        by_job.setdefault(a.job_id, CostLine()).add(line)
    return CostReport(
        currency=CURRENCY, total=total, by_team=by_team, by_job=by_job, unpriced=sorted(unpriced)
    )


def cost_report(
    store: Any,
    catalog: PriceCatalog,
    *,
    team: str | None = None,
    since: float | None = None,
    job_id: int | None = None,
    now: float | None = None,
) -> CostReport:
    import time

    rows = store.allocations(team=team, since=since, job_id=job_id)
    jobs = {r.job_id for r in rows}
    checkpoints = {j: [c.at for c in store.checkpoints(j)] for j in jobs}
    report = summarise(rows, catalog, time.time() if now is None else now, checkpoints, since)
    if job_id is None:  # a job's own cost is its GPU time
        report.labelling = store.labelling_costs(team=team, since=since)
        for entry in report.labelling:
            report.labelling_by_team[entry.team] = report.labelling_by_team.get(entry.team, 0.0) + entry.cost
        report.labelling_total = sum(report.labelling_by_team.values())
    return report
