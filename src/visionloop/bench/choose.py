"""From a sweep to a serving config: the fastest configuration that meets a latency budget.

"Fastest" is the highest throughput. A request's latency under dynamic batching is at most
the time it waits for its batch to fill plus the compute of that batch, so the batcher may
hold a request for `budget - p99(compute at that batch size)`, floored at 0, and the p99 of a
full batch still fits. Only ONNX configurations qualify: the server serves ONNX.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from visionloop.bench.result import BatchPoint, BenchError, BenchResult, ConfigResult

if TYPE_CHECKING:
    from visionloop.serve.config import ServeConfig

SERVABLE_FORMATS = ("onnx",)


@dataclass(frozen=True)
class Candidate:
    config: ConfigResult
    point: BatchPoint

    @property
    def text(self) -> str:
        return (
            f"{self.config.label} at batch {self.point.batch_size}: p99 {self.point.p99_ms:.2f} ms, "
            f"{self.point.throughput_ips:,.0f} images/s"
        )


@dataclass(frozen=True)
class Choice:
    """What meets the budget (`best`, None if nothing does) and what came closest otherwise."""

    budget_ms: float
    best: Candidate | None
    queue_delay_ms: float
    fitting: int  # how many (configuration, batch size) points met the budget
    closest: Candidate | None  # when nothing fits: the lowest p99 among the servable points

    def explain(self) -> str:
        if self.best is not None:
            p99 = self.best.point.p99_ms
            return (
                f"chose {self.best.text}: the highest throughput of the {self.fitting} servable "
                f"point(s) whose p99 meets the {self.budget_ms:g} ms budget; max queue delay "
                f"{self.queue_delay_ms:.2f} ms = budget {self.budget_ms:g} - p99 {p99:.2f} ms."
            )
        if self.closest is None:
            return (
                f"no ONNX configuration was measured, so nothing can be served within {self.budget_ms:g} ms; "
                "export the model first (`visionloop export NAME/VERSION`) and include onnx in --formats."
            )
        return (
            f"nothing meets the {self.budget_ms:g} ms budget; the closest is {self.closest.text}. "
            "Raise the budget, add a smaller batch size or a cheaper precision (int8), or bench on a GPU."
        )


def servable_points(result: BenchResult) -> list[Candidate]:
    return [
        Candidate(c, p)
        for c in result.configs
        if c.status == "ok" and c.format in SERVABLE_FORMATS
        for p in c.points
    ]


def choose(result: BenchResult, budget_ms: float) -> Choice:
    if not budget_ms > 0:
        raise ValueError(f"a latency budget must be > 0 ms, got {budget_ms}")
    points = servable_points(result)
    fitting = [c for c in points if c.point.p99_ms <= budget_ms]
    if not fitting:
        closest = min(points, key=lambda c: c.point.p99_ms, default=None)
        return Choice(budget_ms, None, 0.0, 0, closest)
    # Highest throughput; at equal throughput, the lower tail latency.
    best = max(fitting, key=lambda c: (c.point.throughput_ips, -c.point.p99_ms))
    delay = max(0.0, budget_ms - best.point.p99_ms)
    return Choice(budget_ms, best, delay, len(fitting), None)


def serving_ref(result: BenchResult) -> str:
    """NAME/VERSION of the measured model: the version is pinned, because an alias could move
    to a model with other timings. The server serves registered models only."""
    if result.name is None or result.version is None:
        raise BenchError(
            f"{result.model} is not a registered model, and a serving config must name one; register "
            "it (`visionloop models register RUN_DIR --name NAME`), then bench NAME/VERSION."
        )
    return f"{result.name}/{result.version}"


def to_serve_config(result: BenchResult, choice: Choice) -> ServeConfig | None:
    """The serving config for `choice` (None when nothing met the budget). Threads are pinned
    when the sweep pinned them: the timings hold for that thread count."""
    from visionloop.serve.config import ServeConfig

    if choice.best is None:
        return None
    cfg, point = choice.best.config, choice.best.point
    return ServeConfig(
        model=serving_ref(result),
        format=cfg.format,
        precision=cfg.precision,
        device=cfg.device,
        max_batch_size=point.batch_size,
        # floored, not rounded: a rounded-up delay plus the p99 could exceed the budget
        max_queue_delay_ms=math.floor(choice.queue_delay_ms * 1000) / 1000,
        intra_op_threads=result.settings.threads or 0,
    )


def choose_config(result: BenchResult, budget_ms: float) -> ServeConfig | None:
    """The serving config of the fastest ONNX configuration whose p99 meets `budget_ms`, or
    None when nothing does (`choose(...).explain()` says why and what came closest)."""
    return to_serve_config(result, choose(result, budget_ms))
