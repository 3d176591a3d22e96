"""Parallel plumbing for ingest: a bounded, ordered map over an executor, the context worker
processes start from, and the hashing done in threads."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from multiprocessing.context import BaseContext
from typing import TypeVar

from visionloop.core.errors import DataError
from visionloop.core.fsutil import NotRegularFileError, open_regular
from visionloop.data.imageio import (
    Normalised,
    Rejection,
    RejectReason,
    empty_file,
    init_worker,
    normalise_files,
    not_a_file,
    unreadable,
)
from visionloop.data.manifest import ImagePolicy

_T = TypeVar("_T")
_R = TypeVar("_R")

FileHash = tuple[str, int]  # (sha256 hex, size in bytes)


def ordered_map(executor: Executor, fn: Callable[[_T], _R], items: Iterable[_T], window: int) -> Iterator[_R]:
    """`executor.map` that keeps at most `window` tasks in flight. The stdlib `map` submits
    everything at once, so a fast pool feeding a slow consumer would buffer the whole dataset."""
    pending: deque[Future[_R]] = deque()
    for item in items:
        pending.append(executor.submit(fn, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def worker_context() -> BaseContext:
    """Never plain fork: the parent may hold threads (litdata, torch) that fork would copy
    mid-operation. A fork server is a clean single-threaded process that already imported the
    worker's modules, so after the first ingest in a process (tests, notebooks, the API
    server) a pool starts in milliseconds instead of re-importing numpy and Pillow per worker."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")  # Windows
    ctx = multiprocessing.get_context("forkserver")
    # Takes effect only if the server is not running yet. "__main__" is imported once in the
    # server; otherwise every worker would import the parent's main module again.
    ctx.set_forkserver_preload(["__main__", "visionloop.data.imageio"])
    return ctx


def hash_file(path: str) -> FileHash | Rejection:
    """sha256 and size of a file, read-only; files that cannot be used are rejected here,
    before they could be paired as "duplicates" (every empty file has the same hash)."""
    try:
        with open_regular(path) as f:  # a FIFO would hang here, /dev/zero never end
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return empty_file()
            return hashlib.file_digest(f, "sha256").hexdigest(), size
    except NotRegularFileError as e:
        return not_a_file(e)
    except FileNotFoundError:
        return Rejection(
            RejectReason.MISSING_FILE, "does not exist; fix its path or remove it from the source"
        )
    except OSError as e:
        return unreadable(e)


def hash_files(paths: Sequence[str]) -> list[FileHash | Rejection]:
    return [hash_file(p) for p in paths]


def chunks(seq: Sequence[_T], size: int) -> Iterator[Sequence[_T]]:
    for i in range(0, len(seq), size):
        yield seq[i : i + size]


def decode_batches(
    order: Sequence[int], sizes: Sequence[int], workers: int, max_files: int, max_bytes: int
) -> Iterator[list[int]]:
    """`order` cut into decode batches of at most `max_files` files or `max_bytes` source bytes
    (a file bigger than that is a batch of its own), and at least ~4 batches per worker, so a
    small dataset still spreads over every worker."""
    cap = max(1, min(max_files, len(order) // (4 * max(1, workers))))
    batch: list[int] = []
    size = 0
    for i in order:
        if batch and (len(batch) >= cap or size + sizes[i] > max_bytes):
            yield batch
            batch, size = [], 0
        batch.append(i)
        size += sizes[i]
    if batch:
        yield batch


def decode_in_pool(
    batches: Sequence[list[int]],
    *,
    path_of: Callable[[int], str],
    rel_of: Callable[[int], str],
    policy: ImagePolicy,
    workers: int,
    store: Callable[[int, Normalised | Rejection], None],
    progress: Callable[[int], None],
) -> None:
    """Decode and normalise every image of `batches` in worker processes and hand each outcome
    to `store` in batch order (so shards are written in the planned order whatever finishes
    first); `progress(done)` after each batch. Every ingest shares this loop: what a task adds
    is only what it stores per image."""
    workers = max(1, min(workers, len(batches)))
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=worker_context(), initializer=init_worker)
    work = partial(normalise_files, policy=policy)
    paths = ([path_of(i) for i in b] for b in batches)
    done = 0
    try:
        results = ordered_map(pool, work, paths, workers * 3)
        for batch in batches:
            try:
                outcomes = next(results)
            except BrokenProcessPool as e:
                shown = ", ".join(rel_of(i) for i in batch[:5])
                raise DataError(
                    "a decode worker process died (it could not start, ran out of memory, or crashed "
                    f"inside an image codec) while reading one of: {shown}. If it recurs on the same "
                    "files, move them aside and run ingest again. (Calling ingest() from a script? "
                    'Guard the call with `if __name__ == "__main__":` - workers re-import the main '
                    "module.)"
                ) from e
            for i, outcome in zip(batch, outcomes, strict=True):
                store(i, outcome)
            done += len(batch)
            progress(done)
    finally:
        # Ctrl-C or an error: drop queued batches instead of decoding them for nothing.
        pool.shutdown(wait=True, cancel_futures=True)
