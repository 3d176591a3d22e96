"""How far a classifier's confidences can be trusted, and temperature scaling to fix them.

    cal = calibration(softmax(val_logits), val_labels)          # ECE, MCE, Brier, NLL, bins
    t = fit_temperature(val_logits, val_labels)                 # on a held-out split
    after = calibration(softmax(test_logits, t), test_labels)
    reliability_diagram(cal, Path("reliability.png"), "resnet18", after=after)

Definitions follow Guo et al., "On Calibration of Modern Neural Networks" (ICML 2017): the
top-1 confidence is binned into equal-width bins (lower, upper], right-closed so a confidence
of exactly 1.0 falls in the last bin; ECE is the count-weighted mean of |accuracy - mean
confidence| over the bins, MCE the largest gap over non-empty bins.
"""

from __future__ import annotations

import io
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from scipy import optimize  # type: ignore[import-untyped]  # no type hints; comes with scikit-learn

from visionloop.core.errors import DataError, SpecError
from visionloop.core.fsutil import atomic_write_bytes

DEFAULT_BINS = 15
TEMPERATURE_BOUNDS = (0.05, 20.0)
# log(0) is -inf: a probability of exactly 0 on the true class costs -log(1e-12) ≈ 27.6 nats
# instead, as in scikit-learn's log_loss, so the NLL stays finite and JSON-safe.
_NLL_FLOOR = 1e-12
_ROW_SUM_TOLERANCE = 1e-3  # float16 softmax rows sum to 1 within ~1e-3
_F64 = NDArray[np.float64]


@dataclass(frozen=True)
class ReliabilityBin:
    """Samples whose top-1 confidence lies in (lower, upper]; `confidence` (their mean
    confidence) and `accuracy` are None when the bin is empty."""

    lower: float
    upper: float
    count: int
    confidence: float | None
    accuracy: float | None

    @property
    def gap(self) -> float | None:
        """accuracy - confidence: negative where the model is over-confident."""
        if self.confidence is None or self.accuracy is None:
            return None
        return self.accuracy - self.confidence


@dataclass(frozen=True)
class Calibration:
    """Calibration of `samples` predictions. ece, mce, brier and accuracy are in [0, 1] (brier
    in [0, 2]); nll is in nats per sample; `bins` holds every bin, empty ones included."""

    ece: float
    mce: float
    brier: float
    nll: float
    accuracy: float
    bins: tuple[ReliabilityBin, ...]
    samples: int

    def to_dict(self) -> dict[str, Any]:
        """Plain floats, ints, None and lists only: `json.dumps(allow_nan=False)` accepts it."""
        out = asdict(self)
        out["bins"] = [asdict(b) for b in self.bins]
        return out


def _labels(labels: np.ndarray, n: int, classes: int) -> NDArray[np.int64]:
    y = np.asarray(labels)
    if y.ndim != 1 or y.shape[0] != n:
        raise DataError(f"labels must be a 1-D array of {n} class indices, one per row, got shape {y.shape}.")
    if y.dtype.kind == "f" and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
        y = y.astype(np.int64)
    if y.dtype.kind not in "iu":
        raise DataError(f"labels must be integer class indices (e.g. 0, 3, 1), got dtype {y.dtype}.")
    if n and (y.min() < 0 or y.max() >= classes):
        raise DataError(
            f"labels must lie in 0..{classes - 1} ({classes} classes), got {y.min()}..{y.max()}; "
            "check that the label order matches the model's output columns."
        )
    return y.astype(np.int64)


def _matrix(values: np.ndarray, what: str) -> _F64:
    m = np.asarray(values)
    if m.ndim != 2 or m.shape[0] < 1 or m.shape[1] < 2:
        raise DataError(
            f"{what} must be an N x C array (N >= 1 samples, C >= 2 classes), got shape {m.shape}; "
            "for a binary model with one score p per sample pass the columns [1 - p, p]."
        )
    if m.dtype.kind not in "iuf":
        raise DataError(f"{what} must be numbers, got dtype {m.dtype}.")
    m = m.astype(np.float64)
    if not np.all(np.isfinite(m)):
        bad = int(np.argwhere(~np.isfinite(m))[0][0])
        raise DataError(
            f"{what} has a NaN or infinite value (first in row {bad}); check the model's outputs."
        )
    return m


def calibration(probs: np.ndarray, labels: np.ndarray, n_bins: int = DEFAULT_BINS) -> Calibration:
    """ECE, MCE, multi-class Brier score, NLL and accuracy of predicted class probabilities.

    `probs` is N x C with rows summing to 1 (pass `softmax(logits)`), `labels` N class
    indices. Brier is the mean over samples of sum over classes of (p - onehot)^2 (0 perfect,
    2 worst); NLL the mean of -log p[label].
    """
    if isinstance(n_bins, bool) or not isinstance(n_bins, int | np.integer) or n_bins < 1:
        raise SpecError(f"n_bins must be a positive integer, got {n_bins!r} (e.g. n_bins=15).")
    p = _matrix(probs, "probs")
    n, classes = p.shape
    y = _labels(labels, n, classes)
    if p.min() < 0.0:
        raise DataError("probs has a negative value: pass probabilities, e.g. softmax(logits), not logits.")
    sums = p.sum(axis=1)
    off = np.abs(sums - 1.0) > _ROW_SUM_TOLERANCE
    if off.any():
        row = int(np.argmax(off))
        raise DataError(
            f"probs rows must sum to 1, row {row} sums to {sums[row]:.6g}; "
            "pass probabilities, e.g. softmax(logits), not logits or scores."
        )

    confidence = p.max(axis=1)
    correct = (p.argmax(axis=1) == y).astype(np.float64)
    edges = np.linspace(0.0, 1.0, int(n_bins) + 1)
    # searchsorted on the inner edges, side="left": a confidence equal to an edge belongs to
    # the bin it closes, (lower, upper].
    index = np.searchsorted(edges[1:-1], confidence, side="left")
    counts = np.bincount(index, minlength=int(n_bins))
    conf_sum = np.bincount(index, weights=confidence, minlength=int(n_bins))
    correct_sum = np.bincount(index, weights=correct, minlength=int(n_bins))

    bins: list[ReliabilityBin] = []
    ece, mce = 0.0, 0.0
    for b in range(int(n_bins)):
        count = int(counts[b])
        if count == 0:
            bins.append(ReliabilityBin(float(edges[b]), float(edges[b + 1]), 0, None, None))
            continue
        conf_b, acc_b = float(conf_sum[b] / count), float(correct_sum[b] / count)
        bins.append(ReliabilityBin(float(edges[b]), float(edges[b + 1]), count, conf_b, acc_b))
        gap = abs(acc_b - conf_b)
        ece += count / n * gap
        mce = max(mce, gap)

    onehot = np.zeros_like(p)
    onehot[np.arange(n), y] = 1.0
    brier = float(np.mean(np.sum((p - onehot) ** 2, axis=1)))
    nll = float(-np.mean(np.log(np.maximum(p[np.arange(n), y], _NLL_FLOOR))))
    return Calibration(
        ece=float(ece),
        mce=float(mce),
        brier=brier,
        nll=nll,
        accuracy=float(correct.mean()),
        bins=tuple(bins),
        samples=int(n),
    )


def _check_temperature(temperature: float) -> float:
    t = float(temperature)
    if not (math.isfinite(t) and t > 0.0):
        raise SpecError(f"temperature must be a positive finite number, got {temperature!r} (e.g. 1.5).")
    return t


def _log_softmax(z: _F64) -> _F64:
    shifted = z - z.max(axis=-1, keepdims=True)  # the largest logit becomes 0: exp cannot overflow
    return np.asarray(shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True)), dtype=np.float64)


def softmax(logits: np.ndarray, temperature: float = 1.0) -> NDArray[np.float64]:
    """softmax(logits / temperature) over the last axis, without overflow for any finite
    logits (float64 out)."""
    t = _check_temperature(temperature)
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim < 1 or z.shape[-1] < 1:
        raise DataError(f"logits must have at least one class on the last axis, got shape {z.shape}.")
    if not np.all(np.isfinite(z)):
        raise DataError("logits has a NaN or infinite value; check the model's outputs.")
    return np.exp(_log_softmax(z / t))


def fit_temperature(logits: np.ndarray, labels: np.ndarray) -> float:
    """The temperature T > 0 minimising the NLL of softmax(logits / T) on (logits, labels).

    Fit it on a held-out split, never on the split you then report (Guo et al. 2017). T > 1
    softens an over-confident model; accuracy does not change. T is searched on log T within
    TEMPERATURE_BOUNDS (the NLL is convex in 1/T, so this bounded 1-D search finds its
    minimum); a result at a bound means the logits carry almost no (or perfect) signal.
    """
    z = _matrix(logits, "logits")
    y = _labels(labels, z.shape[0], z.shape[1])
    rows = np.arange(z.shape[0])

    def nll(log_t: float) -> float:
        return float(-np.mean(_log_softmax(z * math.exp(-log_t))[rows, y]))

    lo, hi = TEMPERATURE_BOUNDS
    result = optimize.minimize_scalar(
        nll, bounds=(math.log(lo), math.log(hi)), method="bounded", options={"xatol": 1e-6}
    )
    return float(math.exp(float(result.x)))


def _panel(ax: Any, cal: Calibration, heading: str) -> None:
    filled = [b for b in cal.bins if b.count]
    lowers = [b.lower for b in filled]
    widths = [b.upper - b.lower for b in filled]
    accs = [b.accuracy or 0.0 for b in filled]
    gaps = [(b.confidence or 0.0) - (b.accuracy or 0.0) for b in filled]
    ax.bar(lowers, accs, width=widths, align="edge", color="#3b75af", edgecolor="#1f3d5c", label="accuracy")
    # The gap runs from the bar's top to the bin's mean confidence: above the bar where the
    # model is over-confident, hanging into it where under-confident.
    ax.bar(
        lowers,
        gaps,
        bottom=accs,
        width=widths,
        align="edge",
        color="#d62728",
        alpha=0.3,
        edgecolor="#d62728",
        hatch="//",
        label="gap to confidence",
    )
    ax.plot([0.0, 1.0], [0.0, 1.0], linestyle="--", color="black", linewidth=1.0, label="perfect calibration")
    ax.plot([], [], linestyle="none", label=f"ECE {cal.ece:.2%}  (MCE {cal.mce:.2%})")
    ax.set_xlim(0.0, 1.0)
    ax.set_ylim(0.0, 1.0)
    ax.set_aspect("equal")
    ax.set_xlabel("confidence (top-1)")
    ax.set_ylabel("accuracy")
    ax.set_title(f"{heading}{cal.samples} samples, accuracy {cal.accuracy:.1%}", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)


def reliability_diagram(
    cal: Calibration, path: Path, title: str = "", after: Calibration | None = None
) -> Path:
    """Write a reliability diagram of `cal` to `path` (PNG, atomically); return the path.

    Bars show the accuracy of each confidence bin against the diagonal of perfect
    calibration, with the gap to the bin's mean confidence shaded and the ECE in the legend.
    With `after` (e.g. the same split after temperature scaling), the two are drawn side by
    side, "before" on the left.
    """
    # Imported here: matplotlib is slow to import and only this function needs it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [(cal, "before: " if after is not None else "")]
    if after is not None:
        panels.append((after, "after: "))
    fig = Figure(figsize=(5.0 * len(panels), 5.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    for i, (c, heading) in enumerate(panels):
        _panel(fig.add_subplot(1, len(panels), i + 1), c, heading)
    if title:
        fig.suptitle(title)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(Path(path), buf.getvalue())
    return Path(path)
