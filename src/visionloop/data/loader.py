"""DataLoader construction for shard-backed datasets."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from visionloop.data.imageops import decode_rgb

__all__ = ["decode_rgb", "make_loader"]


def _worker_init(_: int) -> None:
    # A stop signal is the trainer's business: it finishes the step and checkpoints. If the
    # workers died on the SIGTERM that a process-group kill also delivers to them, the main
    # process would crash with "DataLoader worker exited unexpectedly" before it could save.
    # The price: the owner must shut the workers down explicitly (Loop.close); if the main
    # process dies, torch's worker watchdog notices the dead parent and they exit.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)
    # Workers decode and resize; more than one intra-op thread each only oversubscribes cores.
    torch.set_num_threads(1)


def make_loader(
    dataset: Dataset[Any],
    batch_sampler: Sampler[Any],
    *,
    workers: int,
    pin_memory: bool = False,
    seed: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader[Any]:
    """A loader over `batch_sampler`'s batches; `collate_fn` is the task's (None: torch's
    default collate)."""
    # An explicit generator keeps DataLoader from drawing its worker base seed from the global
    # RNG, which would otherwise shift dropout masks every time an iterator is created.
    g = torch.Generator()
    g.manual_seed(seed)
    return DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
        worker_init_fn=_worker_init if workers > 0 else None,
        generator=g,
        collate_fn=collate_fn,
    )
