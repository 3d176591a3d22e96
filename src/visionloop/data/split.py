"""Plan an ingest before decoding: drop byte duplicates, assign splits, fix the write order.

Everything here is decided from the listing and the file hashes alone, so that decoded images
can stream straight into the shard writers as they arrive.

The split is keyed on *content*, not on names: within each class, images are ordered by
`sha256(seed, file hash)` and the first ones go to test, then val. So the same files give the
same split under any names (renaming a file keeps the dataset version), and adding images
to a class moves few of the existing ones between splits, keeping val images from leaking
into the train split of the next dataset version.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass

from visionloop.data.manifest import SplitName


@dataclass(frozen=True, slots=True)
class Duplicate:
    """`duplicate` has the same bytes as `kept`, which comes first in listing order."""

    kept: int  # positions in the listing
    duplicate: int
    sha256: str


def find_duplicates(hashes: Sequence[str | None]) -> list[Duplicate]:
    """Pair every file with the first file (in listing order) holding the same bytes.
    `None` marks a file that could not be hashed; it is nobody's duplicate."""
    first: dict[str, int] = {}
    found: list[Duplicate] = []
    for i, sha in enumerate(hashes):
        if sha is None:
            continue
        kept = first.setdefault(sha, i)
        if kept != i:
            found.append(Duplicate(kept, i, sha))
    return found


def split_sizes(n: int, val_fraction: float, test_fraction: float) -> tuple[int, int, int]:
    """(train, val, test) counts for one class of `n` images, each within half an image of
    its fraction (rounding half up); test is served first, and train gets the rest."""
    n_test = min(n, int(n * test_fraction + 0.5))
    n_val = min(n - n_test, int(n * val_fraction + 0.5))
    return n - n_val - n_test, n_val, n_test


def _split_key(seed: int, sha256: str) -> bytes:
    return hashlib.sha256(f"visionloop-split:{seed}:{sha256}".encode()).digest()


def assign_splits(
    labels: Sequence[int],
    hashes: Sequence[str],
    names: Sequence[str],
    *,
    seed: int,
    val_fraction: float,
    test_fraction: float,
) -> list[SplitName]:
    """A seeded split, stratified per class: each class's val and test shares are within
    half an image of the fractions. `names` only break ties between identical contents,
    which then land next to each other (and so almost always in the same split)."""
    by_class: dict[int, list[int]] = {}
    for i, label in enumerate(labels):
        by_class.setdefault(label, []).append(i)
    splits: list[SplitName] = ["train"] * len(labels)
    for members in by_class.values():
        members.sort(key=lambda i: (_split_key(seed, hashes[i]), names[i]))
        _, n_val, n_test = split_sizes(len(members), val_fraction, test_fraction)
        for i in members[:n_test]:
            splits[i] = "test"
        for i in members[n_test : n_test + n_val]:
            splits[i] = "val"
    return splits


BACKGROUND_GROUP = -1


def rarest_class_groups(present: Sequence[Sequence[int]]) -> list[int]:
    """For images that hold several labelled objects: each image's stratum for `assign_splits`,
    the class it contains that the fewest images contain (ties to the lower index), or
    `BACKGROUND_GROUP` for an image with no object. Stratifying on the rarest class keeps a
    rare class's few images in every split, which stratifying on a common one (present almost
    everywhere) would not."""
    images_with: dict[int, int] = {}
    for labels in present:
        for label in set(labels):
            images_with[label] = images_with.get(label, 0) + 1
    return [
        min(set(labels), key=lambda c: (images_with[c], c)) if labels else BACKGROUND_GROUP
        for labels in present
    ]


def write_order(n: int, seed: int) -> list[int]:
    """A seeded permutation of range(n): the order images are decoded and written in.

    The loader shuffles within chunks, so the chunks themselves must already mix classes;
    written in listing order (which is class order for an ImageFolder), each chunk would
    hold one or two classes and every batch would be nearly single-class."""
    order = list(range(n))
    # A string seed goes through SHA-512 in `random.seed`: stable across Python versions.
    random.Random(f"visionloop-order:{seed}").shuffle(order)
    return order
