"""Build a dataset folder from labelled images: `ingest(source, out, options)`.

The stages, each in its own module:

1. list the source (`sources`): layout errors surface here, before any work;
2. hash every file (threads: file reads and hashlib release the GIL) and find byte duplicates;
3. plan (`split`): assign splits from content hashes, fix a seeded write order;
4. decode, check and normalise every image in worker processes (`imageio`), streaming results
   in order into one litdata shard writer per split; memory stays bounded by a small window
   of batches in flight, whatever the dataset's size;
5. write `dataset.json`, `rejected.jsonl`, `duplicates.jsonl`, and move the finished folder
   into place (`publish`): `out` never holds half a dataset.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import TypeVar

from visionloop import __version__
from visionloop.core.errors import DataError
from visionloop.data.imageio import (
    Normalised,
    Rejection,
    RejectReason,
    empty_file,
    init_worker,
    normalise_files,
    unreadable,
)
from visionloop.data.ingest_stats import SPLIT_NAMES, StatsAccumulator, dataset_version
from visionloop.data.manifest import (
    DUPLICATES_NAME,
    MANIFEST_NAME,
    REJECTED_NAME,
    SHARDS_DIR,
    DatasetManifest,
    ImagePolicy,
    SourceInfo,
    SplitName,
    SplitPolicy,
    write_manifest,
)
from visionloop.data.publish import building, publish
from visionloop.data.shards import Record, ShardWriter
from visionloop.data.sources import SourceListing, list_source
from visionloop.data.split import Duplicate, assign_splits, find_duplicates, write_order

log = logging.getLogger(__name__)

ProgressFn = Callable[[str, int, int], None]
"""`progress(stage, done, total)`, called from the calling thread; stage is "hash" or "decode"."""

_T = TypeVar("_T")
_R = TypeVar("_R")
_POLICY_DEFAULTS = ImagePolicy()
# A decode batch holds at most this many files or source bytes: enough to amortise the IPC
# round trip, small enough that the batches in flight (3 per worker) never hold much memory.
_BATCH_FILES = 64
_BATCH_BYTES = 4 * 1024 * 1024


def default_workers() -> int:
    """CPUs this process may use (the affinity mask, which containers and taskset narrow)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class IngestOptions:
    val_fraction: float = 0.1
    test_fraction: float = 0.0
    seed: int = 0
    max_side: int | None = None
    min_side: int = _POLICY_DEFAULTS.min_side
    max_pixels: int = _POLICY_DEFAULTS.max_pixels
    max_aspect: float = _POLICY_DEFAULTS.max_aspect
    workers: int = field(default_factory=default_workers)
    overwrite: bool = False
    keep_duplicates: bool = False
    alpha_background: tuple[int, int, int] = _POLICY_DEFAULTS.alpha_background
    lossy_quality: int = _POLICY_DEFAULTS.lossy_quality

    def __post_init__(self) -> None:
        problems = []
        if not (0.0 <= self.val_fraction < 1.0 and 0.0 <= self.test_fraction < 1.0):
            problems.append("val_fraction and test_fraction must each be in [0, 1), e.g. 0.1")
        elif self.val_fraction + self.test_fraction >= 1.0:
            problems.append("val_fraction + test_fraction must be below 1 to leave images for training")
        if self.max_side is not None and self.max_side < 1:
            problems.append(f"max_side must be a positive number of pixels, e.g. 512 (got {self.max_side})")
        if self.min_side < 1 or self.max_pixels < 1:
            problems.append("min_side and max_pixels must be at least 1")
        if self.max_aspect < 1.0:
            problems.append(f"max_aspect is long side / short side, so at least 1 (got {self.max_aspect})")
        if self.workers < 1:
            problems.append(f"workers must be at least 1 (got {self.workers})")
        if not 1 <= self.lossy_quality <= 100:
            problems.append(f"lossy_quality is a JPEG quality, 1..100 (got {self.lossy_quality})")
        if len(self.alpha_background) != 3 or not all(0 <= c <= 255 for c in self.alpha_background):
            problems.append(
                "alpha_background must be 3 values in 0..255, e.g. (255, 255, 255) "
                f"(got {self.alpha_background})"
            )
        if problems:
            raise DataError("invalid ingest options: " + "; ".join(problems) + ".")

    def image_policy(self) -> ImagePolicy:
        return ImagePolicy(
            max_side=self.max_side,
            alpha_background=self.alpha_background,
            lossy_quality=self.lossy_quality,
            min_side=self.min_side,
            max_pixels=self.max_pixels,
            max_aspect=self.max_aspect,
        )


@dataclass(frozen=True)
class IngestReport:
    out: Path
    manifest: DatasetManifest
    skipped: int  # files without an image extension
    rejected_by_reason: dict[str, int]
    duplicates: int
    conflicting_duplicates: int  # duplicates whose labels differ
    duplicates_kept: bool
    stored_as: dict[str, int]  # "original" / "png" / "jpeg" -> count
    warnings: list[str]
    seconds: float

    @property
    def kept(self) -> int:
        return sum(s.count for s in self.manifest.splits.values())

    @property
    def rejected_file(self) -> Path:
        return self.out / REJECTED_NAME

    @property
    def duplicates_file(self) -> Path:
        return self.out / DUPLICATES_NAME


def _ordered_map(
    executor: Executor, fn: Callable[[_T], _R], items: Iterable[_T], window: int
) -> Iterator[_R]:
    """`executor.map` that keeps at most `window` tasks in flight. The stdlib `map` submits
    everything at once, so a fast pool feeding a slow consumer would buffer the whole dataset."""
    pending: deque[Future[_R]] = deque()
    for item in items:
        pending.append(executor.submit(fn, item))
        if len(pending) >= window:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def _worker_context() -> BaseContext:
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


# ---------------------------------------------------------------------------------------------
# Stage 2: hashes


def _hash_file(path: str) -> tuple[str, int] | Rejection:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size == 0:
                return empty_file()
            return hashlib.file_digest(f, "sha256").hexdigest(), size
    except FileNotFoundError:
        return Rejection(
            RejectReason.MISSING_FILE, "does not exist; fix its path or remove it from the source"
        )
    except OSError as e:
        return unreadable(e)


def _hash_batch(paths: Sequence[str]) -> list[tuple[str, int] | Rejection]:
    return [_hash_file(p) for p in paths]


def _chunks(seq: Sequence[_T], size: int) -> Iterator[Sequence[_T]]:
    for i in range(0, len(seq), size):
        yield seq[i : i + size]


# ---------------------------------------------------------------------------------------------
# Checks on --out


def _is_within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _check_out(out: Path, listing: SourceListing, overwrite: bool) -> None:
    out_s, root_s = str(out), str(listing.root)
    if listing.kind == "imagefolder" and _is_within(out_s, root_s):
        raise DataError(
            f"--out {out} is inside the source {listing.root}; the next ingest would read the dataset "
            f"as a class folder. Choose a folder outside it, e.g. "
            f"--out {listing.root.parent / 'datasets' / listing.root.name}."
        )
    if not out.exists():
        return
    if not out.is_dir():
        raise DataError(f"--out {out} is a file; give a folder path (it is created if missing).")
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise DataError(
            f"--out {out} exists and is not empty; pass --overwrite to replace it, or choose a new folder."
        )
    if not (out / MANIFEST_NAME).is_file():
        raise DataError(
            f"--out {out} is not empty and is not a visionloop dataset (no {MANIFEST_NAME}); refusing to "
            "replace it even with --overwrite. Choose an empty or new folder."
        )
    if _is_within(root_s, out_s) or any(_is_within(c.path, out_s) for c in listing.candidates):
        raise DataError(
            f"--out {out} contains source images; replacing it would delete them. Choose another --out."
        )


# ---------------------------------------------------------------------------------------------
# The whole run


def ingest(
    source: Path,
    out: Path,
    options: IngestOptions | None = None,
    progress: ProgressFn | None = None,
) -> IngestReport:
    """Build a dataset at `out` from an ImageFolder or CSV `source`.

    Raises `DataError` for an unusable source or `out` (before any work). Bad images never
    raise: they are listed in `out/rejected.jsonl`. On any exception (Ctrl-C included) `out`
    is left as it was.
    """
    options = options or IngestOptions()
    started = time.monotonic()
    notify = progress or (lambda stage, done, total: None)
    # resolve(): the containment checks below compare real paths, symlinks followed.
    out = Path(out).expanduser().resolve()
    listing = list_source(Path(source))
    _check_out(out, listing, options.overwrite)
    with building(out) as tmp:
        run = _Run(listing, options, notify, tmp)
        run.hash_and_plan()
        run.decode_and_write()
        manifest = run.finish()
        publish(tmp, out, replace=options.overwrite)
    return IngestReport(
        out=out,
        manifest=manifest,
        skipped=listing.skipped,
        rejected_by_reason=dict(sorted(Counter(r["reason"] for r in run.rejections).items())),
        duplicates=len(run.reported_duplicates),
        conflicting_duplicates=sum(1 for d in run.reported_duplicates if d["labels_conflict"]),
        duplicates_kept=options.keep_duplicates,
        stored_as=dict(run.stats.stored_as),
        warnings=run.warnings,
        seconds=time.monotonic() - started,
    )


class _Run:
    """State of one ingest: the plan, the writers, and what was rejected."""

    def __init__(
        self, listing: SourceListing, options: IngestOptions, progress: ProgressFn, tmp: Path
    ) -> None:
        self.listing = listing
        self.options = options
        self.policy = options.image_policy()
        self.progress = progress
        self.tmp = tmp
        n = len(listing.candidates)
        self.hashes: list[str | None] = [None] * n
        self.sizes: list[int] = [0] * n
        self.splits: dict[int, SplitName] = {}  # listing position -> split, for images to decode
        self.order: list[int] = []
        self.duplicates: list[Duplicate] = []
        self.rejected: dict[int, Rejection] = {}
        self.rejections: list[dict[str, str]] = []
        self.reported_duplicates: list[dict[str, object]] = []
        self.warnings = list(listing.warnings)
        self.stats = StatsAccumulator(listing.classes)

    def _reject(self, i: int, rejection: Rejection) -> None:
        c = self.listing.candidates[i]
        self.rejected[i] = rejection
        self.rejections.append(
            {
                "path": c.rel,
                "label": self.listing.classes[c.label],
                "reason": rejection.reason.value,
                "message": f"{c.rel} {rejection.message}",
            }
        )

    def hash_and_plan(self) -> None:
        cands = self.listing.candidates
        threads = min(32, max(4, 2 * self.options.workers))
        done = 0
        self.progress("hash", 0, len(cands))
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vl-hash") as pool:
            batches = list(_chunks(range(len(cands)), 16))
            paths = ([cands[i].path for i in b] for b in batches)
            results = _ordered_map(pool, _hash_batch, paths, threads * 4)
            for batch, result_batch in zip(batches, results, strict=True):
                for i, result in zip(batch, result_batch, strict=True):
                    if isinstance(result, Rejection):
                        self._reject(i, result)
                    else:
                        self.hashes[i], self.sizes[i] = result
                done += len(batch)
                self.progress("hash", done, len(cands))

        self.duplicates = find_duplicates(self.hashes)
        dropped = set() if self.options.keep_duplicates else {d.duplicate for d in self.duplicates}
        todo = [i for i, h in enumerate(self.hashes) if h is not None and i not in dropped]
        if self.listing.split_from_source:
            self.splits = {i: cands[i].split or "train" for i in todo}
        else:
            o = self.options
            assigned = assign_splits(
                [cands[i].label for i in todo],
                [self.hashes[i] or "" for i in todo],
                [cands[i].rel for i in todo],
                seed=o.seed,
                val_fraction=o.val_fraction,
                test_fraction=o.test_fraction,
            )
            self.splits = dict(zip(todo, assigned, strict=True))
        self.order = [todo[k] for k in write_order(len(todo), self.options.seed)]

    def _batches(self, workers: int) -> Iterator[list[int]]:
        # At least ~4 batches per worker, so a small dataset still spreads over every worker.
        max_files = max(1, min(_BATCH_FILES, len(self.order) // (4 * workers)))
        batch: list[int] = []
        size = 0
        for i in self.order:
            if batch and (len(batch) >= max_files or size + self.sizes[i] > _BATCH_BYTES):
                yield batch
                batch, size = [], 0
            batch.append(i)
            size += self.sizes[i]
        if batch:
            yield batch

    def decode_and_write(self) -> None:
        cands = self.listing.candidates
        writers = {s: ShardWriter(self.tmp / SHARDS_DIR / s) for s in SPLIT_NAMES}
        batches = list(self._batches(self.options.workers))
        workers = max(1, min(self.options.workers, len(batches)))
        pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=_worker_context(),
            initializer=init_worker,
        )
        work = partial(normalise_files, policy=self.policy)
        paths = ([cands[i].path for i in b] for b in batches)
        done = 0
        self.progress("decode", 0, len(self.order))
        try:
            results = _ordered_map(pool, work, paths, workers * 3)
            for batch in batches:
                try:
                    outcomes = next(results)
                except BrokenProcessPool as e:
                    shown = ", ".join(cands[i].rel for i in batch[:5])
                    raise DataError(
                        "a decode worker process died (it could not start, ran out of memory, or crashed "
                        f"inside an image codec) while reading one of: {shown}. If it recurs on the same "
                        "files, move them aside and run ingest again."
                    ) from e
                for i, outcome in zip(batch, outcomes, strict=True):
                    self._store(i, outcome, writers)
                done += len(batch)
                self.progress("decode", done, len(self.order))
        finally:
            # Ctrl-C or an error: drop queued batches instead of decoding them for nothing.
            pool.shutdown(wait=True, cancel_futures=True)
        for split, writer in writers.items():
            writer.close()
            self.stats.set_bytes(split, writer.bytes)

    def _store(self, i: int, outcome: Normalised | Rejection, writers: dict[SplitName, ShardWriter]) -> None:
        if isinstance(outcome, Rejection):
            self._reject(i, outcome)
            return
        if outcome.sha256 != self.hashes[i]:
            self._reject(
                i,
                Rejection(
                    RejectReason.CHANGED_DURING_INGEST,
                    "changed while ingest was running; run ingest again once the source is stable",
                ),
            )
            return
        split = self.splits[i]
        label = self.listing.candidates[i].label
        writers[split].add(Record(image=outcome.data, label=label, index=i))
        self.stats.add(split, label, outcome)

    def _settle_duplicates(self) -> None:
        """Report duplicates of stored images; a duplicate of a rejected file is rejected too
        (same bytes, same fate), and is not counted as a duplicate."""
        cands, classes = self.listing.candidates, self.listing.classes
        for d in self.duplicates:
            kept, dup = cands[d.kept], cands[d.duplicate]
            if d.kept in self.rejected:
                if d.duplicate not in self.rejected:
                    why = self.rejected[d.kept]
                    same = Rejection(why.reason, f"has the same bytes as {kept.rel}, which {why.message}")
                    self._reject(d.duplicate, same)
                continue
            self.reported_duplicates.append(
                {
                    "kept": kept.rel,
                    "duplicate": dup.rel,
                    "sha256": d.sha256,
                    "kept_label": classes[kept.label],
                    "duplicate_label": classes[dup.label],
                    "labels_conflict": kept.label != dup.label,
                    "kept_split": self.splits[d.kept],
                    "duplicate_split": self.splits.get(d.duplicate, dup.split),
                    "dropped": not self.options.keep_duplicates,
                }
            )

    def finish(self) -> DatasetManifest:
        self._settle_duplicates()
        self.rejections.sort(key=lambda r: r["path"])
        _write_jsonl(self.tmp / REJECTED_NAME, self.rejections)
        self.reported_duplicates.sort(key=lambda d: str(d["duplicate"]))
        _write_jsonl(self.tmp / DUPLICATES_NAME, self.reported_duplicates)
        if self.stats.total == 0:
            head = "; ".join(r["message"] for r in self.rejections[:3])
            raise DataError(
                f"no usable images in {self.listing.root}: all {len(self.rejections)} were rejected "
                f"(first: {head}). Fix the files or the limits (--min-side, --max-aspect, --max-pixels)."
            )
        if self.stats.count("train") == 0:
            self.warnings.append("the train split is empty; channel stats are over all stored images")
        classes = self.listing.classes
        cands = self.listing.candidates
        stored = [
            (self.splits[i], classes[cands[i].label], self.hashes[i] or "")
            for i in self.order
            if i not in self.rejected
        ]
        o = self.options
        val_fraction, test_fraction = o.val_fraction, o.test_fraction
        if self.listing.split_from_source:
            # The fractions asked for were not used; record the shares the source gave.
            val_fraction = round(self.stats.count("val") / self.stats.total, 4)
            test_fraction = round(self.stats.count("test") / self.stats.total, 4)
        manifest = DatasetManifest(
            version=dataset_version(self.policy, classes, stored),
            classes=classes,
            splits=self.stats.split_infos(),
            image_policy=self.policy,
            source=SourceInfo(
                kind=self.listing.kind, path=str(self.listing.root), files_seen=self.listing.files_seen
            ),
            split_policy=SplitPolicy(
                seed=o.seed,
                val_fraction=val_fraction,
                test_fraction=test_fraction,
                from_source=self.listing.split_from_source,
            ),
            channel_stats=self.stats.channel_stats(),
            size_stats=self.stats.size_stats(),
            rejected=len(self.rejections),
            duplicates=len(self.reported_duplicates),
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            visionloop_version=__version__,
        )
        write_manifest(self.tmp, manifest)
        return manifest


def _write_jsonl(path: Path, rows: Iterable[dict[str, object]] | Iterable[dict[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
