"""Build a dataset folder from labelled images: `ingest(source, out, options)`.

`ingest` hands the source to the task that reads it (`Task.claims_source`, or the task whose
`source_formats` hold `options.format`; classification, the fallback, reads an ImageFolder or
a CSV with `ingest_images`). A task's own ingest builds on the helpers here and in
`ingest_pool`, `imageio`, `split`, `ingest_stats` and `publish`.

`ingest_images` runs these stages, each in its own module:

1. list the source (`sources`): layout errors surface here, before any work;
2. hash every file (`ingest_pool`; threads, as file reads and hashlib release the GIL) and
   find byte duplicates;
3. plan (`split`): assign splits from content hashes, fix a seeded write order;
4. decode, check and normalise every image in worker processes (`imageio`), streaming results
   in order into one litdata shard writer per split; memory stays bounded by a small window
   of batches in flight, whatever the dataset's size;
5. write `dataset.json` (counts and statistics from `ingest_stats`), `rejected.jsonl`,
   `duplicates.jsonl`, and move the finished folder into place (`publish`): `out` never
   holds half a dataset.

A CSV's extra columns are per-image metadata (`metadata`): written beside the shards, one
line per record in the same order, listed in the manifest and covered by the version; a
source without them gives the dataset it always gave.

Options and the report live in `ingest_options` and are re-exported here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

from visionloop import __version__
from visionloop.core.errors import DataError
from visionloop.data.imageio import Normalised, Rejection, RejectReason
from visionloop.data.ingest_options import IngestOptions, IngestReport, ProgressFn, default_workers
from visionloop.data.ingest_pool import (
    chunks,
    decode_batches,
    decode_in_pool,
    hash_files,
    ordered_map,
)
from visionloop.data.ingest_stats import SPLIT_NAMES, StatsAccumulator, dataset_version
from visionloop.data.manifest import (
    DUPLICATES_NAME,
    MANIFEST_NAME,
    REJECTED_NAME,
    SHARDS_DIR,
    DatasetManifest,
    SourceInfo,
    SplitName,
    SplitPolicy,
    write_manifest,
)
from visionloop.data.metadata import MetadataWriter
from visionloop.data.publish import building, publish
from visionloop.data.shards import Record, ShardWriter
from visionloop.data.sources import LINK_OUTSIDE, SourceListing, list_source
from visionloop.data.split import Duplicate, assign_splits, find_duplicates, write_order

__all__ = ["IngestOptions", "IngestReport", "ProgressFn", "default_workers", "ingest", "ingest_images"]

# Decode batches, shared with the tasks' own ingests.
BATCH_FILES = 64
BATCH_BYTES = 4 * 1024 * 1024

log = logging.getLogger(__name__)
# A decode batch holds at most BATCH_FILES files or BATCH_BYTES source bytes: enough to amortise
# the IPC round trip, small enough that the batches in flight (3 per worker) never hold much memory.


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
    check_out(out, listing.root, (c.path for c in listing.candidates), overwrite)


def check_out(out: Path, root: Path, source_files: Iterable[str], overwrite: bool) -> None:
    """Refuse an `out` that is a file, not empty without --overwrite, not a dataset, or that
    holds the source (replacing it would delete source files)."""
    out_s, root_s = str(out), str(root)
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
    if _is_within(root_s, out_s) or any(_is_within(path, out_s) for path in source_files):
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
    """Build a dataset at `out` from `source`, with the ingest of the task that reads it: the
    task that claims the source's layout (`Task.claims_source`), or the one that reads
    `options.format`; an ImageFolder or CSV (classification) otherwise.

    Raises `DataError` for an unusable source or `out` (before any work). Bad images never
    raise: they are listed in `out/rejected.jsonl`. On any exception (Ctrl-C included) `out`
    is left as it was.
    """
    options = options or IngestOptions()
    # Imported here: the tasks build on this package, which must not need them at import.
    from visionloop.tasks.registry import task_for_source

    task = task_for_source(Path(source), options.format)
    return task.ingest(Path(source), Path(out), options, progress)


def ingest_images(
    source: Path,
    out: Path,
    options: IngestOptions | None = None,
    progress: ProgressFn | None = None,
) -> IngestReport:
    """Build a classification dataset at `out` from an ImageFolder or CSV `source` (what
    `ingest` does for a source no other task claims); same guarantees as `ingest`."""
    options = options or IngestOptions()
    started = time.monotonic()
    notify = progress or (lambda stage, done, total: None)
    # resolve(): the containment checks below compare real paths, symlinks followed.
    out = Path(out).expanduser().resolve()
    listing = list_source(Path(source), follow_links=options.follow_links)
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
        self.metadata: MetadataWriter | None = None
        # Links leading outside the source, not followed: rejected before any work.
        self.rejections.extend(
            {"path": link.rel, "label": link.label, "reason": LINK_OUTSIDE, "message": link.message}
            for link in listing.links
        )

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
            batches = list(chunks(range(len(cands)), 16))
            paths = ([cands[i].path for i in b] for b in batches)
            results = ordered_map(pool, hash_files, paths, threads * 4)
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
        return decode_batches(self.order, self.sizes, workers, BATCH_FILES, BATCH_BYTES)

    def decode_and_write(self) -> None:
        cands = self.listing.candidates
        writers = {s: ShardWriter(self.tmp / SHARDS_DIR / s) for s in SPLIT_NAMES}
        batches = list(self._batches(self.options.workers))
        self.progress("decode", 0, len(self.order))
        columns = self.listing.metadata_columns
        self.metadata = MetadataWriter(self.tmp, columns) if columns else None
        with self.metadata or contextlib.nullcontext():
            decode_in_pool(
                batches,
                path_of=lambda i: cands[i].path,
                rel_of=lambda i: cands[i].rel,
                policy=self.policy,
                workers=self.options.workers,
                store=lambda i, outcome: self._store(i, outcome, writers),
                progress=lambda done: self.progress("decode", done, len(self.order)),
            )
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
        if self.metadata is not None:
            self.metadata.add(split, outcome.sha256, self.listing.candidates[i].metadata or {})
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
        write_jsonl(self.tmp / REJECTED_NAME, self.rejections)
        self.reported_duplicates.sort(key=lambda d: str(d["duplicate"]))
        write_jsonl(self.tmp / DUPLICATES_NAME, self.reported_duplicates)
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
        version = dataset_version(self.policy, classes, stored)
        manifest = DatasetManifest(
            version=version if self.metadata is None else self.metadata.version(version),
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
            metadata_columns=None if self.metadata is None else self.metadata.columns,
        )
        write_manifest(self.tmp, manifest)
        return manifest


def write_jsonl(path: Path, rows: Iterable[dict[str, object]] | Iterable[dict[str, str]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
