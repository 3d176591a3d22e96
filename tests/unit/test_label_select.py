"""Selection strategies on constructed pools, where what each must pick is known: uncertainty
measures that disagree, clusters for k-center, classes for balanced, boxes for a detector;
determinism, near-duplicates, and the errors a user meets."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from visionloop.core.errors import VisionloopError
from visionloop.label.select import (
    STRATEGIES,
    Pool,
    SelectionError,
    SelectOptions,
    select,
    uncertainty_scores,
)

CONFIDENT = [0.97, 0.01, 0.01, 0.01]


def ids(n: int, prefix: str = "img") -> tuple[str, ...]:
    return tuple(f"{prefix}{i:02d}" for i in range(n))


def shuffled(pool: Pool, seed: int) -> Pool:
    """The same pool in another row order."""
    perm = np.random.default_rng(seed).permutation(len(pool))

    def take(a: object) -> object:
        return None if a is None else np.asarray(a)[perm]

    scores = None if pool.detection_scores is None else [pool.detection_scores[i] for i in perm]
    return Pool(
        ids=tuple(pool.ids[i] for i in perm),
        probabilities=take(pool.probabilities),  # type: ignore[arg-type]
        detection_scores=scores,
        embeddings=take(pool.embeddings),  # type: ignore[arg-type]
        classes=take(pool.classes),  # type: ignore[arg-type]
        hashes=take(pool.hashes),  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------------------------------------
# Uncertainty


def disagreeing_pool() -> Pool:
    """Rows on which entropy, margin and least confidence rank differently:
    two_way: [.5, .5, 0, 0]  entropy .69, margin score 1.0 (a tie at the top), 1 - p1 = .5
    spread:  [.4, .2, .2, .2] entropy 1.33, margin score .8,                   1 - p1 = .6
    uniform: [.25] * 4        entropy 1.39, margin score 1.0,                   1 - p1 = .75
    and confident rows."""
    rows = {
        "a_two_way": [0.5, 0.5, 0.0, 0.0],
        "b_spread": [0.4, 0.2, 0.2, 0.2],
        "c_uniform": [0.25, 0.25, 0.25, 0.25],
        **{f"d_sure{i}": CONFIDENT for i in range(5)},
    }
    return Pool(ids=tuple(rows), probabilities=np.array(list(rows.values())))


def test_entropy_margin_and_least_confidence_pick_what_each_measures() -> None:
    pool = disagreeing_pool()
    assert select(pool, "entropy", 2).ids == ["c_uniform", "b_spread"]
    # a_two_way and c_uniform both have p1 == p2; the tie goes to the smaller id
    assert select(pool, "margin", 3).ids == ["a_two_way", "c_uniform", "b_spread"]
    assert select(pool, "least_confidence", 2).ids == ["c_uniform", "b_spread"]
    scores = uncertainty_scores(pool, "entropy")
    assert scores[2] == pytest.approx(math.log(4)) and scores[0] == pytest.approx(math.log(2))
    chosen = select(pool, "entropy", 1).chosen[0]
    assert chosen.score == pytest.approx(math.log(4))
    assert "most uncertain" in chosen.reason and "entropy 1.39" in chosen.reason


def test_results_do_not_depend_on_row_order() -> None:
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(5), 40)
    probs[[3, 17, 29]] = 0.2  # three exact ties at the top
    pool = Pool(ids=ids(40), probabilities=probs, embeddings=rng.normal(size=(40, 3)), hashes=None)
    for strategy in STRATEGIES:
        want = select(pool, strategy, 7, seed=4, labelled_classes=[0, 0, 1]).ids
        for s in range(3):
            again = select(shuffled(pool, s), strategy, 7, seed=4, labelled_classes=[0, 0, 1])
            assert again.ids == want, strategy
    assert select(pool, "entropy", 3).ids == ["img03", "img17", "img29"]  # ties by id


# ---------------------------------------------------------------------------------------------
# Random


def test_random_is_deterministic_for_a_seed_and_differs_across_seeds() -> None:
    pool = Pool(ids=ids(200))
    a = select(pool, "random", 20, seed=1)
    assert a.ids == select(pool, "random", 20, seed=1).ids
    assert len(set(a.ids)) == 20
    draws = {tuple(select(pool, "random", 20, seed=s).ids) for s in range(5)}
    assert len(draws) == 5
    assert a.chosen[0].reason == "drawn at random (seed 1)"
    # over many seeds, every image gets picked about as often (no bias to low ids)
    counts = np.zeros(200)
    for s in range(300):
        for i in select(pool, "random", 20, seed=s).ids:
            counts[int(i[3:])] += 1
    assert counts.min() > 10 and counts.max() < 55  # expected 30 each


# ---------------------------------------------------------------------------------------------
# k-center, hybrid


def clusters(centres: list[tuple[float, float]], per: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([np.asarray(c) + rng.normal(0, 0.1, (per, 2)) for c in centres])


def test_kcenter_takes_the_farthest_cluster_first_and_covers_every_cluster() -> None:
    # Clusters at 0, 10 and 30 on a line and one at (0, 20); the labelled set sits at 0.
    emb = clusters([(0, 0), (10, 0), (30, 0), (0, 20)], per=5)
    pool = Pool(ids=ids(20), embeddings=emb)
    sel = select(pool, "kcenter", 3, labelled_embeddings=[[0.0, 0.0]])
    cluster_of = [int(i[3:]) // 5 for i in sel.ids]
    assert cluster_of == [2, 3, 1]  # 30 away, then (0, 20): 20 from both, then 10
    assert sel.chosen[0].score == pytest.approx(30, abs=0.5)
    assert "farthest from every labelled and chosen image" in sel.chosen[0].reason
    # with 8 picks, each cluster but the labelled one is covered before any gets a second
    picks = [int(i[3:]) // 5 for i in select(pool, "kcenter", 8, labelled_embeddings=[[0.0, 0.0]]).ids]
    assert set(picks[:3]) == {1, 2, 3}
    # no labelled set: the pool mean stands in, so the first pick is the farthest from it
    first = select(pool, "kcenter", 4).chosen
    mean = emb.mean(axis=0)
    assert int(first[0].id[3:]) == int(np.argmax(np.linalg.norm(emb - mean, axis=1)))
    assert "the farthest from the candidates' mean" in first[0].reason
    assert sorted(int(c.id[3:]) // 5 for c in first) == [0, 1, 2, 3]


def test_hybrid_spreads_the_most_uncertain_over_the_embedding_space() -> None:
    # Five very uncertain images in one tight cluster, one slightly less uncertain far away,
    # and confident images farther still.
    probs = [[0.5, 0.5]] * 5 + [[0.6, 0.4]] + [[0.99, 0.01]] * 4
    emb = np.concatenate([clusters([(0, 0)], 5), [[10.0, 0.0]], clusters([(50, 50)], 4, seed=1)])
    pool = Pool(ids=ids(10), probabilities=np.array(probs), embeddings=emb)
    assert select(pool, "entropy", 2).ids == ["img00", "img01"]  # two of the same confusion
    opts = SelectOptions(hybrid_factor=3)
    hybrid = select(pool, "hybrid", 2, labelled_embeddings=[[0.0, 0.0]], options=opts)
    assert hybrid.ids[0] == "img05"  # the far one among the 6 most uncertain
    assert int(hybrid.ids[1][3:]) < 5  # then one of the cluster, never a confident image
    assert "among the 6 most uncertain" in hybrid.chosen[0].reason
    assert hybrid.chosen[0].score == pytest.approx(-(0.6 * math.log(0.6) + 0.4 * math.log(0.4)))
    # kcenter alone goes for the confident far-away cluster
    assert int(select(pool, "kcenter", 1, labelled_embeddings=[[0.0, 0.0]]).ids[0][3:]) >= 6


# ---------------------------------------------------------------------------------------------
# Class balance


def test_balanced_gives_the_rarest_classes_first_and_the_most_uncertain_within() -> None:
    # Predicted classes 0..3 (plus class 4, which the pool never predicts); labelled counts
    # [3, 1, 0, 0, 0].
    rows = []
    for c in range(4):
        for u in (0.6, 0.9, 0.75):  # the probability of the predicted class: 0.6 most uncertain
            p = np.full(5, (1 - u) / 4)
            p[c] = u
            rows.append(p)
    pool = Pool(ids=ids(12), probabilities=np.array(rows))
    sel = select(pool, "balanced", 6, labelled_classes=[0, 0, 0, 1])
    # class 2 (0 labelled), class 3 (0), then 1, 2, 3 (1 each: lowest class first), then 0
    # was still at 3 and 1, 2, 3 at 2 -> class 1 again.
    classes = [int(i[3:]) // 3 for i in sel.ids]
    assert classes == [2, 3, 1, 2, 3, 1]
    assert [int(i[3:]) % 3 for i in sel.ids[:3]] == [0, 0, 0]  # the 0.6 row of each class first
    assert [int(i[3:]) % 3 for i in sel.ids[3:]] == [2, 2, 2]  # then its 0.75 row
    assert "predicted class 2, the rarest with images left (0 labelled or chosen)" in sel.chosen[0].reason
    # A budget larger than the rare classes: they run dry and the rest goes on evenly.
    every = select(pool, "balanced", 12).ids
    assert sorted(int(i[3:]) // 3 for i in every) == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3


def test_balanced_with_classes_only_draws_at_random_within_a_class() -> None:
    pool = Pool(ids=ids(20), classes=np.array([0] * 15 + [1] * 5))
    sel = select(pool, "balanced", 4, seed=3)
    assert sorted(int(i[3:]) >= 15 for i in sel.ids) == [False, False, True, True]
    assert sel.ids == select(pool, "balanced", 4, seed=3).ids
    assert "drawn at random within it" in sel.chosen[0].reason


# ---------------------------------------------------------------------------------------------
# Detection


def test_detection_images_are_scored_from_their_boxes() -> None:
    pool = Pool(
        ids=("a_sure", "b_doubt", "c_empty", "d_crowd", "e_faint"),
        detection_scores=[
            np.array([0.98, 0.95]),
            np.array([0.97, 0.55]),  # one box near the decision boundary
            np.array([]),  # nothing detected: empty or a miss
            np.array([0.9] * 8),  # many confident boxes
            np.array([0.02, 0.01]),  # only background noise, below min_box_score
        ],
    )
    h = lambda s: -(s * math.log(s) + (1 - s) * math.log(1 - s))  # noqa: E731
    scores = uncertainty_scores(pool, "entropy")
    assert scores.tolist() == pytest.approx([h(0.95), h(0.55), math.log(2), h(0.9), math.log(2)])
    sel = select(pool, "entropy", 5)
    assert sel.ids == ["c_empty", "e_faint", "b_doubt", "d_crowd", "a_sure"]
    assert "no box scored 0.05 or more" in sel.chosen[0].reason
    assert "the max over its 2 boxes" in sel.chosen[2].reason
    # sum rewards crowds; an empty-image uncertainty of 0 sends empty images last
    opts = SelectOptions(box_aggregate="sum", empty_image_uncertainty=0.0)
    assert select(pool, "entropy", 5, options=opts).ids[0] == "d_crowd"
    assert select(pool, "entropy", 5, options=opts).ids[-2:] == ["c_empty", "e_faint"]
    # margin and least confidence on a box are |2s - 1| and min(s, 1 - s)
    assert uncertainty_scores(pool, "margin")[1] == pytest.approx(1 - abs(2 * 0.55 - 1))
    assert uncertainty_scores(pool, "least_confidence")[1] == pytest.approx(0.45)


# ---------------------------------------------------------------------------------------------
# Near-duplicates


def test_near_duplicates_of_training_images_and_of_each_other_are_left_out() -> None:
    probs = np.array([[0.5, 0.5], [0.6, 0.4], [0.7, 0.3], [0.9, 0.1], [0.99, 0.01]])
    hashes = np.array([0xFF00, 0xFF01, 0x0F0F_0000, 0xFFFF_0000_0000, 0xFF03], dtype=np.uint64)
    pool = Pool(ids=("p0", "p1", "p2", "p3", "p4"), probabilities=probs, hashes=hashes)
    training = {"t0": 0x0F0F_0001, "t1": 0x1234_5678_9ABC}
    sel = select(pool, "entropy", 5, exclude_near_duplicates_of=training)
    # p2 copies training image t0; p1 and p4 copy p0, the more uncertain, which is kept.
    assert sel.ids == ["p0", "p3"]
    left = {d.id: (d.of, d.distance, d.of_training) for d in sel.near_duplicates}
    assert left == {"p1": ("p0", 1, False), "p2": ("t0", 1, True), "p4": ("p0", 2, False)}
    assert sel.notes and "fewer than the budget of 5" in sel.notes[0]
    # with random, the draw decides which of the group survives, differently across seeds
    group = ("p0", "p1", "p4")
    kept = {next(i for i in select(pool, "random", 5, seed=s).ids if i in group) for s in range(30)}
    assert kept == {"p0", "p1", "p4"}
    # the within-pool search can be turned off
    assert select(pool, "entropy", 5, options=SelectOptions(dedupe_within_pool=False)).ids == [
        "p0", "p1", "p2", "p3", "p4"
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Outputs and errors


def test_selection_is_json_safe_and_short_pools_are_noted() -> None:
    pool = Pool(ids=ids(3), probabilities=np.array([[0.5, 0.5], [0.9, 0.1], [0.7, 0.3]]))
    sel = select(pool, "margin", 10)
    assert sel.ids == ["img00", "img02", "img01"]
    doc = json.loads(json.dumps(sel.to_dict()))
    assert doc["budget"] == 10 and doc["strategy"] == "margin" and len(doc["chosen"]) == 3
    assert set(doc["chosen"][0]) == {"id", "score", "reason"}
    assert doc["notes"] == ["the pool holds 3 images, fewer than the budget of 10: all are chosen"]


@pytest.mark.parametrize("budget", [0, -3, True, 2.5])
def test_budget_must_be_a_positive_count(budget: object) -> None:
    with pytest.raises(SelectionError, match="budget must be a positive number of images"):
        select(Pool(ids=ids(3)), "random", budget)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("strategy", "pool", "needs"),
    [
        ("kcenter", Pool(ids=ids(2), probabilities=np.full((2, 2), 0.5)), r"needs Pool\(embeddings=...\)"),
        ("hybrid", Pool(ids=ids(2), embeddings=np.zeros((2, 3))), r"needs Pool\(probabilities=...\)"),
        ("entropy", Pool(ids=ids(2)), r"'entropy' needs Pool\(probabilities=...\) for a classifier"),
        ("balanced", Pool(ids=ids(2), embeddings=np.zeros((2, 3))), r"'balanced' needs Pool\(classes=...\)"),
    ],
)
def test_a_strategy_says_what_it_needs(strategy: str, pool: Pool, needs: str) -> None:
    with pytest.raises(SelectionError, match=needs) as e:
        select(pool, strategy, 1)
    assert "random needs only ids" in str(e.value)
    assert isinstance(e.value, VisionloopError)


def test_bad_pools_are_refused_with_the_image_named() -> None:
    probs = np.array([[0.5, 0.5], [np.nan, 0.5], [0.2, 0.8]])
    with pytest.raises(SelectionError, match=r"probabilities of image 'img01' hold NaN or infinity"):
        Pool(ids=ids(3), probabilities=probs)
    with pytest.raises(SelectionError, match=r"'img00' sum to 3.*not logits"):
        Pool(ids=ids(2), probabilities=np.array([[2.0, 1.0], [0.5, 0.5]]))
    with pytest.raises(SelectionError, match=r"must be \(images, classes\).*\(3, C\); got \(2, 2\)"):
        Pool(ids=ids(3), probabilities=np.full((2, 2), 0.5))
    with pytest.raises(SelectionError, match=r"embeddings must be numbers, \(3, dims\)"):
        Pool(ids=ids(3), embeddings=np.zeros((4, 8)))
    with pytest.raises(SelectionError, match=r"embeddings of image 'img02' hold NaN"):
        Pool(ids=ids(3), embeddings=np.array([[0.0], [1.0], [np.inf]]))
    with pytest.raises(SelectionError, match=r"hashes must be \(3,\)"):
        Pool(ids=ids(3), hashes=np.zeros(2, dtype=np.uint64))
    with pytest.raises(SelectionError, match=r"one array per image \(3\); got 2"):
        Pool(ids=ids(3), detection_scores=[np.array([0.5]), np.array([])])
    with pytest.raises(SelectionError, match=r"'b' must be probabilities in \[0, 1\]; got \[1.5\]"):
        Pool(ids=("a", "b"), detection_scores=[np.array([0.5]), np.array([0.2, 1.5])])
    with pytest.raises(SelectionError, match=r"classes must be \(2,\) non-negative"):
        Pool(ids=ids(2), classes=np.array([0, -1]))
    with pytest.raises(SelectionError, match="'img00' is in the pool more than once"):
        Pool(ids=("img00", "img01", "img00"))
    with pytest.raises(SelectionError, match="the pool is empty"):
        Pool(ids=())
    with pytest.raises(SelectionError, match="both class probabilities and detection scores"):
        Pool(ids=ids(1), probabilities=np.array([[0.5, 0.5]]), detection_scores=[np.array([0.5])])


def test_bad_requests_are_refused() -> None:
    pool = Pool(ids=ids(3), probabilities=np.full((3, 2), 0.5), embeddings=np.zeros((3, 4)))
    with pytest.raises(SelectionError, match=r"unknown strategy 'coreset'; choose one of random, entropy"):
        select(pool, "coreset", 1)
    with pytest.raises(SelectionError, match=r"labelled_embeddings must be \(labelled images, 4\)"):
        select(pool, "kcenter", 1, labelled_embeddings=np.zeros((5, 3)))
    with pytest.raises(SelectionError, match=r"needs the pool's hashes: Pool\(hashes=...\)"):
        select(pool, "entropy", 1, exclude_near_duplicates_of={"t": 1})
    with pytest.raises(SelectionError, match="hybrid_factor must be at least 1"):
        SelectOptions(hybrid_factor=0.5)
    with pytest.raises(SelectionError, match="uncertainty must be one of entropy, margin"):
        SelectOptions(uncertainty="variance")  # type: ignore[arg-type]
    with pytest.raises(SelectionError, match="labelled_classes must be"):
        select(pool, "balanced", 1, labelled_classes=[0.5])
