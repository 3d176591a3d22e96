"""Which GPU type and how many: every option's fit, time and cost, the cheapest that meets the
deadline and budget, and why each other option loses.

Cost is GPU-hours x price per GPU-hour from the price catalog (`sched.prices`), on-demand and
spot. A visionloop training job is always resumable (it checkpoints, and a spot interruption
resumes it from the latest checkpoint), so the recommendation is priced and chosen on spot;
on-demand is shown next to it for a job that cannot wait for spot capacity.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from visionloop.core.errors import SpecError, VisionloopError
from visionloop.sched.view import PriceClass
from visionloop.size.memory import MemoryEstimate
from visionloop.size.predict import TimePrediction


class NothingMeetsError(VisionloopError):
    """No GPU option meets the deadline and budget (or none fits at all)."""

    exit_code = 3


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*$", re.IGNORECASE)
_UNIT_HOURS = {"s": 1 / 3600, "m": 1 / 60, "h": 1.0, "d": 24.0, "": 1.0}


def parse_deadline(text: str) -> float:
    """`12h`, `90m`, `2d`, `3600s` or a bare number of hours → hours (> 0)."""
    match = _DURATION.match(text)
    hours = float(match.group(1)) * _UNIT_HOURS[match.group(2).lower()] if match else 0.0
    if not match or hours <= 0 or not math.isfinite(hours):
        raise SpecError(f"--deadline {text!r} is not a duration; give e.g. 12h, 90m, 2d or 3600s.")
    return hours


@dataclass(frozen=True)
class Option:
    """One GPU type at one count. `problem` says why it cannot run the job at all (empty when
    it can); `verdict` is filled by `recommend`: "recommended", or why it loses."""

    device: str
    gpus: int
    device_memory_gib: float
    memory: MemoryEstimate | None
    time: TimePrediction | None
    on_demand_usd: float | None
    spot_usd: float | None
    problem: str = ""
    verdict: str = ""

    @property
    def usable(self) -> bool:
        return not self.problem and self.time is not None

    @property
    def fits(self) -> bool:
        return self.memory is not None and self.memory.total_gib <= self.device_memory_gib

    def cost(self, price_class: PriceClass) -> float | None:
        return self.spot_usd if price_class == "spot" else self.on_demand_usd

    @property
    def label(self) -> str:
        return f"{self.gpus} x {self.device}"


def memory_problem(memory: MemoryEstimate, device_memory_gib: float) -> str:
    if memory.total_gib <= device_memory_gib:
        return ""
    return (
        f"does not fit: needs {memory.total_gib:.1f} GiB per GPU of {device_memory_gib:.1f} GiB "
        f"(batch {memory.batch_per_gpu} per GPU)"
    )


@dataclass(frozen=True)
class Recommendation:
    options: tuple[Option, ...]
    choice: Option | None
    price_class: PriceClass
    deadline_h: float | None
    budget_usd: float | None
    # When nothing meets: the option that came closest and what to change.
    closest: Option | None = None
    advice: str = ""


def money(usd: float | None) -> str:
    """Dollars with cents, or four decimals under a dollar (a small job costs fractions of a cent)."""
    if usd is None:
        return "-"
    return f"${usd:,.2f}" if usd >= 1 else f"${usd:.4f}"


def _round_up(usd: float) -> float:
    """Up to the shown precision, so that the budget advised does meet the price."""
    step = 0.01 if usd >= 1 else 0.0001
    return math.ceil(usd / step) * step


def _fmt_h(hours: float) -> str:
    return f"{hours:.2f} h" if hours < 10 else f"{hours:.1f} h"


def recommend(
    options: Sequence[Option],
    *,
    deadline_h: float | None,
    budget_usd: float | None,
    price_class: PriceClass = "spot",
) -> Recommendation:
    """The cheapest usable option that meets the deadline and budget (ties: the faster, then
    fewer GPUs), with a verdict on every option."""

    def cost(o: Option) -> float:
        c = o.cost(price_class)
        return math.inf if c is None else c

    def hours(o: Option) -> float:
        return o.time.hours if o.time is not None else math.inf

    usable = [o for o in options if o.usable]
    on_time = [o for o in usable if deadline_h is None or hours(o) <= deadline_h]
    meeting = [o for o in on_time if budget_usd is None or cost(o) <= budget_usd]
    choice = min(meeting, key=lambda o: (cost(o), hours(o), o.gpus)) if meeting else None

    judged: list[Option] = []
    for o in options:
        if o is choice:
            verdict = "recommended"
        elif o.problem:
            verdict = o.problem
        elif o.time is None:
            verdict = "no throughput figure for this precision"
        elif deadline_h is not None and hours(o) > deadline_h:
            verdict = f"too slow: {_fmt_h(hours(o))} > deadline {_fmt_h(deadline_h)}"
        elif budget_usd is not None and cost(o) > budget_usd:
            verdict = f"too expensive: {money(cost(o))} > budget {money(budget_usd)}"
        elif choice is not None and cost(o) > cost(choice):
            verdict = f"costs more: {money(cost(o))} vs {money(cost(choice))}"
        elif choice is not None:
            verdict = f"same cost, slower ({_fmt_h(hours(o))} vs {_fmt_h(hours(choice))}) or more GPUs"
        else:
            verdict = "meets the limits"
        judged.append(replace(o, verdict=verdict))
    chosen = next((o for o in judged if o.verdict == "recommended"), None)
    if chosen is not None:
        return Recommendation(tuple(judged), chosen, price_class, deadline_h, budget_usd)
    closest, advice = _closest(judged, usable, on_time, deadline_h, budget_usd, price_class)
    return Recommendation(tuple(judged), None, price_class, deadline_h, budget_usd, closest, advice)


def _closest(
    judged: list[Option],
    usable: list[Option],
    on_time: list[Option],
    deadline_h: float | None,
    budget_usd: float | None,
    price_class: PriceClass,
) -> tuple[Option | None, str]:
    by_key = {(o.device, o.gpus): o for o in judged}
    if not usable:
        fitting = [o for o in judged if o.memory is not None]
        if not fitting:
            return None, "no GPU type in the catalog can be priced or predicted; check the catalogs."
        # The one that misses its memory by the smallest factor.
        best = min(fitting, key=lambda o: o.memory.total_gib / o.device_memory_gib if o.memory else math.inf)
        assert best.memory is not None
        return best, (
            f"nothing fits: the closest is {best.label}, needing {best.memory.total_gib:.1f} GiB per GPU "
            f"of {best.device_memory_gib:.1f} GiB. Lower data.batch_size or data.image_size, use "
            "precision: bf16, or add a device with more memory to the catalog."
        )
    if not on_time:
        fastest = min(usable, key=lambda o: o.time.hours if o.time else math.inf)
        assert fastest.time is not None and deadline_h is not None
        return by_key[(fastest.device, fastest.gpus)], (
            f"no option finishes within {_fmt_h(deadline_h)}: the fastest is {fastest.label} at "
            f"{_fmt_h(fastest.time.hours)} ({money(fastest.cost(price_class))} on {price_class}). Raise "
            f"--deadline to at least {math.ceil(fastest.time.hours * 10) / 10:g}h, or train fewer epochs "
            "or at a smaller image size."
        )
    cheapest = min(on_time, key=lambda o: o.cost(price_class) or math.inf)
    price = cheapest.cost(price_class) or 0.0
    assert budget_usd is not None
    more = f" or relax --deadline from {_fmt_h(deadline_h)}" if deadline_h is not None else ""
    return by_key[(cheapest.device, cheapest.gpus)], (
        f"no option meeting the deadline costs at most {money(budget_usd)}: the cheapest is {cheapest.label} "
        f"at {money(price)} on {price_class}. Raise --budget to at least {money(_round_up(price))}"
        f"{more}, or train fewer epochs."
    )
