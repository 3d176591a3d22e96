"""The ingest plan: duplicates, the stratified content-keyed split, and the write order."""

from __future__ import annotations

import hashlib
from collections import Counter

import pytest

from visionloop.data.split import assign_splits, find_duplicates, split_sizes, write_order


def sha(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def dataset(sizes: dict[int, int]) -> tuple[list[int], list[str], list[str]]:
    labels, hashes, names = [], [], []
    k = 0
    for label, n in sizes.items():
        for _ in range(n):
            labels.append(label)
            hashes.append(sha(k))
            names.append(f"{label}/{k:05d}.png")
            k += 1
    return labels, hashes, names


@pytest.mark.parametrize(("val", "test"), [(0.1, 0.0), (0.2, 0.1), (0.33, 0.0), (0.05, 0.05)])
def test_each_class_gets_its_share_within_one_image(val: float, test: float) -> None:
    sizes = {0: 1, 1: 7, 2: 23, 3: 50, 4: 101, 5: 5}
    labels, hashes, names = dataset(sizes)
    splits = assign_splits(labels, hashes, names, seed=3, val_fraction=val, test_fraction=test)
    per = Counter(zip(labels, splits, strict=True))
    for label, n in sizes.items():
        assert abs(per[label, "val"] - n * val) <= 1
        assert abs(per[label, "test"] - n * test) <= 1
        assert per[label, "train"] + per[label, "val"] + per[label, "test"] == n


def test_split_sizes_round_half_up_and_leave_the_rest_to_train() -> None:
    assert split_sizes(5, 0.1, 0.0) == (4, 1, 0)  # 0.5 rounds up
    assert split_sizes(4, 0.1, 0.0) == (4, 0, 0)
    assert split_sizes(10, 0.2, 0.1) == (7, 2, 1)
    assert split_sizes(1, 0.5, 0.4) == (0, 1, 0)  # never more than there is
    assert split_sizes(0, 0.5, 0.0) == (0, 0, 0)


def test_same_seed_same_split_other_seed_other_split() -> None:
    labels, hashes, names = dataset({0: 60, 1: 40})
    a = assign_splits(labels, hashes, names, seed=0, val_fraction=0.2, test_fraction=0.0)
    b = assign_splits(labels, hashes, names, seed=0, val_fraction=0.2, test_fraction=0.0)
    c = assign_splits(labels, hashes, names, seed=1, val_fraction=0.2, test_fraction=0.0)
    assert a == b
    assert a != c
    assert Counter(a) == Counter(c)  # same sizes, other members


def test_split_follows_content_not_names_or_listing_order() -> None:
    labels, hashes, names = dataset({0: 30, 1: 30})
    base = assign_splits(labels, hashes, names, seed=5, val_fraction=0.3, test_fraction=0.1)
    by_hash = dict(zip(hashes, base, strict=True))
    # Rename every file and list them in another order: every image keeps its split.
    order = list(reversed(range(len(labels))))
    renamed = assign_splits(
        [labels[i] for i in order],
        [hashes[i] for i in order],
        [f"renamed/{i}.jpg" for i in range(len(order))],
        seed=5,
        val_fraction=0.3,
        test_fraction=0.1,
    )
    assert {hashes[i]: s for i, s in zip(order, renamed, strict=True)} == by_hash


def test_adding_images_moves_few_existing_ones_between_splits() -> None:
    labels, hashes, names = dataset({0: 100})
    before = assign_splits(labels, hashes, names, seed=0, val_fraction=0.2, test_fraction=0.0)
    labels2, hashes2, names2 = dataset({0: 110})
    after = assign_splits(labels2, hashes2, names2, seed=0, val_fraction=0.2, test_fraction=0.0)
    moved = sum(1 for i in range(100) if before[i] != after[i])
    assert moved <= 4  # a name-keyed shuffle would move about a third of them


def test_duplicates_pair_with_the_first_in_listing_order() -> None:
    hashes = ["a", "b", "a", None, "b", "a", None]
    dups = find_duplicates(hashes)
    assert [(d.kept, d.duplicate, d.sha256) for d in dups] == [(0, 2, "a"), (1, 4, "b"), (0, 5, "a")]


def test_write_order_is_a_seeded_permutation_that_mixes_classes() -> None:
    order = write_order(1000, seed=0)
    assert sorted(order) == list(range(1000))
    assert order == write_order(1000, seed=0)
    assert order != write_order(1000, seed=1)
    # Listing order is class order; the first chunk of writes must hold both halves.
    first = order[:100]
    assert 30 < sum(1 for i in first if i < 500) < 70
