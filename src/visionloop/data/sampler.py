"""Sample order: a pure function of (seed, epoch), resumable at any batch.

The order of epoch `e` is computed, never stored: chunks of the shard folder are permuted,
then samples are shuffled within windows of `window` chunks (reading one chunk at a time is
several times faster than jumping between chunks, and ingest already wrote each chunk in a
shuffled class mix). Batch `b` of the epoch is positions [b*G, (b+1)*G) of that order, and
rank `r` of `W` takes its contiguous share of it. So:

- resuming at (epoch, batch) needs nothing but those two integers;
- a DDP run with W processes sees, step for step, the same global batches as a single
  process with the same global batch size;
- the sampler, not the DataLoader, decides the order, so the number of workers and their
  prefetching never change which samples a step gets.

A held-out fold (`data.holdout`, for out-of-fold predictions) is dropped from each epoch's
order after it is computed, so the rest keep the order they would have had and the fold is
again a pure function of (train images, folds, seed): `holdout_positions`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

# Each batch element is (record position in the shard folder, epoch): the epoch travels with
# the index so that per-sample augmentation seeds need no shared state with the workers.
SampleKey = tuple[int, int]


def _generator(seed: int, epoch: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + epoch * 7_919 + 12_345) % (2**63))
    return g


def epoch_order(chunk_sizes: Sequence[int], seed: int, epoch: int, window: int) -> torch.Tensor:
    """The permutation of record positions for one epoch (int64 tensor)."""
    g = _generator(seed, epoch)
    starts = [0]
    for size in chunk_sizes:
        starts.append(starts[-1] + size)
    chunk_perm = torch.randperm(len(chunk_sizes), generator=g).tolist()
    parts: list[torch.Tensor] = []
    for w in range(0, len(chunk_perm), window):
        members = [torch.arange(starts[c], starts[c + 1]) for c in chunk_perm[w : w + window]]
        block = torch.cat(members) if members else torch.empty(0, dtype=torch.int64)
        parts.append(block[torch.randperm(block.numel(), generator=g)])
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def holdout_positions(num_samples: int, folds: int, fold: int, seed: int) -> list[int]:
    """The record positions of fold `fold` of `folds`, ascending: a seeded permutation of all
    positions dealt out round-robin, so folds differ in size by at most one image and every
    image is in exactly one fold. Deliberately not `epoch_order`'s generator (whose seed is the
    training seed): which images a fold holds must not change with the training seed."""
    if not 0 <= fold < folds:
        raise ValueError(f"fold {fold} outside 0..{folds - 1}")
    g = torch.Generator()
    g.manual_seed((seed * 2_654_435_761 + 97) % (2**63))
    perm = torch.randperm(num_samples, generator=g)
    return sorted(perm[fold::folds].tolist())


class ResumableBatchSampler(Sampler[list[SampleKey]]):
    """Yields this rank's share of each global training batch, from a settable position."""

    def __init__(
        self,
        chunk_sizes: Sequence[int],
        global_batch: int,
        *,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        window: int = 8,
        exclude: Sequence[int] = (),
    ) -> None:
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} is not divisible by {world_size} processes")
        self.chunk_sizes = list(chunk_sizes)
        total = sum(self.chunk_sizes)
        # Positions never yielded (a held-out fold); None when there are none, so the common
        # case pays nothing per epoch.
        self.keep: torch.Tensor | None = None
        if exclude:
            self.keep = torch.ones(total, dtype=torch.bool)
            self.keep[torch.as_tensor(list(exclude), dtype=torch.int64)] = False
        self.num_samples = total if self.keep is None else int(self.keep.sum())
        self.global_batch = global_batch
        self.local_batch = global_batch // world_size
        self.seed = seed
        self.rank = rank
        self.window = window
        # The last partial batch is dropped: every step has the same global batch size,
        # which keeps the LR schedule and BatchNorm statistics independent of world size.
        self.steps_per_epoch = self.num_samples // global_batch
        self.epoch = 0
        self.start_batch = 0

    def set_position(self, epoch: int, batch: int) -> None:
        if not 0 <= batch <= self.steps_per_epoch:
            raise ValueError(f"batch {batch} outside 0..{self.steps_per_epoch}")
        self.epoch, self.start_batch = epoch, batch

    def __len__(self) -> int:
        return self.steps_per_epoch - self.start_batch

    def __iter__(self) -> Iterator[list[SampleKey]]:
        epoch = self.epoch
        order = epoch_order(self.chunk_sizes, self.seed, epoch, self.window)
        if self.keep is not None:
            order = order[self.keep[order]]
        for b in range(self.start_batch, self.steps_per_epoch):
            lo = b * self.global_batch + self.rank * self.local_batch
            yield [(int(i), epoch) for i in order[lo : lo + self.local_batch].tolist()]


class EvalBatchSampler(Sampler[list[SampleKey]]):
    """Every record exactly once, in order, strided over ranks (no padding, no dropping),
    so per-rank confusion matrices sum to the exact whole."""

    def __init__(self, num_samples: int, batch_size: int, *, rank: int = 0, world_size: int = 1) -> None:
        self.positions = list(range(rank, num_samples, world_size))
        self.batch_size = batch_size

    def __len__(self) -> int:
        return -(-len(self.positions) // self.batch_size)

    def __iter__(self) -> Iterator[list[SampleKey]]:
        for i in range(0, len(self.positions), self.batch_size):
            yield [(p, 0) for p in self.positions[i : i + self.batch_size]]
