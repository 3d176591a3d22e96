"""Which unlabelled images to label next: active-learning selection over a pool of model
outputs, pure numpy, deterministic for a seed, ties broken by image id.

A `Pool` (`visionloop.label.pool`) holds what a model said about each unlabelled image: class
probabilities (a classifier) or its boxes' scores (a detector), its embeddings (penultimate-
layer features), its predicted class, and the image's perceptual hash. `select` picks `budget`
of them:

- `random`: the baseline, a seeded draw.
- `entropy`, `margin`, `least_confidence`: the most uncertain first (Settles, "Active Learning
  Literature Survey", 2009, section 3.1). Scores are "higher is more uncertain": entropy of the
  probabilities (nats); 1 - (p1 - p2); 1 - p1. A detector's image is scored from its boxes
  (see below).
- `kcenter`: k-center greedy on the embeddings, the core-set approach (Sener & Savarese,
  "Active Learning for Convolutional Neural Networks: A Core-Set Approach", ICLR 2018): each
  pick is the image farthest (Euclidean) from every labelled and already chosen image, so the
  budget covers the pool's regions before it refines any. Without labelled embeddings the
  candidates' mean stands in for the labelled set, so the first pick is no coin toss.
- `hybrid`: the `hybrid_factor` x budget most uncertain images, then k-center among them
  (Zhdanov, "Diverse mini-batch Active Learning", 2019, who pre-filters the top beta*k by
  uncertainty and then clusters): a pure uncertainty batch is full of near-identical
  confusions (the same two classes, the same blurry pose), and k-center spreads it out.
- `balanced`: the budget spread over predicted classes, one pick at a time to the class with
  the fewest labelled-plus-chosen images (the rarest first), the most uncertain within a class.
  Counters the class skew that uncertainty sampling has on imbalanced pools.

A detector's image (`Pool.detection_scores`: each image's box scores after NMS) is scored from
its boxes, each box a binary question "object or not" with probability its score: the box's
entropy, margin or least confidence, then the max over the image's boxes (`box_aggregate`;
"mean" and "sum" are the other aggregations compared by Brust et al., "Active Learning for Deep
Object Detection", VISAPP 2019, and Haussmann et al., "Scalable Active Learning for Object
Detection", IV 2020). Max is the default: an image is worth labelling as much as its most
doubtful box, "sum" favours crowded images and "mean" lets confident boxes hide a doubtful one.
Boxes under `min_box_score` (0.05, the floor mAP evaluation keeps) are background noise and
ignored. An image with no box left is either empty or a complete miss, and the model cannot
tell which; it scores as a box at 0.5 would (the most uncertain) unless `empty_image_uncertainty`
says otherwise: set it to 0 on a pool where most images are truly empty.

Near-duplicates: with `Pool.hashes`, an image within `max_distance` bits (pHash, see
`visionloop.label.phash`) of a training image (`exclude_near_duplicates_of`) or of an image the
strategy prefers to it is left out, before any pick, and reported with what it copies; the
strategy's preference is its uncertainty ranking (hybrid and balanced too), the random order
for random, the id order for k-center.

Cost: k-center and hybrid do (labelled + budget) x candidates x dims multiply-adds (100k
512-d embeddings, 1,000 labelled, 100 picks: ~7 s on one core of a shared 2-core VM); the
near-duplicate search is in `visionloop.label.phash`; the rest is a sort.

    >>> from visionloop.label.select import Pool, select
    >>> pool = Pool(ids=tuple(paths), probabilities=probs, embeddings=feats, hashes=hashes)
    >>> sel = select(pool, "hybrid", budget=100, seed=0, labelled_embeddings=train_feats,
    ...              exclude_near_duplicates_of=dict(zip(train_ids, train_hashes)))
    >>> for c in sel.chosen: print(c.id, c.score, c.reason)
    >>> sel.to_dict()  # JSON-safe, for `visionloop label select --json`
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

import numpy as np
import numpy.typing as npt

from visionloop.label.phash import DEFAULT_MAX_DISTANCE, as_hashes, near_duplicates
from visionloop.label.pool import Pool, SelectionError

__all__ = [
    "STRATEGIES",
    "Choice",
    "LeftOut",
    "Pool",
    "SelectOptions",
    "Selection",
    "SelectionError",
    "Strategy",
    "select",
    "uncertainty_scores",
]

Strategy = Literal["random", "entropy", "margin", "least_confidence", "kcenter", "hybrid", "balanced"]
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
Uncertainty = Literal["entropy", "margin", "least_confidence"]
UNCERTAINTIES: tuple[Uncertainty, ...] = get_args(Uncertainty)
BoxAggregate = Literal["max", "mean", "sum"]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
# Pool rows x labelled rows per chunk of the k-center distance matrix (float64: 32 MiB).
_CHUNK_CELLS = 1 << 22

_EMBEDDINGS_HINT = (
    "Pool(embeddings=...): each image's penultimate-layer features from the model, (images, dims)"
)
_UNCERTAINTY_HINT = (
    "Pool(probabilities=...) for a classifier (its softmax, (images, classes)) or "
    "Pool(detection_scores=...) for a detector (each image's box scores)"
)


# ---------------------------------------------------------------------------------------------
# Options and outputs


@dataclass(frozen=True)
class SelectOptions:
    """The knobs of the strategies; the defaults are the documented choices (module docstring)."""

    uncertainty: Uncertainty = "entropy"  # what hybrid and balanced rank by
    hybrid_factor: float = 4.0  # hybrid: k-center among the hybrid_factor x budget most uncertain
    box_aggregate: BoxAggregate = "max"
    min_box_score: float = 0.05
    empty_image_uncertainty: float | None = None  # None: as uncertain as a box scored 0.5
    max_distance: int = DEFAULT_MAX_DISTANCE  # near-duplicate threshold, bits of 64
    dedupe_within_pool: bool = True

    def __post_init__(self) -> None:
        if self.uncertainty not in UNCERTAINTIES:
            raise SelectionError(
                f"uncertainty must be one of {', '.join(UNCERTAINTIES)}; got {self.uncertainty!r}"
            )
        if self.box_aggregate not in get_args(BoxAggregate):
            raise SelectionError(f"box_aggregate must be max, mean or sum; got {self.box_aggregate!r}")
        if not self.hybrid_factor >= 1:
            raise SelectionError(f"hybrid_factor must be at least 1 (e.g. 4); got {self.hybrid_factor}")
        if not 0 <= self.min_box_score < 1:
            raise SelectionError(f"min_box_score must be in [0, 1), e.g. 0.05; got {self.min_box_score}")
        if not 0 <= self.max_distance <= 64:
            raise SelectionError(
                f"max_distance is a number of bits, 0 to 64 (e.g. 6); got {self.max_distance}"
            )


@dataclass(frozen=True)
class Choice:
    id: str
    score: float  # the strategy's number for it: uncertainty, distance, or a random draw
    reason: str


@dataclass(frozen=True)
class LeftOut:
    """An image left out as a near-duplicate of `of`: a training image or a preferred pool image."""

    id: str
    of: str
    distance: int  # bits
    of_training: bool


@dataclass(frozen=True)
class Selection:
    strategy: Strategy
    budget: int
    seed: int
    chosen: tuple[Choice, ...]  # in pick order
    near_duplicates: tuple[LeftOut, ...] = ()
    notes: tuple[str, ...] = field(default=())  # e.g. fewer images left than the budget

    @property
    def ids(self) -> list[str]:
        return [c.id for c in self.chosen]

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "budget": self.budget,
            "seed": self.seed,
            "chosen": [vars(c) for c in self.chosen],
            "near_duplicates": [vars(d) for d in self.near_duplicates],
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------------------------------
# Scores


def uncertainty_scores(pool: Pool, kind: Uncertainty, options: SelectOptions | None = None) -> FloatArray:
    """Per image, higher is more uncertain (module docstring), in the pool's order."""
    opts = options or SelectOptions()
    if pool.probabilities is not None:
        p = pool.probabilities
        if kind == "entropy":
            return cast(FloatArray, -(p * np.log(np.where(p > 0, p, 1.0))).sum(axis=1))
        top2 = -np.partition(-p, 1, axis=1)[:, :2]
        if kind == "margin":
            return 1.0 - (top2[:, 0] - top2[:, 1])
        return 1.0 - top2[:, 0]
    if pool.detection_scores is not None:
        empty = opts.empty_image_uncertainty
        if empty is None:
            empty = float(_box_uncertainty(np.array([0.5]), kind)[0])
        out = np.empty(len(pool), dtype=np.float64)
        for i, s in enumerate(pool.detection_scores):
            u = _box_uncertainty(s[s >= opts.min_box_score], kind)
            out[i] = empty if len(u) == 0 else getattr(np, opts.box_aggregate)(u)
        return out
    raise SelectionError(f"{kind} needs the model's outputs for each image: {_UNCERTAINTY_HINT}")


def _box_uncertainty(scores: npt.ArrayLike, kind: Uncertainty) -> FloatArray:
    """Each box as a binary distribution (s, 1 - s)."""
    s = np.asarray(scores, dtype=np.float64)
    if kind == "entropy":
        with np.errstate(divide="ignore", invalid="ignore"):
            h = -(s * np.log(s) + (1 - s) * np.log1p(-s))
        return cast(FloatArray, np.nan_to_num(h, nan=0.0))  # 0 log 0 = 0 at s = 0 or 1
    if kind == "margin":
        return 1.0 - np.abs(2 * s - 1)
    return cast(FloatArray, np.minimum(s, 1 - s))


# ---------------------------------------------------------------------------------------------
# Strategies, over pool row indices; wherever scores tie, the smaller id goes first


def _kcenter(
    x: npt.NDArray[np.floating[Any]],
    rows: IntArray,
    k: int,
    centers: npt.NDArray[np.floating[Any]] | None,
) -> list[tuple[int, float]]:
    """Greedy k-center over x[rows] (in id order, so that argmax ties go to the smaller id):
    (row, distance to its nearest center when picked). Without centers, the rows' mean is
    the one center to start from."""
    xa = x[rows]
    if centers is None or len(centers) == 0:
        centers = xa.mean(axis=0, keepdims=True)
    d2 = _min_sq_distances(xa, centers)
    x_sq = np.einsum("ij,ij->i", xa, xa, dtype=np.float64)
    picks: list[tuple[int, float]] = []
    for _ in range(min(k, len(rows))):
        j = int(np.argmax(d2))  # the first maximum: the lowest id among equals
        picks.append((int(rows[j]), math.sqrt(max(float(d2[j]), 0.0))))
        # ||x - c||² = ||x||² + ||c||² - 2 x·c: one matrix-vector product per pick, the cost of
        # k-center (pool x dims multiply-adds a pick), instead of a (pool, dims) difference.
        new = x_sq + x_sq[j] - 2.0 * (xa @ xa[j]).astype(np.float64)
        d2 = np.minimum(d2, np.maximum(new, 0.0))
        d2[j] = -np.inf  # and stays so: min(-inf, x) is -inf
    return picks


def _min_sq_distances(x: npt.NDArray[np.floating[Any]], centers: npt.NDArray[np.floating[Any]]) -> FloatArray:
    """min over centers of ||x - c||², chunked, through ||x||² + ||c||² - 2 x·c in float64."""
    out = np.full(len(x), np.inf)
    c64 = np.asarray(centers, dtype=np.float64)
    c_sq = np.einsum("ij,ij->i", c64, c64)
    rows = max(1, _CHUNK_CELLS // max(1, len(c64)))
    for start in range(0, len(x), rows):
        xc = np.asarray(x[start : start + rows], dtype=np.float64)
        d2 = np.einsum("ij,ij->i", xc, xc)[:, None] + c_sq[None, :] - 2.0 * (xc @ c64.T)
        out[start : start + rows] = np.maximum(d2.min(axis=1), 0.0)
    return out


def _waterfill(by_class: dict[int, list[int]], counts: IntArray, k: int) -> list[tuple[int, int, int]]:
    """Picks (row, class, labelled-plus-chosen count of its class before it): each to the class
    with the fewest so far (the lowest class index among equals) that still has a candidate,
    taking the class's candidates in their given order."""
    heap = [(int(counts[c]), c) for c in sorted(by_class)]
    heapq.heapify(heap)
    taken = dict.fromkeys(by_class, 0)
    picks: list[tuple[int, int, int]] = []
    while heap and len(picks) < k:
        count, c = heapq.heappop(heap)
        if taken[c] == len(by_class[c]):
            continue  # the class has nothing left to give; the others share the rest
        picks.append((by_class[c][taken[c]], c, count))
        taken[c] += 1
        heapq.heappush(heap, (count + 1, c))
    return picks


# ---------------------------------------------------------------------------------------------
# The entry point


def _require(pool: Pool, strategy: Strategy) -> None:
    missing = []
    if strategy in ("kcenter", "hybrid") and pool.embeddings is None:
        missing.append(_EMBEDDINGS_HINT)
    has_outputs = pool.probabilities is not None or pool.detection_scores is not None
    if strategy in (*UNCERTAINTIES, "hybrid") and not has_outputs:
        missing.append(_UNCERTAINTY_HINT)
    if strategy == "balanced" and pool.classes is None and pool.probabilities is None:
        missing.append("Pool(classes=...) (each image's predicted class index) or Pool(probabilities=...)")
    if missing:
        raise SelectionError(
            f"strategy {strategy!r} needs {' and '.join(missing)}; "
            "or choose a strategy the pool supports (random needs only ids)"
        )


def _as_labelled_embeddings(pool: Pool, labelled: npt.ArrayLike | None) -> FloatArray | None:
    if labelled is None:
        return None
    e = np.asarray(labelled, dtype=np.float64)
    dims = None if pool.embeddings is None else pool.embeddings.shape[1]
    if e.size == 0:
        return None
    if e.ndim != 2 or (dims is not None and e.shape[1] != dims):
        raise SelectionError(
            f"labelled_embeddings must be (labelled images, {dims}) like the pool's embeddings, from "
            f"the same model; got {e.shape}"
        )
    if not np.isfinite(e).all():
        raise SelectionError("labelled_embeddings hold NaN or infinity; check the model's outputs")
    return e


def select(
    pool: Pool,
    strategy: Strategy | str,
    budget: int,
    seed: int = 0,
    labelled_embeddings: npt.ArrayLike | None = None,
    exclude_near_duplicates_of: Mapping[str, int] | None = None,
    *,
    labelled_classes: npt.ArrayLike | None = None,
    options: SelectOptions | None = None,
) -> Selection:
    """Pick `budget` images of `pool` to label, by `strategy` (module docstring).

    `labelled_embeddings`: the labelled set's embeddings, the centers k-center (and hybrid)
    starts from. `exclude_near_duplicates_of`: training image id -> pHash; a pool image near
    one is left out (needs `pool.hashes`). `labelled_classes`: the labelled set's class
    indices, which balanced counts. The result is the same for the same pool in any row
    order, seed and arguments."""
    opts = options or SelectOptions()
    if strategy not in STRATEGIES:
        raise SelectionError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    strat: Strategy = strategy
    if isinstance(budget, bool) or not isinstance(budget, int | np.integer) or budget <= 0:
        raise SelectionError(f"budget must be a positive number of images to label, e.g. 100; got {budget!r}")
    k = int(budget)
    _require(pool, strat)
    centers = _as_labelled_embeddings(pool, labelled_embeddings)
    if exclude_near_duplicates_of is not None and pool.hashes is None:
        raise SelectionError(
            "leaving out near-duplicates of training images needs the pool's hashes: "
            "Pool(hashes=...), visionloop.label.phash.phash_file of each pool image"
        )

    n = len(pool)
    by_id = np.argsort(np.array(pool.ids), kind="stable")  # pool rows in id order
    id_rank = np.empty(n, dtype=np.int64)
    id_rank[by_id] = np.arange(n)
    keys = np.random.default_rng(seed).random(n)[id_rank]  # a draw per id, whatever the row order

    def ranked(scores: FloatArray, rows: IntArray) -> IntArray:
        return rows[np.lexsort((id_rank[rows], -scores[rows]))]

    has_outputs = pool.probabilities is not None or pool.detection_scores is not None
    kind: Uncertainty = strat if strat in UNCERTAINTIES else opts.uncertainty
    u = uncertainty_scores(pool, kind, opts) if has_outputs and strat not in ("random", "kcenter") else None
    every = np.arange(n, dtype=np.int64)
    if u is not None:
        preferred = ranked(u, every)
    elif strat in ("random", "balanced"):
        preferred = ranked(keys, every)
    else:
        preferred = by_id

    left_out: list[LeftOut] = []
    if pool.hashes is not None:
        ref = exclude_near_duplicates_of or {}
        ref_ids = list(ref)
        dups = near_duplicates(
            pool.hashes[preferred],
            as_hashes([ref[i] for i in ref_ids]) if ref_ids else None,
            max_distance=opts.max_distance,
            within=opts.dedupe_within_pool,
        )
        for d in dups:
            of = ref_ids[d.of] if d.in_reference else pool.ids[int(preferred[d.of])]
            left_out.append(LeftOut(pool.ids[int(preferred[d.index])], of, d.distance, d.in_reference))
        gone = np.zeros(n, dtype=bool)
        gone[preferred[[d.index for d in dups]]] = True
        preferred = preferred[~gone[preferred]]

    chosen = _run(strat, pool, k, seed, preferred, id_rank, keys, u, kind, centers, labelled_classes, opts)
    notes: list[str] = []
    if len(chosen) < k:
        dropped = f" once {len(left_out)} near-duplicates are left out" if left_out else ""
        notes.append(
            f"the pool holds {len(preferred)} images{dropped}, fewer than the budget of {k}: all are chosen"
        )
    return Selection(strat, k, seed, tuple(chosen), tuple(left_out), tuple(notes))


def _run(
    strat: Strategy,
    pool: Pool,
    k: int,
    seed: int,
    preferred: IntArray,
    id_rank: IntArray,
    keys: FloatArray,
    u: FloatArray | None,
    kind: Uncertainty,
    centers: FloatArray | None,
    labelled_classes: npt.ArrayLike | None,
    opts: SelectOptions,
) -> list[Choice]:
    """The strategy over the available rows, `preferred` (its preference order)."""
    ids = pool.ids
    if strat == "random":
        return [Choice(ids[r], float(keys[r]), f"drawn at random (seed {seed})") for r in preferred[:k]]
    if strat in UNCERTAINTIES:
        assert u is not None
        return [
            Choice(ids[r], float(u[r]), f"{_ordinal(i + 1)} most uncertain: {_why(pool, r, u, kind, opts)}")
            for i, r in enumerate(preferred[:k].tolist())
        ]
    if strat in ("kcenter", "hybrid"):
        assert pool.embeddings is not None
        rows = preferred if strat == "kcenter" else preferred[: math.ceil(opts.hybrid_factor * k)]
        rows = rows[np.argsort(id_rank[rows], kind="stable")]  # id order: argmax ties go to the lowest id
        out = []
        for i, (r, dist) in enumerate(_kcenter(pool.embeddings, rows, k, centers)):
            if i == 0 and centers is None:
                where = f"the farthest from the candidates' mean ({dist:.3g}; no labelled embeddings given)"
            else:
                where = f"the farthest from every labelled and chosen image ({dist:.3g} from the nearest)"
            if strat == "kcenter":
                out.append(Choice(ids[r], dist, where))
            else:
                assert u is not None
                among = f"among the {len(rows)} most uncertain ({kind} {u[r]:.3g})"
                out.append(Choice(ids[r], float(u[r]), f"{among}, {where}"))
        return out
    # balanced
    classes = pool.classes
    if classes is None:
        classes = np.argmax(cast(FloatArray, pool.probabilities), axis=1)
    labelled = np.zeros(0, dtype=np.int64)
    if labelled_classes is not None:
        labelled = np.asarray(labelled_classes).reshape(-1)
        if labelled.size and (labelled.dtype.kind not in "iu" or int(labelled.min()) < 0):
            raise SelectionError(
                "labelled_classes must be the labelled images' class indices (integers >= 0)"
            )
        labelled = labelled.astype(np.int64)
    size = max(int(classes.max()) + 1, int(labelled.max()) + 1 if labelled.size else 0)
    if pool.probabilities is not None:
        size = max(size, pool.probabilities.shape[1])
    counts = np.bincount(labelled, minlength=size)
    by_class: dict[int, list[int]] = {}
    for r in preferred.tolist():
        by_class.setdefault(int(classes[r]), []).append(r)
    out = []
    for r, c, before in _waterfill(by_class, counts, k):
        if u is not None:
            score, within = float(u[r]), f"the most uncertain left in it ({kind} {u[r]:.3g})"
        else:
            score, within = float(keys[r]), "drawn at random within it"
        rarest = f"predicted class {c}, the rarest with images left ({before} labelled or chosen)"
        out.append(Choice(ids[r], score, f"{rarest}; {within}"))
    return out


def _why(pool: Pool, r: int, u: FloatArray, kind: Uncertainty, opts: SelectOptions) -> str:
    if pool.detection_scores is None:
        return f"{kind} {u[r]:.3g}"
    boxes = int((pool.detection_scores[r] >= opts.min_box_score).sum())
    if boxes == 0:
        return f"no box scored {opts.min_box_score:g} or more (an empty image or a miss), {kind} {u[r]:.3g}"
    over = f"the {opts.box_aggregate} over its {boxes} boxes scored {opts.min_box_score:g} or more"
    return f"{kind} {u[r]:.3g}, {over}"


def _ordinal(i: int) -> str:
    suffix = "th" if 10 <= i % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(i % 10, "th")
    return f"{i}{suffix}"
