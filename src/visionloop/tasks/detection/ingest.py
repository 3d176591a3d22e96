"""Build a detection dataset from a COCO, YOLO, Pascal VOC or Label Studio source.

The stages mirror classification ingest (`ingest`), with boxes carried alongside:

1. read the annotations (`annotations`): one typed `DetectionSource`, boxes in pixels of
   the upright image, and an `Issue` for every box, line, image or file left out or repaired;
2. hash every image (threads) and find byte duplicates;
3. plan: the source's split when it gives one, else a seeded split stratified by each image's
   rarest class (`split.rarest_class_groups`), and a seeded write order;
4. decode and normalise every image in worker processes (`imageio`, the same checks and
   `--max-side` as classification), scale its boxes by exactly the factor the image was
   resized by on each axis, clip them to the stored image, and write records of image bytes
   + `encode_boxes` bytes (the record's "boxes" field, with each box's ignore flag: COCO's
   iscrowd, VOC's difficult; `label` = the number of boxes);
5. write `dataset.json` (task "detection", `DetectionStats` as its task_stats), `rejected.jsonl` (every
   reader issue as `Issue.to_row()`, images that failed to decode, boxes lost to scaling)
   and `duplicates.jsonl`, and publish the folder atomically.

Each sample's `metadata` (COCO's own image fields) goes to the generic `MetadataWriter`, one
line per record in the shards' order, and into the version; a source without any writes what
it always wrote.

The source is only ever read.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

from visionloop import __version__
from visionloop.core.errors import DataError
from visionloop.data.imageio import (
    Normalised,
    Rejection,
    RejectReason,
    target_size,
)
from visionloop.data.ingest import BATCH_BYTES, BATCH_FILES, check_out, write_jsonl
from visionloop.data.ingest_options import IngestOptions, IngestReport, ProgressFn
from visionloop.data.ingest_pool import (
    chunks,
    decode_batches,
    decode_in_pool,
    hash_files,
    ordered_map,
)
from visionloop.data.ingest_stats import SPLIT_NAMES, StatsAccumulator, labelled_version
from visionloop.data.manifest import (
    DUPLICATES_NAME,
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
from visionloop.data.shards import ShardWriter, make_record
from visionloop.data.split import Duplicate, assign_splits, find_duplicates, rarest_class_groups, write_order
from visionloop.tasks.detection.annotations import DetectionSource, IssueReason, read_detection_source
from visionloop.tasks.detection.boxes import MAX_BOXES, encode_boxes
from visionloop.tasks.detection.ingest_support import (
    BOX_REASONS,
    IMAGE_REASONS,
    TOO_MANY_BOXES,
    clipped_per_image,
    is_detection_source,
    scale_boxes,
)
from visionloop.tasks.detection.stats import DetectionAccumulator
from visionloop.tasks.detection.task import DetectionTask

__all__ = ["TOO_MANY_BOXES", "ingest_detection", "is_detection_source", "scale_boxes"]

log = logging.getLogger(__name__)


def ingest_detection(
    source: Path,
    out: Path,
    options: IngestOptions | None = None,
    progress: ProgressFn | None = None,
) -> IngestReport:
    """Build a detection dataset at `out` from the annotation source at `source`.

    `options.format` forces the format (else detected). Raises `DataError` for an unusable
    source or `out` before any work; a bad box, line or image never raises: it is a row of
    `out/rejected.jsonl`. On any exception `out` is left as it was."""
    options = options or IngestOptions()
    started = time.monotonic()
    notify = progress or (lambda stage, done, total: None)
    out = Path(out).expanduser().resolve()
    src = read_detection_source(Path(source), options.format)
    check_out(out, src.root, (str(s.image) for s in src.samples), options.overwrite)
    with building(out) as tmp:
        run = _Run(src, options, notify, tmp)
        run.hash_and_plan()
        run.decode_and_write()
        manifest = run.finish()
        publish(tmp, out, replace=options.overwrite)
    kept_rows = Counter(str(r["reason"]) for r in run.rows if r.get("kept"))
    return IngestReport(
        out=out,
        manifest=manifest,
        skipped=0,
        rejected_by_reason=dict(
            sorted(Counter(str(r["reason"]) for r in run.rows if not r.get("kept")).items())
        ),
        duplicates=len(run.reported_duplicates),
        conflicting_duplicates=sum(1 for d in run.reported_duplicates if d["boxes_conflict"]),
        duplicates_kept=options.keep_duplicates,
        stored_as=dict(run.stats.stored_as),
        warnings=run.warnings,
        seconds=time.monotonic() - started,
        repaired_by_reason=dict(sorted(kept_rows.items())),
    )


class _Run:
    """State of one detection ingest: the plan, the writers, the rows of rejected.jsonl."""

    def __init__(self, src: DetectionSource, options: IngestOptions, progress: ProgressFn, tmp: Path) -> None:
        self.src = src
        self.options = options
        self.policy = options.image_policy()
        self.progress = progress
        self.tmp = tmp
        n = len(src.samples)
        self.hashes: list[str | None] = [None] * n
        self.sizes: list[int] = [0] * n
        self.splits: dict[int, SplitName] = {}
        self.order: list[int] = []
        self.from_source = False
        self.rejected: dict[int, tuple[str, str]] = {}  # sample -> (reason, message)
        self.duplicates: list[Duplicate] = []
        self.rows: list[dict[str, object]] = [issue.to_row() for issue in src.issues]
        self.reported_duplicates: list[dict[str, object]] = []
        self.warnings = list(src.warnings)
        self.stats = StatsAccumulator(src.classes)
        self.boxes = DetectionAccumulator(src.classes)
        self.dropped_boxes = sum(1 for i in src.issues if i.reason in BOX_REASONS and not i.kept)
        self.versioned: list[tuple[str, str, bytes]] = []
        self.metadata: MetadataWriter | None = None
        self._clips = clipped_per_image(src)
        self._clips_placed = 0

    def _reject(self, i: int, reason: str, message: str) -> None:
        s = self.src.samples[i]
        self.rejected[i] = (reason, message)
        self.dropped_boxes += len(s.boxes)
        lost = f"; its {len(s.boxes)} box(es) are left out" if s.boxes else ""
        self.rows.append(
            {"path": s.rel, "reason": reason, "message": f"{s.rel} {message}{lost}", "kept": False}
        )

    def hash_and_plan(self) -> None:
        samples = self.src.samples
        threads = min(32, max(4, 2 * self.options.workers))
        done = 0
        self.progress("hash", 0, len(samples))
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="vl-hash") as pool:
            batches = list(chunks(range(len(samples)), 16))
            paths = ([str(samples[i].image) for i in b] for b in batches)
            for batch, results in zip(
                batches, ordered_map(pool, hash_files, paths, threads * 4), strict=True
            ):
                for i, result in zip(batch, results, strict=True):
                    if isinstance(result, Rejection):
                        self._reject(i, result.reason.value, result.message)
                    else:
                        self.hashes[i], self.sizes[i] = result
                done += len(batch)
                self.progress("hash", done, len(samples))

        self.duplicates = find_duplicates(self.hashes)
        dropped = set() if self.options.keep_duplicates else {d.duplicate for d in self.duplicates}
        todo = [i for i, h in enumerate(self.hashes) if h is not None and i not in dropped]
        self._plan_splits(todo)
        self.order = [todo[k] for k in write_order(len(todo), self.options.seed)]

    def _settle_duplicates(self) -> None:
        """Report duplicates of stored images; a duplicate of a rejected image is rejected
        too (same bytes, same fate), as in classification ingest."""
        samples = self.src.samples
        for d in self.duplicates:
            kept, dup = samples[d.kept], samples[d.duplicate]
            if d.kept in self.rejected:
                if d.duplicate not in self.rejected:
                    reason, message = self.rejected[d.kept]
                    self._reject(d.duplicate, reason, f"has the same bytes as {kept.rel}, which {message}")
                continue
            self.reported_duplicates.append(
                {
                    "kept": kept.rel,
                    "duplicate": dup.rel,
                    "sha256": d.sha256,
                    "boxes_conflict": (kept.boxes, kept.labels, kept.difficult)
                    != (dup.boxes, dup.labels, dup.difficult),
                    "kept_split": self.splits.get(d.kept),
                    "duplicate_split": self.splits.get(d.duplicate, dup.split),
                    "dropped": not self.options.keep_duplicates,
                }
            )

    def _plan_splits(self, todo: list[int]) -> None:
        samples = self.src.samples
        given = {samples[i].split for i in todo}
        if given - {None, "train"}:
            self.from_source = True
            if None in given:
                self.warnings.append(
                    f"{sum(1 for i in todo if samples[i].split is None)} image(s) have no split in the "
                    "source while the others do; they go to train"
                )
            self.splits = {i: samples[i].split or "train" for i in todo}
            return
        if "train" in given:
            self.warnings.append(
                "the source names only a train split; val/test are carved out of it by "
                "--val-fraction/--test-fraction"
            )
        o = self.options
        groups = rarest_class_groups([samples[i].labels for i in todo])
        assigned = assign_splits(
            groups,
            [self.hashes[i] or "" for i in todo],
            [samples[i].rel for i in todo],
            seed=o.seed,
            val_fraction=o.val_fraction,
            test_fraction=o.test_fraction,
        )
        self.splits = dict(zip(todo, assigned, strict=True))

    def _batches(self, workers: int) -> Iterator[list[int]]:
        return decode_batches(self.order, self.sizes, workers, BATCH_FILES, BATCH_BYTES)

    def decode_and_write(self) -> None:
        samples = self.src.samples
        fields = DetectionTask.record_fields
        writers = {s: ShardWriter(self.tmp / SHARDS_DIR / s, fields=fields) for s in SPLIT_NAMES}
        batches = list(self._batches(self.options.workers))
        self.progress("decode", 0, len(self.order))
        columns = self.src.metadata_columns
        self.metadata = MetadataWriter(self.tmp, columns) if columns else None
        with self.metadata or contextlib.nullcontext():
            decode_in_pool(
                batches,
                path_of=lambda i: str(samples[i].image),
                rel_of=lambda i: samples[i].rel,
                policy=self.policy,
                workers=self.options.workers,
                store=lambda i, outcome: self._store(i, outcome, writers),
                progress=lambda done: self.progress("decode", done, len(self.order)),
            )
        for split, writer in writers.items():
            writer.close()
            self.stats.set_bytes(split, writer.bytes)

    def _store(self, i: int, outcome: Normalised | Rejection, writers: dict[SplitName, ShardWriter]) -> None:
        sample = self.src.samples[i]
        if isinstance(outcome, Rejection):
            self._reject(i, outcome.reason.value, outcome.message)
            return
        if outcome.sha256 != self.hashes[i]:
            self._reject(
                i,
                RejectReason.CHANGED_DURING_INGEST.value,
                "changed while ingest was running; run ingest again once the source is stable",
            )
            return
        # The reader measured the upright image from its header; the decoder must agree, or
        # the boxes would be scaled onto some other picture.
        expected = target_size(sample.width, sample.height, self.policy.max_side) or (
            sample.width,
            sample.height,
        )
        if (outcome.width, outcome.height) != expected:
            self._reject(
                i,
                IssueReason.IMAGE_SIZE_MISMATCH.value,
                f"decoded to {outcome.width}x{outcome.height}, but its header says {sample.width}x"
                f"{sample.height} upright (expected {expected[0]}x{expected[1]} stored); re-save the image",
            )
            return
        if len(sample.boxes) > MAX_BOXES:
            self._reject(
                i, TOO_MANY_BOXES, f"has {len(sample.boxes)} boxes, over the {MAX_BOXES} one image may hold"
            )
            return
        boxes, labels, kept, moved = scale_boxes(sample, outcome.width, outcome.height)
        for k in sorted(set(range(len(sample.boxes))) - set(kept)):
            x1, y1, x2, y2 = sample.boxes[k]
            self.dropped_boxes += 1
            self.rows.append(
                {
                    "path": sample.rel,
                    "reason": IssueReason.BOX_ZERO_AREA.value,
                    "message": f"{sample.rel}: box ({x1:g}, {y1:g}, {x2:g}, {y2:g}) has no area left once "
                    f"the image is scaled to {outcome.width}x{outcome.height} (--max-side "
                    f"{self.policy.max_side}); raise --max-side to keep it",
                    "kept": False,
                }
            )
        # A reader that gives no flag per box (YOLO, Label Studio) flags none.
        flagged = len(sample.difficult) == len(sample.boxes)
        ignore = [flagged and bool(sample.difficult[k]) for k in kept]
        encoded = encode_boxes(boxes, labels, ignore)
        split = self.splits[i]
        writers[split].add(make_record(outcome.data, len(labels), i, boxes=encoded))
        if self.metadata is not None:
            self.metadata.add(split, outcome.sha256, sample.metadata)
        self.stats.add_image(split, sorted({int(v) for v in labels}), outcome)
        clips = self._clips.get(sample.rel, 0)
        self._clips_placed += clips
        self.boxes.add(split, boxes, labels, clipped=clips + moved, difficult=sum(ignore))
        self.versioned.append((split, outcome.sha256, encoded))

    def finish(self) -> DatasetManifest:
        self._settle_duplicates()
        self.rows.sort(key=lambda r: (str(r["path"]), str(r["reason"])))
        write_jsonl(self.tmp / REJECTED_NAME, self.rows)
        self.reported_duplicates.sort(key=lambda d: str(d["duplicate"]))
        write_jsonl(self.tmp / DUPLICATES_NAME, self.reported_duplicates)
        total = self.stats.total
        if total == 0:
            head = "; ".join(str(r["message"]) for r in self.rows if not r.get("kept"))[:600]
            raise DataError(
                f"no usable images in {self.src.root} ({self.src.format}): every image was left out "
                f"(first: {head}). Fix the annotation file or the images, then run ingest again."
            )
        if self.stats.count("train") == 0:
            self.warnings.append("the train split is empty; channel stats are over all stored images")
        o = self.options
        val_fraction, test_fraction = o.val_fraction, o.test_fraction
        if self.from_source:
            val_fraction = round(self.stats.count("val") / total, 4)
            test_fraction = round(self.stats.count("test") / total, 4)
        # Unplaced clips: of images that were stored, but the issue named no image we could match.
        all_clips = sum(1 for i in self.src.issues if i.reason == IssueReason.BOX_CLIPPED)
        placed_anywhere = sum(self._clips.values())
        images_seen = len(self.src.samples) + sum(
            1 for i in self.src.issues if i.reason in IMAGE_REASONS and not i.kept
        )
        version = labelled_version(DetectionTask.name, self.policy, self.src.classes, self.versioned)
        manifest = DatasetManifest(
            version=version if self.metadata is None else self.metadata.version(version),
            task=DetectionTask.name,
            classes=list(self.src.classes),
            splits=self.stats.split_infos(),
            image_policy=self.policy,
            source=SourceInfo(kind=self.src.format, path=str(self.src.root), files_seen=images_seen),
            split_policy=SplitPolicy(
                seed=o.seed,
                val_fraction=val_fraction,
                test_fraction=test_fraction,
                from_source=self.from_source,
            ),
            channel_stats=self.stats.channel_stats(),
            size_stats=self.stats.size_stats(),
            rejected=sum(1 for r in self.rows if not r.get("kept")),
            duplicates=len(self.reported_duplicates),
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            visionloop_version=__version__,
            task_stats=self.boxes.stats(
                self.dropped_boxes, unplaced_clipped=all_clips - placed_anywhere
            ).model_dump(mode="json"),
            metadata_columns=None if self.metadata is None else self.metadata.columns,
        )
        write_manifest(self.tmp, manifest)
        return manifest
