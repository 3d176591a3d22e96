"""The task's primary metric per value of a per-image metadata column (`visionloop eval
--slices camera`), worst first, each with a bootstrap confidence interval.

Generic over tasks: the clean pass keeps every image's result (`run.score(keep_images=True)`,
one image per batch, reduced by `Task.image_result`), and a slice's metric is the task's own
evaluator over the results of its images (joined into batches by `Task.join_results`). Its
interval is the percentile bootstrap (Efron & Tibshirani 1993): `resamples` times, the slice's
images are drawn with replacement (an image drawn twice is given twice, as
`Task.repeated_targets` says), a fresh evaluator scores them, and the 2.5th and 97.5th
percentiles of the metric over the resamples bound the 95% interval.
Each slice's draws are seeded by the report's seed, the column and the value, so an interval
does not depend on which other slices there are, and the same seed gives the same intervals.

Bounds: a column may have at most `MAX_SLICE_VALUES` distinct values among the images scored
(a value per image is an id, not a slice); a slice's interval is bootstrapped from at most
`MAX_BOOTSTRAP_IMAGES` of its images (a seeded subsample: the interval is then wider than the
whole slice's would be, never narrower; `Slice.resampled` says how many), so one column costs
at most resamples x MAX_SLICE_VALUES x MAX_BOOTSTRAP_IMAGES evaluator updates. A slice of fewer
than `MIN_INTERVAL_IMAGES` images is reported with its count and metric but no interval, after
the slices that have one. Images without a value form one slice, `value` None ("(missing)").
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from visionloop.data.metadata import MISSING_LABEL, Scalar, value_key
from visionloop.eval.options import DEFAULT_RESAMPLES as DEFAULT_RESAMPLES
from visionloop.eval.run import ImageResult
from visionloop.tasks import Task

MIN_INTERVAL_IMAGES = 5
MAX_BOOTSTRAP_IMAGES = 1000
MAX_SLICE_VALUES = 50

CONFIDENCE = 0.95
BATCH = 256  # kept image results scored per evaluator update


@dataclass(frozen=True)
class Slice:
    """The images of one value of a column, and the primary metric over them."""

    value: Scalar | None  # None: the images without a value
    images: int
    metric: float | None  # None where the task's evaluator defines none (no ground truth)
    ci_low: float | None  # the 95% bootstrap interval; None below MIN_INTERVAL_IMAGES
    ci_high: float | None
    resampled: int  # images the interval was bootstrapped from (0: none)

    @property
    def label(self) -> str:
        return MISSING_LABEL if self.value is None else str(self.value)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _metric(
    task: Task,
    class_names: Sequence[str],
    results: Sequence[ImageResult],
    counts: Sequence[int] | np.ndarray | None = None,
) -> float | None:
    """The primary metric over `results`, each given `counts[i]` times (default once), scored
    by a fresh evaluator in batches of `BATCH` images (`Task.join_results`)."""
    evaluator = task.evaluator(class_names)
    batch: list[tuple[Any, Any]] = []
    loss = 0.0
    for i, r in enumerate(results):
        for copy in range(1 if counts is None else int(counts[i])):
            batch.append((r.outputs, task.repeated_targets(r.targets, copy)))
            loss += r.loss_sum
            if len(batch) == BATCH:
                evaluator.update(*task.join_results(batch), loss)
                batch, loss = [], 0.0
    if batch:
        evaluator.update(*task.join_results(batch), loss)
    value = evaluator.compute().metrics.get(task.primary_metric)
    if value is None or not math.isfinite(float(value)):
        return None
    return float(value)


def _rng(seed: int, column: str, value: Scalar | None) -> np.random.Generator:
    key = zlib.crc32(f"{column}\0{value_key(value)}".encode())
    return np.random.default_rng([seed % 2**63, key])


def bootstrap_interval(
    task: Task,
    class_names: Sequence[str],
    results: Sequence[ImageResult],
    *,
    resamples: int,
    rng: np.random.Generator,
) -> tuple[float | None, float | None, int]:
    """(low, high, images resampled) of the percentile bootstrap interval of the primary metric
    over `results`; (None, None, n) when fewer than half the resamples define the metric."""
    base = list(results)
    if len(base) > MAX_BOOTSTRAP_IMAGES:
        keep = np.sort(rng.choice(len(base), size=MAX_BOOTSTRAP_IMAGES, replace=False))
        base = [base[int(i)] for i in keep]
    n = len(base)
    values = []
    for _ in range(resamples):
        counts = np.bincount(rng.integers(0, n, size=n), minlength=n)
        value = _metric(task, class_names, base, counts)
        if value is not None:
            values.append(value)
    if len(values) * 2 < resamples:
        return None, None, n
    alpha = (1.0 - CONFIDENCE) / 2
    low, high = np.percentile(np.asarray(values), [100 * alpha, 100 * (1 - alpha)])
    return float(low), float(high), n


def compute_slices(
    task: Task,
    class_names: Sequence[str],
    results: Sequence[ImageResult],
    values: Sequence[Scalar | None],
    *,
    column: str,
    seed: int,
    resamples: int = DEFAULT_RESAMPLES,
) -> list[Slice]:
    """One `Slice` per distinct value of `values` (each image's value of `column`, aligned with
    `results`), worst first: those with an interval, then the smaller ones, then any whose
    metric is undefined."""
    if len(results) != len(values):
        raise ValueError(f"{len(results)} image results for {len(values)} values")
    groups: dict[str, list[int]] = {}
    first: dict[str, Scalar | None] = {}
    for i, value in enumerate(values):
        key = value_key(value)
        groups.setdefault(key, []).append(i)
        first.setdefault(key, value)
    slices = []
    for key, members in groups.items():
        value = first[key]
        mine = [results[i] for i in members]
        metric = _metric(task, class_names, mine)
        low = high = None
        resampled = 0
        if metric is not None and len(mine) >= MIN_INTERVAL_IMAGES:
            low, high, resampled = bootstrap_interval(
                task, class_names, mine, resamples=resamples, rng=_rng(seed, column, value)
            )
        slices.append(Slice(value, len(mine), metric, low, high, resampled if low is not None else 0))
    return sort_worst_first(slices, task.primary_mode)


def sort_worst_first(slices: list[Slice], mode: Literal["max", "min"]) -> list[Slice]:
    def key(s: Slice) -> tuple[int, float, int, str]:
        tier = 0 if s.ci_low is not None else (1 if s.metric is not None else 2)
        worst = 0.0 if s.metric is None else (s.metric if mode == "max" else -s.metric)
        return tier, worst, -s.images, s.label

    return sorted(slices, key=key)
