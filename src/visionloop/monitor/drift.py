"""Two-sample drift tests: has a window of served traffic left the reference distribution?

    from visionloop.monitor import drift
    results = [
        drift.ks_bbsd(ref_probs, win_probs, columns=labels),           # softmax outputs
        drift.label_shift(drift.class_counts(ref_pred, n), win_pred),  # predicted classes
        drift.mmd_permutation(ref_embed, win_embed),                   # features, multivariate
        drift.univariate_ks(ref_stats, win_stats),                     # imagestats per request
    ]
    verdict = drift.combine(results)      # verdict.drift, verdict.message, verdict.to_dict()

The tests (each returns a `TestResult` whose `p_value` is valid for the test as a whole):

- `ks_bbsd`: black-box shift detection (Rabanser, Günnemann & Lipton, "Failing Loudly",
  NeurIPS 2019): a two-sample Kolmogorov-Smirnov test on each column of the model's softmax
  output, Bonferroni-corrected over the K columns: drift when the smallest p < alpha / K; the
  reported p-value is min(1, K * min p).
- `label_shift`: chi-square test of homogeneity on the 2 x K table of predicted-class counts
  (reference row, window row), with sparse classes pooled so the chi-square approximation
  holds (see `label_shift`).
- `mmd_permutation`: unbiased MMD^2 with a Gaussian kernel (median-heuristic bandwidth), its
  p-value from a seeded permutation test: no distributional assumption, reproducible.
- `univariate_ks`: KS on named scalar features (the `imagestats` of each request),
  Bonferroni-corrected over the features.

`combine` turns the results for one window into one `Verdict`: drift when any test's p-value
is below alpha / T (Bonferroni over the T tests that ran). Bonferroni needs no independence:
where the tests are correlated (they look at the same traffic) it is conservative, so the
verdict's false-alarm rate stays at or below alpha as long as each test holds its own level
(KS and the permutation test do exactly; chi-square to its approximation).

Window size. A window with fewer than `MIN_WINDOW` (20) samples is not tested: the result has
status "too_few_samples", drift False and p_value None, so a quiet hour of traffic reads as
"no evidence", not as an error that a monitoring loop must catch. A reference smaller than
`MIN_REFERENCE` (20) is a setup mistake and raises `DataError`.

Correlated traffic. Every test here assumes each sample is an independent draw. Frames of a
video, or bursts of requests from one camera, are not: 600 consecutive frames may carry the
information of 30 independent ones, and a test that counts them as 600 sees "significant"
differences that are only the scene of the moment, so it raises false alarms far above alpha
(in the tests, windows of 900 frames with a correlation of 0.9 between consecutive frames
alarm 84% of the time at alpha = 0.05). Two remedies:

- thin the window: keep one request in `every` (`thin`), `every` at least the lag at which
  the autocorrelation has died out (`autocorrelation_length` estimates it; better from a
  long stretch of traffic than from one window). It works with every test and costs samples,
  so make the window `every` times longer. In the tests, thinning those windows by 30
  (0.9^30 = 0.04) brings the rate back to 4%;
- block permutation (`mmd_permutation(..., block=b)`): permute blocks of b consecutive
  samples instead of single samples, b several times the autocorrelation length. Valid only
  when the reference is itself consecutive traffic of the same kind of stream, kept in log
  order (blocks must be exchangeable); with an i.i.d. reference, such as a shuffled
  validation set, thin the window instead. In the tests (correlation 0.7, b = 16) it brings
  the MMD's false alarms from 55% to 4%.

Costs: KS (scipy's exact method below 10,000 samples) takes a few ms per column at N = 1000,
M = 100; chi-square far less. MMD is O(n^2) memory and O(n^2 * permutations) time in the
pooled size n, so the reference is subsampled (seeded) to at most `max_reference` = 1000 rows:
0.06-0.18 s for 200 permutations at n = 1100 (D = 8 to 512) on the development machine. Its
matrix products go through numpy's BLAS: on a machine whose cores are all busy, limit BLAS to
one thread (OPENBLAS_NUM_THREADS=1, or threadpoolctl), or its threads wait for each other
(a 250-row MMD took 25 ms with two threads on a busy 2-core machine, 3 ms with one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray
from scipy import stats  # type: ignore[import-untyped]  # no type hints; comes with scikit-learn

from visionloop.core.errors import DataError, SpecError

MIN_WINDOW: Final = 20
MIN_REFERENCE: Final = 20
MAX_MMD_REFERENCE: Final = 1000
MOVED_LIMIT: Final = 10  # what a result names as "moved" is capped, so logs stay small
# Cochran's rule for the chi-square approximation: every expected count at least 5.
_MIN_EXPECTED: Final = 5.0

Status = Literal["ok", "too_few_samples"]
_F64 = NDArray[np.float64]
_A = TypeVar("_A", bound=np.ndarray)


@dataclass(frozen=True)
class TestResult:
    """One drift test on one window.

    `p_value` is valid for the test as a whole (already Bonferroni-corrected over columns or
    features where the test has several); `drift` is `p_value < alpha`. `moved` names what
    moved (columns, classes, features), most significant first, at most `MOVED_LIMIT`;
    `details` holds the numbers behind it. When `status` is "too_few_samples" the window was
    not tested: `statistic` and `p_value` are None and `drift` is False.
    """

    __test__ = False  # pytest: not a test class, despite the name

    name: str
    statistic: float | None
    p_value: float | None
    alpha: float
    drift: bool
    n_reference: int
    n_window: int
    moved: tuple[str, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)
    status: Status = "ok"

    def to_dict(self) -> dict[str, Any]:
        """Plain floats, ints, strings, lists, dicts and None: `json.dumps(allow_nan=False)`
        accepts it."""
        return {
            "name": self.name,
            "status": self.status,
            "statistic": _json_safe(self.statistic),
            "p_value": _json_safe(self.p_value),
            "alpha": self.alpha,
            "drift": self.drift,
            "n_reference": self.n_reference,
            "n_window": self.n_window,
            "moved": list(self.moved),
            "details": _json_safe(self.details),
        }


@dataclass(frozen=True)
class Verdict:
    """The overall answer for one window, from `combine`.

    `drift` is True when a test's p-value is below alpha / T, T the number of tests that ran;
    `p_value` is min(1, T * smallest p). `flagged` names those tests, `moved` what moved in
    them ("label_shift: cat"). `status` is "too_few_samples" when no test ran.
    """

    drift: bool
    p_value: float | None
    alpha: float
    flagged: tuple[str, ...]
    moved: tuple[str, ...]
    results: tuple[TestResult, ...]
    status: Status = "ok"

    @property
    def message(self) -> str:
        """One line for an alert or a log."""
        if self.status == "too_few_samples":
            return "no drift test ran: the window has too few samples; widen the window."
        if not self.drift:
            return f"no drift (p = {self.p_value:.3g}, alpha = {self.alpha:g})."
        what = "; ".join(self.moved) if self.moved else ", ".join(self.flagged)
        return f"drift (p = {self.p_value:.3g}, alpha = {self.alpha:g}): {what}."

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe, as `TestResult.to_dict`."""
        return {
            "drift": self.drift,
            "status": self.status,
            "p_value": _json_safe(self.p_value),
            "alpha": self.alpha,
            "flagged": list(self.flagged),
            "moved": list(self.moved),
            "message": self.message,
            "results": [r.to_dict() for r in self.results],
        }


# -- the tests ---------------------------------------------------------------------------------


def ks_bbsd(
    reference: ArrayLike,
    window: ArrayLike,
    alpha: float = 0.05,
    *,
    columns: Sequence[str] | None = None,
) -> TestResult:
    """Black-box shift detection: KS on each column of (N, K) reference and (M, K) window
    softmax outputs (or any K scalar outputs), Bonferroni-corrected over the K columns.

    `columns` names the columns (class labels) in `moved` and `details`; default "0".."K-1".
    details: `p_values` and `statistics` per column, `min_p`, `corrected_alpha` (alpha / K).
    """
    _check_alpha(alpha)
    ref = _matrix(reference, "reference")
    win = _matrix(window, "window")
    if ref.shape[1] != win.shape[1]:
        raise DataError(
            f"reference has {ref.shape[1]} columns and window {win.shape[1]}: both must hold the "
            "same model outputs in the same order (one column per class)."
        )
    names = _names(columns, ref.shape[1], "columns")
    return _ks_columns("ks_bbsd", ref, win, names, alpha)


def univariate_ks(
    reference: Mapping[str, ArrayLike],
    window: Mapping[str, ArrayLike],
    alpha: float = 0.05,
) -> TestResult:
    """KS on each named scalar feature (e.g. the `imagestats` of each request),
    Bonferroni-corrected over the features. Both mappings need the same keys, and all of a
    mapping's arrays the same length (one value per request)."""
    _check_alpha(alpha)
    if not reference:
        raise DataError("reference has no features: pass e.g. {'brightness': [...], 'contrast': [...]}.")
    missing = [k for k in reference if k not in window]
    extra = [k for k in window if k not in reference]
    if missing or extra:
        raise DataError(
            f"reference and window must have the same features; window lacks {missing}, "
            f"has extra {extra}. Compute the same statistics for both."
        )
    names = [str(k) for k in reference]
    ref = _stack(reference, "reference")
    win = _stack({k: window[k] for k in reference}, "window")
    return _ks_columns("univariate_ks", ref, win, names, alpha)


def class_counts(classes: ArrayLike, n_classes: int) -> NDArray[np.int64]:
    """How often each of `n_classes` classes occurs in `classes` (predicted class indices):
    what a reference keeps for `label_shift`."""
    if isinstance(n_classes, bool) or not isinstance(n_classes, int | np.integer) or n_classes < 2:
        raise SpecError(f"n_classes must be an integer >= 2, got {n_classes!r} (e.g. n_classes=10).")
    y = _classes(classes, int(n_classes), "classes")
    return np.bincount(y, minlength=int(n_classes)).astype(np.int64)


def label_shift(
    reference_counts: ArrayLike,
    window_classes: ArrayLike,
    alpha: float = 0.05,
    *,
    labels: Sequence[str] | None = None,
) -> TestResult:
    """Chi-square test of homogeneity: are the window's predicted classes drawn with the
    reference's class frequencies?

    `reference_counts` has one count per class (`class_counts` of the reference
    predictions; its length is the number of classes), `window_classes` the window's
    predicted class indices. The 2 x K table is tested with `scipy.stats.chi2_contingency`
    after two repairs: classes seen in neither sample are dropped (they carry no
    information and would make an expected count 0), and classes whose expected count in
    either row is below 5 are pooled into one "other" column, smallest first, until every
    expected count is at least 5 (Cochran's rule; pooling depends on the column totals only,
    which keeps the test valid). With one column left there is nothing to compare: p = 1.
    With 2 columns scipy applies Yates' continuity correction (conservative).

    `moved` names the classes whose own share differs beyond the Bonferroni-corrected normal
    quantile (adjusted standardized residual |r| > z(alpha / 2K)), largest first; details
    `classes` lists the largest changes with both shares.
    """
    _check_alpha(alpha)
    ref = np.asarray(reference_counts)
    if ref.ndim != 1 or ref.shape[0] < 2 or ref.dtype.kind not in "iuf":
        raise DataError(
            f"reference_counts must be one count per class (at least 2 classes), got shape {ref.shape}; "
            "build it with class_counts(reference_classes, n_classes)."
        )
    if not np.all(np.isfinite(ref)) or ref.min() < 0 or np.any(ref != np.round(ref)):
        raise DataError("reference_counts must be whole, non-negative counts; build it with class_counts().")
    ref = ref.astype(np.int64)
    k = ref.shape[0]
    win = class_counts(window_classes, k)
    names = _names(labels, k, "labels")
    n_ref, n_win = int(ref.sum()), int(win.sum())
    _check_reference(n_ref)
    if n_win < MIN_WINDOW:
        return _too_few("label_shift", alpha, n_ref, n_win)

    table = np.stack([ref, win]).astype(np.float64)
    pooled, kept, merged = _pool_sparse(table)
    if pooled.shape[1] < 2:
        statistic, p, dof = 0.0, 1.0, 0
    else:
        res = stats.chi2_contingency(pooled)
        statistic, p, dof = float(res.statistic), float(res.pvalue), int(res.dof)

    ref_share, win_share = ref / n_ref, win / n_win
    change = win_share - ref_share
    resid = _adjusted_residuals(table)
    z_crit = float(stats.norm.isf(alpha / (2 * k)))
    order = np.argsort(-np.abs(resid), kind="stable")
    moved = [names[j] for j in order if abs(resid[j]) > z_crit][:MOVED_LIMIT]
    drift = p < alpha
    if drift and not moved:
        moved = [names[int(order[0])]]
    top = np.argsort(-np.abs(change), kind="stable")[:MOVED_LIMIT]
    details = {
        "dof": dof,
        "classes": [
            {
                "class": int(j),
                "label": names[j],
                "reference_share": float(ref_share[j]),
                "window_share": float(win_share[j]),
                "change": float(change[j]),
            }
            for j in top
        ],
        "pooled_classes": [names[j] for j in sorted(merged)],
        "tested_columns": len(kept) + (1 if merged else 0),
    }
    return TestResult("label_shift", statistic, p, alpha, drift, n_ref, n_win, tuple(moved), details)


def mmd_permutation(
    reference: ArrayLike,
    window: ArrayLike,
    alpha: float = 0.05,
    *,
    permutations: int = 200,
    seed: int = 0,
    max_reference: int = MAX_MMD_REFERENCE,
    block: int = 1,
) -> TestResult:
    """Maximum mean discrepancy between (N, D) reference and (M, D) window features, with a
    permutation p-value.

    Statistic: the unbiased MMD^2 (Gretton et al., JMLR 2012) with the Gaussian kernel
    exp(-|x - y|^2 / (2 sigma^2)), sigma the median distance between distinct pairs of the
    pooled sample (computed once, before permuting: it does not depend on which rows are
    "reference", so the permutation test stays exact). p = (1 + #{permuted >= observed}) /
    (1 + permutations): never 0, and at least 1 / (1 + permutations), so use enough
    permutations for your alpha (200 resolves p down to 0.005).

    The reference is subsampled to `max_reference` rows (seeded, in its original order) so
    the cost is bounded; `seed` also drives the permutations: same inputs and seed, same p.

    `block` > 1 permutes blocks of `block` consecutive samples (see the module docstring on
    correlated traffic): both samples are cut to whole blocks (dropping at most block - 1
    trailing rows each) and the reference is subsampled by whole blocks. The result's
    n_reference and n_window count the rows the test used.
    """
    _check_alpha(alpha)
    for what, value, low in (("permutations", permutations, 1), ("max_reference", max_reference, 2)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
            raise SpecError(f"{what} must be an integer >= {low}, got {value!r} (e.g. {what}=200).")
    if isinstance(block, bool) or not isinstance(block, int | np.integer) or block < 1:
        raise SpecError(f"block must be an integer >= 1 (1: no blocks), got {block!r} (e.g. block=10).")
    ref = _matrix(reference, "reference")
    win = _matrix(window, "window")
    if ref.shape[1] != win.shape[1]:
        raise DataError(
            f"reference has {ref.shape[1]} features per row and window {win.shape[1]}: "
            "both must come from the same feature extractor."
        )
    _check_reference(ref.shape[0])
    if win.shape[0] < MIN_WINDOW:
        return _too_few("mmd", alpha, ref.shape[0], win.shape[0])

    rng = np.random.default_rng(seed)
    ref = _subsample(ref, int(max_reference), int(block), rng)
    if block > 1:
        ref = ref[: ref.shape[0] - ref.shape[0] % block]
        win = win[: win.shape[0] - win.shape[0] % block]
        if ref.shape[0] < 2 * block or win.shape[0] < 2 * block:
            raise DataError(
                f"block={block} leaves fewer than 2 whole blocks in the reference ({ref.shape[0]} rows) "
                f"or the window ({win.shape[0]} rows): use a smaller block or more samples."
            )
    nx, ny = ref.shape[0], win.shape[0]
    kernel, sigma = _gaussian_kernel(np.vstack([ref, win]))

    n_blocks = (nx + ny) // block
    labels = np.zeros(n_blocks)
    labels[: nx // block] = 1.0
    shuffled = rng.permuted(np.tile(labels, (int(permutations), 1)), axis=1)
    z = np.vstack([labels, shuffled]).T  # (blocks, 1 + permutations): 1 marks the reference
    if block > 1:
        # Only sums over whole blocks enter the statistic: sum the kernel block by block
        # once, and every permutation costs block^2 times less.
        kernel = kernel.reshape(n_blocks, block, n_blocks, block).sum(axis=(1, 3))
    mmd2 = _mmd2_unbiased(kernel, z, nx, ny)
    observed = float(mmd2[0])
    # A permuted statistic equal to the observed one up to round-off counts as ">=".
    tolerance = 1e-12 * max(1.0, abs(observed))
    exceed = int(np.count_nonzero(mmd2[1:] >= observed - tolerance))
    p = (1 + exceed) / (1 + int(permutations))
    details = {
        "bandwidth": sigma,
        "permutations": int(permutations),
        "seed": int(seed),
        "block": int(block),
        "reference_used": nx,
        "window_used": ny,
    }
    return TestResult("mmd", observed, p, alpha, p < alpha, nx, ny, (), details)


def combine(results: Sequence[TestResult], alpha: float = 0.05) -> Verdict:
    """One verdict for one window: drift when any test that ran has p < alpha / T (Bonferroni
    over the T tests that ran; tests skipped for too few samples do not count)."""
    _check_alpha(alpha)
    if not results:
        raise SpecError("combine() needs at least one TestResult, e.g. combine([ks_bbsd(ref, win)]).")
    ran = [r for r in results if r.status == "ok" and r.p_value is not None]
    if not ran:
        return Verdict(False, None, alpha, (), (), tuple(results), "too_few_samples")
    corrected = alpha / len(ran)
    p_min = min(float(r.p_value) for r in ran if r.p_value is not None)
    hits = sorted((r for r in ran if r.p_value is not None and r.p_value < corrected), key=_p_key)
    moved = tuple(f"{r.name}: {', '.join(r.moved)}" if r.moved else r.name for r in hits)
    return Verdict(
        drift=bool(hits),
        p_value=min(1.0, len(ran) * p_min),
        alpha=alpha,
        flagged=tuple(r.name for r in hits),
        moved=moved,
        results=tuple(results),
    )


# -- correlated traffic ------------------------------------------------------------------------


@overload
def thin(window: _A, every: int, *, offset: int = 0) -> _A: ...
@overload
def thin(window: Mapping[str, _A], every: int, *, offset: int = 0) -> dict[str, _A]: ...
def thin(window: Any, every: int, *, offset: int = 0) -> Any:
    """Keep one sample in `every` consecutive ones (rows offset, offset + every, ...), so
    samples of correlated traffic that remain are nearly independent. `window` is an array
    (rows in arrival order) or a mapping of named arrays (`univariate_ks` features).

    Choose `every` at least `autocorrelation_length(window)`; the window keeps
    len(window) / every samples, so make it `every` times longer to keep the same power.
    """
    if isinstance(every, bool) or not isinstance(every, int | np.integer) or every < 1:
        raise SpecError(f"every must be an integer >= 1 (1 keeps all), got {every!r} (e.g. every=10).")
    if isinstance(offset, bool) or not isinstance(offset, int | np.integer) or not 0 <= offset < every:
        raise SpecError(f"offset must be an integer in 0..every-1, got {offset!r}.")
    if isinstance(window, Mapping):
        return {k: np.asarray(v)[offset::every] for k, v in window.items()}
    return np.asarray(window)[offset::every]


def autocorrelation_length(window: ArrayLike, *, threshold: float = 0.1, max_lag: int | None = None) -> int:
    """The smallest lag at which the sample autocorrelation of every column of `window`
    (rows in arrival order) has fallen below `threshold`: a thinning step for `thin`.

    1 for independent samples; about log(threshold) / log(phi) for an AR(1) stream with
    lag-one correlation phi (22 for phi = 0.9). Constant columns are ignored. Capped at
    `max_lag` (default a quarter of the window): a result equal to the cap means "at least
    this"; the window is too short to measure the correlation, make it longer. An estimate
    from one window is noisy; estimate it on a long stretch of traffic and reuse it.
    """
    if not 0.0 < threshold < 1.0:
        raise SpecError(f"threshold must be in (0, 1), got {threshold!r} (e.g. threshold=0.1).")
    if max_lag is not None and (isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 1):
        raise SpecError(f"max_lag must be an integer >= 1, got {max_lag!r} (e.g. max_lag=100).")
    x = _matrix(window, "window")
    n = x.shape[0]
    cap = min(max(1, n // 4) if max_lag is None else max_lag, n - 1)
    centred = x - x.mean(axis=0)
    var = (centred**2).sum(axis=0)
    live = var > 1e-12 * np.maximum(1.0, np.abs(x).max(axis=0)) ** 2 * n
    if cap < 1 or not live.any():
        return 1
    centred = centred[:, live]
    # Autocovariance of every column at every lag at once, by FFT (zero-padded: no wrap-around).
    size = 1 << int(2 * n - 1).bit_length()
    spectrum = np.fft.rfft(centred, n=size, axis=0)
    acov = np.fft.irfft(spectrum * np.conj(spectrum), n=size, axis=0)[: cap + 1]
    acf = acov / acov[0]
    below = acf[1:] < threshold  # (cap, columns)
    first = np.where(below.any(axis=0), below.argmax(axis=0) + 1, cap)
    return int(first.max())


# -- helpers ----------------------------------------------------------------------------------


def _ks_columns(name: str, ref: _F64, win: _F64, names: list[str], alpha: float) -> TestResult:
    n_ref, n_win = ref.shape[0], win.shape[0]
    _check_reference(n_ref)
    if n_win < MIN_WINDOW:
        return _too_few(name, alpha, n_ref, n_win)
    k = ref.shape[1]
    res = stats.ks_2samp(ref, win, axis=0)
    p_values = np.atleast_1d(np.asarray(res.pvalue, dtype=np.float64))
    statistics = np.atleast_1d(np.asarray(res.statistic, dtype=np.float64))
    corrected = alpha / k
    order = np.argsort(p_values, kind="stable")
    best = int(order[0])
    moved = [names[j] for j in order if p_values[j] < corrected]
    p = min(1.0, k * float(p_values[best]))
    details = {
        "p_values": {names[j]: float(p_values[j]) for j in range(k)},
        "statistics": {names[j]: float(statistics[j]) for j in range(k)},
        "min_p": float(p_values[best]),
        "corrected_alpha": corrected,
        "n_moved": len(moved),
    }
    return TestResult(
        name, float(statistics[best]), p, alpha, p < alpha, n_ref, n_win, tuple(moved[:MOVED_LIMIT]), details
    )


def _pool_sparse(table: _F64) -> tuple[_F64, list[int], list[int]]:
    """Drop empty columns, then pool the smallest columns into one until every expected count
    is >= 5. Returns the table, the kept column indices and the pooled ones."""
    totals = table.sum(axis=0)
    rows = table.sum(axis=1)
    grand = totals.sum()
    # expected count of column j in row i is rows[i] * totals[j] / grand: the smaller row
    # decides, so a column needs a total of at least 5 * grand / min(rows)
    need = _MIN_EXPECTED * grand / rows.min()
    cols = [int(j) for j in np.argsort(totals, kind="stable") if totals[j] > 0]
    merged: list[int] = []
    while cols and (totals[cols[0]] < need or (merged and totals[merged].sum() < need)):
        merged.append(cols.pop(0))
    kept = sorted(cols)
    parts = [table[:, kept]]
    if merged:
        parts.append(table[:, merged].sum(axis=1, keepdims=True))
    return np.hstack(parts), kept, merged


def _adjusted_residuals(table: _F64) -> _F64:
    """Adjusted standardized residuals of the window row (Agresti): ~N(0, 1) per class under
    the null; 0 for classes seen in neither sample."""
    rows = table.sum(axis=1)
    totals = table.sum(axis=0)
    grand = rows.sum()
    expected = rows[1] * totals / grand
    scale = expected * (1.0 - rows[1] / grand) * (1.0 - totals / grand)
    out: _F64 = np.zeros_like(totals)
    ok = scale > 0
    out[ok] = (table[1, ok] - expected[ok]) / np.sqrt(scale[ok])
    return out


def _gaussian_kernel(pooled: _F64) -> tuple[_F64, float]:
    sq = np.einsum("ij,ij->i", pooled, pooled)
    d2 = sq[:, None] + sq[None, :] - 2.0 * (pooled @ pooled.T)
    np.maximum(d2, 0.0, out=d2)  # round-off can make a distance of 0 slightly negative
    np.fill_diagonal(d2, 0.0)
    distances = np.sqrt(d2[np.triu_indices(d2.shape[0], k=1)])
    sigma = float(np.median(distances))
    if sigma <= 0.0:
        # over half the pairs coincide (duplicated rows): fall back to the mean distance of
        # the distinct pairs, or to 1 when every row is the same (then MMD^2 is exactly 0).
        positive = distances[distances > 0.0]
        sigma = float(positive.mean()) if positive.size else 1.0
    kernel = np.exp(d2 / (-2.0 * sigma * sigma))
    return kernel, sigma


def _mmd2_unbiased(kernel: _F64, z: _F64, nx: int, ny: int) -> _F64:
    """Unbiased MMD^2 for each column of z (1 marks a reference row, 0 a window row; rows
    of `kernel` and `z` may be blocks of rows, `kernel` then holding block sums), from the
    sums of the kernel over reference-reference, reference-window and window-window pairs:
    one matrix product for all labellings at once. The kernel's diagonal is exp(0) = 1, so
    the pairs (i, i) that the unbiased estimate leaves out sum to nx and ny."""
    kz = kernel @ z
    row_sums = kernel.sum(axis=1)
    total = float(row_sums.sum())
    s_xx = np.einsum("ij,ij->j", z, kz)  # sum over reference pairs, diagonal included
    s_xy = z.T @ row_sums - s_xx
    s_yy = total - s_xx - 2.0 * s_xy
    within_x = (s_xx - nx) / (nx * (nx - 1))
    within_y = (s_yy - ny) / (ny * (ny - 1))
    mmd2: _F64 = within_x + within_y - 2.0 * s_xy / (nx * ny)
    return mmd2


def _subsample(ref: _F64, limit: int, block: int, rng: np.random.Generator) -> _F64:
    if ref.shape[0] <= limit:
        return ref
    if block == 1:
        return ref[np.sort(rng.choice(ref.shape[0], size=limit, replace=False))]
    starts = np.arange(0, ref.shape[0] - block + 1, block)
    keep = np.sort(rng.choice(starts, size=min(len(starts), max(2, limit // block)), replace=False))
    return ref[(keep[:, None] + np.arange(block)[None, :]).ravel()]


def _too_few(name: str, alpha: float, n_ref: int, n_win: int) -> TestResult:
    reason = (
        f"the window has {n_win} samples, fewer than {MIN_WINDOW}: not tested; "
        "widen the window (more time, or less thinning)."
    )
    return TestResult(name, None, None, alpha, False, n_ref, n_win, (), {"reason": reason}, "too_few_samples")


def _check_reference(n_ref: int) -> None:
    if n_ref < MIN_REFERENCE:
        raise DataError(
            f"the reference has {n_ref} samples, fewer than {MIN_REFERENCE}: build it from more "
            "traffic or validation images (a few hundred to a few thousand)."
        )


def _check_alpha(alpha: float) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, float | int) or not 0.0 < alpha < 1.0:
        raise SpecError(f"alpha must be a number in (0, 1), got {alpha!r} (e.g. alpha=0.05).")


def _matrix(values: ArrayLike, what: str) -> _F64:
    m = np.asarray(values)
    if m.ndim == 1:
        m = m[:, None]
    if m.ndim != 2 or m.shape[1] < 1:
        raise DataError(f"{what} must be an N x K array (one row per request), got shape {m.shape}.")
    if m.dtype.kind not in "iuf" and m.dtype != np.bool_:
        raise DataError(f"{what} must be numbers, got dtype {m.dtype}.")
    m = m.astype(np.float64)
    if not np.all(np.isfinite(m)):
        bad = int(np.argwhere(~np.isfinite(m))[0][0])
        raise DataError(
            f"{what} has a NaN or infinite value (first in row {bad}): drop or fix such rows before testing."
        )
    return m


def _stack(features: Mapping[str, ArrayLike], what: str) -> _F64:
    cols = []
    for key, values in features.items():
        col = np.asarray(values)
        if col.ndim != 1:
            raise DataError(f"{what}[{key!r}] must be 1-D (one value per request), got shape {col.shape}.")
        cols.append(col)
    lengths = {len(c) for c in cols}
    if len(lengths) > 1:
        sizes = {k: len(np.asarray(v)) for k, v in features.items()}
        raise DataError(f"{what} features must all have one value per request; lengths differ: {sizes}.")
    return _matrix(np.stack(cols, axis=1), what)


def _classes(values: ArrayLike, n_classes: int, what: str) -> NDArray[np.int64]:
    y = np.asarray(values)
    if y.ndim != 1:
        raise DataError(f"{what} must be a 1-D array of class indices, got shape {y.shape}.")
    if y.dtype.kind == "f" and np.all(np.isfinite(y)) and np.all(y == np.round(y)):
        y = y.astype(np.int64)
    if y.size and y.dtype.kind not in "iu":
        raise DataError(f"{what} must be integer class indices (e.g. 0, 3, 1), got dtype {y.dtype}.")
    y = y.astype(np.int64)
    if y.size and (y.min() < 0 or y.max() >= n_classes):
        raise DataError(
            f"{what} must lie in 0..{n_classes - 1} ({n_classes} classes), got {y.min()}..{y.max()}; "
            "check that the reference counts cover every class of the model."
        )
    return y


def _names(given: Sequence[str] | None, k: int, what: str) -> list[str]:
    if given is None:
        return [str(j) for j in range(k)]
    names = [str(n) for n in given]
    if len(names) != k:
        raise DataError(f"{what} has {len(names)} names for {k} columns: give one name per column.")
    return names


def _p_key(result: TestResult) -> float:
    return 1.0 if result.p_value is None else result.p_value


def _json_safe(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if isinstance(value, bool | np.bool_):
        return bool(value)
    if isinstance(value, int | np.integer):
        return int(value)
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    return value
