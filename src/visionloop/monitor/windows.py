"""Windows of served traffic, judged against a version's reference.

The server's prediction logs (`serve.record.PredictionRecord`, one JSONL file per server and
its rotated files) are read in time order; the records of one model version that answered
(primary or challenger; a shadow's answers are the challenger's own business) are cut into
windows, either of a fixed duration aligned to the clock (`--window 1h`: 10:00-11:00, ...) or of
a fixed number of requests (`--window-requests 500`), and each complete window is tested:

- `ks_bbsd`: KS on each drift column (a classifier's calibrated class probabilities),
  Bonferroni over the columns;
- `label_shift`: chi-square on the predicted-class frequencies;
- `mmd_embeddings`: MMD with a permutation test on the export's embeddings (the
  penultimate layer reduced by PCA at export, `export.embedding`), the multivariate test;
  for an export without an embedding output (exported before it existed, or a torchvision
  detector), `mmd_outputs`: the same test on the drift columns taken together;
- `image_stats`: KS on each image statistic (image-endpoint requests only);

`drift.combine` makes one verdict (Bonferroni over the tests that ran). The estimated accuracy
is ATC (see `monitor.reference`).

Correlated traffic: frames of a video are not independent draws, and every test assumes they
are. With `thin="auto"` (the default) each window is thinned to every k-th request, k the lag
at which the autocorrelation of its drift columns (or image statistics) falls under
max(0.1, 3 / sqrt(n)) (`drift.autocorrelation_length`; the noise floor of a window of n):
independent traffic keeps every request, a slowly panning camera keeps one frame in k.
`thin=N` fixes k; `thin=1` turns it off.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from visionloop.monitor import drift
from visionloop.monitor.history import WindowRecord
from visionloop.monitor.reference import Reference
from visionloop.serve.record import MONITOR_DECIMALS, PredictionRecord, ReadStats, read_records


@dataclass(frozen=True)
class WindowSpec:
    seconds: float | None = None  # time windows aligned to multiples of this
    requests: int | None = None  # or windows of this many requests

    def __post_init__(self) -> None:
        if (self.seconds is None) == (self.requests is None):
            raise ValueError("a window is either a duration or a number of requests")


def log_files(directory: Path) -> list[Path]:
    """Every prediction log in `directory`: each server's file and its rotated ones."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_file() and ".jsonl" in p.name)


def version_records(
    files: Iterable[Path],
    model: str,
    version: int,
    *,
    after: float = -math.inf,
    stats: ReadStats | None = None,
) -> list[PredictionRecord]:
    """The answering records of `model`/`version` later than `after`, oldest first."""
    out = [
        r
        for path in files
        for r in read_records(path, stats)
        if r.model == model and r.version == version and r.role != "shadow" and r.time > after
    ]
    out.sort(key=lambda r: r.time)
    return out


def cut(
    records: Sequence[PredictionRecord], spec: WindowSpec, now: float
) -> Iterator[list[PredictionRecord]]:
    """The complete windows of `records` (sorted by time): a time window is complete once
    `now` is past its end, a request window once it holds its requests."""
    if spec.requests is not None:
        n = spec.requests
        for i in range(0, len(records) - n + 1, n):
            yield list(records[i : i + n])
        return
    assert spec.seconds is not None
    size = spec.seconds
    current: list[PredictionRecord] = []
    slot = None
    for r in records:
        s = math.floor(r.time / size)
        if slot is not None and s != slot and current:
            yield current
            current = []
        slot = s
        current.append(r)
    if current and slot is not None and now >= (slot + 1) * size:
        yield current


def judge(
    ref: Reference,
    window: Sequence[PredictionRecord],
    *,
    alpha: float = 0.05,
    thin: int | str = "auto",
    seed: int = 0,
) -> WindowRecord:
    """Test one window against the reference (see the module docstring)."""
    outputs, predicted, confidence, image = _columns(ref, window)
    embeddings = _embeddings(ref, window)
    step = _thinning(thin, outputs, image)
    if step > 1:
        outputs = None if outputs is None else drift.thin(outputs, step)
        embeddings = None if embeddings is None else drift.thin(embeddings, step)
        predicted = None if predicted is None else drift.thin(predicted, step)
        confidence = None if confidence is None else drift.thin(confidence, step)
        image = {k: drift.thin(v, step) for k, v in image.items()}
    results: list[drift.TestResult] = []
    if outputs is not None and ref.outputs is not None:
        reference = _as_logged(ref.outputs)
        results.append(drift.ks_bbsd(reference, outputs, alpha, columns=ref.output_names))
        if embeddings is None:
            results.append(drift.mmd_permutation(reference, outputs, alpha, seed=seed))
            results[-1] = _renamed(results[-1], "mmd_outputs")
    if embeddings is not None and ref.embeddings is not None:
        results.append(drift.mmd_permutation(_as_logged(ref.embeddings), embeddings, alpha, seed=seed))
        results[-1] = _renamed(results[-1], "mmd_embeddings")
    if predicted is not None and ref.class_counts is not None:
        results.append(drift.label_shift(ref.class_counts, predicted, alpha, labels=ref.class_names))
    if image and ref.image:
        keys = sorted(set(image) & set(ref.image))
        results.append(
            drift.univariate_ks(
                {k: _as_logged(ref.image[k]) for k in keys}, {k: image[k] for k in keys}, alpha
            )
        )
        results[-1] = _renamed(results[-1], "image_stats")
    tested = max([len(outputs) if outputs is not None else 0, *(len(v) for v in image.values())], default=0)
    if not results:
        raise ValueError("nothing to test: the window's records carry no drift fields")
    verdict = drift.combine(results, alpha)
    return WindowRecord(
        model=ref.model,
        version=ref.version,
        start=window[0].time,
        end=window[-1].time,
        requests=len(window),
        tested=tested,
        status=verdict.status,
        drift=verdict.drift,
        p_value=verdict.p_value,
        alpha=alpha,
        flagged=verdict.flagged,
        moved=verdict.moved,
        estimated_accuracy=None if confidence is None else ref.estimate_accuracy(confidence),
        p_values={r.name: r.p_value for r in results},
    )


def _as_logged(values: np.ndarray) -> np.ndarray:
    """Reference numbers rounded as the prediction log rounds its monitor fields (float64, as
    the log's numbers are read): otherwise a probability under 5e-7, logged as 0, sits below
    every unrounded reference value, and KS sees a shift that is only rounding. (Seen: every
    window of a confident model flagged, at a temperature of 0.5.)"""
    return np.round(np.asarray(values, dtype=np.float64), MONITOR_DECIMALS)


def _renamed(r: drift.TestResult, name: str) -> drift.TestResult:
    from dataclasses import replace

    return replace(r, name=name)


def _columns(
    ref: Reference, window: Sequence[PredictionRecord]
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None, dict[str, np.ndarray]]:
    """The window's drift columns, predicted classes, confidences (records that carry them,
    with the reference's column count) and image statistics (image requests only)."""
    k = len(ref.output_names)
    rows = [r.monitor for r in window if r.monitor is not None and r.monitor.outputs is not None]
    rows = [m for m in rows if m.outputs is not None and len(m.outputs) == k]
    outputs = np.asarray([m.outputs for m in rows], dtype=np.float64) if rows and k else None
    predicted = None
    if ref.class_counts is not None:
        classes = [
            m.predicted for m in rows if m.predicted is not None and m.predicted < len(ref.class_counts)
        ]
        predicted = np.asarray(classes, dtype=np.int64) if classes else None
    conf = [m.confidence for m in rows if m.confidence is not None]
    confidence = np.asarray(conf, dtype=np.float64) if conf else None
    stats = [r.monitor.image for r in window if r.monitor is not None and r.monitor.image is not None]
    image: dict[str, Any] = {}
    if stats:
        for key in ref.image:
            values = [s[key] for s in stats if key in s]
            if len(values) == len(stats):
                image[key] = np.asarray(values, dtype=np.float64)
    return outputs, predicted, confidence, image


def _embeddings(ref: Reference, window: Sequence[PredictionRecord]) -> np.ndarray | None:
    """The window's embeddings with the reference's dimension, None when the reference has
    none or fewer than half the window's records carry one (an older export still serving)."""
    if ref.embeddings is None:
        return None
    k = ref.embeddings.shape[1]
    rows = [r.monitor.embedding for r in window if r.monitor is not None and r.monitor.embedding is not None]
    rows = [e for e in rows if len(e) == k]
    if not rows or 2 * len(rows) < len(window):
        return None
    return np.asarray(rows, dtype=np.float64)


def _thinning(thin: int | str, outputs: np.ndarray | None, image: dict[str, np.ndarray]) -> int:
    if thin != "auto":
        step = int(thin)
        if step < 1:
            raise ValueError(f"thin must be 'auto' or an integer >= 1, got {thin!r}")
        return step
    series = outputs if outputs is not None else (np.stack(list(image.values()), axis=1) if image else None)
    if series is None or len(series) < 20:
        return 1
    # Under independence a sample autocorrelation has a standard error of 1/sqrt(n): with 10
    # columns, a fixed 0.1 would read noise as correlation in most windows of 200 and halve
    # their power. 3/sqrt(n) is crossed by chance in ~0.1% of columns.
    threshold = min(0.5, max(0.1, 3.0 / math.sqrt(len(series))))
    return drift.autocorrelation_length(_varying(series), threshold=threshold)


def _varying(a: np.ndarray) -> np.ndarray:
    """Columns that vary (a constant column has no autocorrelation to measure)."""
    keep = a.std(axis=0) > 0
    return a[:, keep] if keep.any() else a[:, :1]
