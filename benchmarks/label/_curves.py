"""The active-learning benchmarks' headline (selection.py, selection_detection.py): from each
strategy's learning curve (a metric per labelled-set size, per seed), the labels it needs to
first reach the value random sampling has at a budget, its ratio to random's own first
crossing, mean ± std over seeds, and the table that prints it."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

# An extra column: its header, and the value of one seed's curve at the budget.
Column = tuple[str, Callable[[dict[str, Any], int], float]]


def labels_needed(counts: list[int], values: list[float], target: float) -> int | None:
    """The first labelled-set size whose value reaches `target` (None: never)."""
    return next((n for n, v in zip(counts, values, strict=True) if v >= target), None)


def at(curve: dict[str, Any], labels: int, metric: str) -> float:
    value: float = curve[metric][curve["labels"].index(labels)]
    return value


def summarise(
    per_seed: list[dict[str, Any]],
    strategies: list[str],
    budget: int,
    metric: str,
    *,
    final: int,
    step: int,
    columns: tuple[Column, ...] = (),
) -> dict[str, Any]:
    """Labels needed to reach random's `metric` at `budget` labels, per strategy and seed. A
    strategy that never gets there within `final` counts as `final + step` in the means (so the
    means flatter it) and is counted in `never_reached`."""
    censored = final + step
    out: dict[str, Any] = {}
    for strategy in strategies:
        needed: list[int | None] = []
        ratios: list[float] = []
        for s in per_seed:
            curves = s["curves"]
            target = at(curves["random"], budget, metric)
            rnd = labels_needed(curves["random"]["labels"], curves["random"][metric], target)
            got = labels_needed(curves[strategy]["labels"], curves[strategy][metric], target)
            assert rnd is not None  # random reaches its own value at the budget
            needed.append(got)
            ratios.append((got if got is not None else censored) / rnd)
        counted = [n if n is not None else censored for n in needed]
        sd = statistics.stdev if len(per_seed) > 1 else (lambda _: 0.0)
        out[strategy] = {
            "labels_needed": needed,
            "labels_needed_mean": statistics.mean(counted),
            "labels_needed_std": sd(counted),
            "ratio_to_random": ratios,
            "ratio_mean": statistics.mean(ratios),
            "ratio_std": sd(ratios),
            "saving_vs_budget_mean": 1 - statistics.mean(counted) / budget,
            f"{metric}_at_budget_mean": statistics.mean(
                at(s["curves"][strategy], budget, metric) for s in per_seed
            ),
            **{
                f"{name}_at_budget_mean": statistics.mean(
                    value(s["curves"][strategy], budget) for s in per_seed
                )
                for name, value in columns
            },
            "never_reached": sum(n is None for n in needed),
        }
    return out


def print_table(
    summary: dict[str, Any], budget: int, metric: str, final: int, columns: tuple[str, ...] = ()
) -> None:
    extra = "".join(f" {c:>6}" for c in columns)
    print(
        f"\nto reach random's {metric} at {budget} labels (mean ± std over seeds; per seed in brackets)\n"
        f"{'strategy':<12} {'labels needed':>24} {'ratio to random':>16} {'saving':>7} {metric:>9}{extra}"
    )
    for strategy, m in summary.items():
        per = ",".join(str(n) if n is not None else f">{final}" for n in m["labels_needed"])
        mean, std = m["labels_needed_mean"], m["labels_needed_std"]
        print(
            f"{strategy:<12} {mean:>6.1f} ± {std:<5.1f} [{per}]".ljust(38)
            + f" {m['ratio_mean']:.3f} ± {m['ratio_std']:.3f} {m['saving_vs_budget_mean']:>7.1%}"
            + f" {m[f'{metric}_at_budget_mean']:>9.4f}"
            + "".join(f" {m[f'{c}_at_budget_mean']:>6.1f}" for c in columns)
            + (f"  (not reached in {m['never_reached']} seeds)" if m["never_reached"] else "")
        )
