"""`visionloop data add`: a new dataset version made from a parent version and a labelled folder.

The new version holds the parent's records, then the folder's images the parent does not
hold (added, each split by the parent's split policy unless the folder names splits), and the
folder's labels for images the parent does hold (relabelled: same stored bytes, new labels;
the image keeps its split and its record index, which seeds its augmentation). The folder is
read like any source (`ingest`, with the parent's image policy), so the images it adds are
decoded and checked; the parent's never are:

- a parent chunk file with no relabelled record is hard-linked into the new version (copied
  where the filesystem cannot link): same bytes, no second copy on disk;
- a chunk holding a relabelled record is written again, record by record, image bytes copied;
- the statistics are merged: counts from the records' labels, sizes from the image headers,
  the train split's channel means and deviations from the parent's and the new images' own,
  weighted by pixel count (header sizes again);
- the manifest's `lineage` records the step (parent version and folder, what was added and
  relabelled, from which folder, picked by which selection, at what labelling cost) ahead of
  the parent's own lineage, so the chain goes back to the first version.

Like ingest, the version is built beside `out` and appears there only once complete; the
parent is only ever read.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from visionloop import __version__
from visionloop.core.errors import DataError
from visionloop.core.fsutil import link_or_copy
from visionloop.data.ingest_options import IngestOptions, IngestReport, ProgressFn, default_workers
from visionloop.data.ingest_stats import SPLIT_NAMES
from visionloop.data.manifest import (
    DUPLICATES_NAME,
    FORMAT_VERSION,
    MAX_LINEAGE,
    METADATA_DIR,
    REJECTED_NAME,
    SHARDS_DIR,
    ChannelStats,
    DatasetManifest,
    LineageStep,
    SizeStats,
    SourceInfo,
    SplitInfo,
    SplitName,
    shard_dir_of,
    write_manifest,
)
from visionloop.data.metadata import canonical_line, load_metadata, metadata_version
from visionloop.data.publish import building, publish
from visionloop.data.shardcheck import INDEX_NAME, check_dataset, check_shard_index, load_shard_index
from visionloop.data.shards import Record, ShardReader, ShardWriter, extra_fields, make_record
from visionloop.tasks import Task, get_task

# A labelling price above this per image is a typo (a cent amount given in euros x 100?).
MAX_COST_PER_IMAGE = 1000.0


@dataclass(frozen=True)
class AddReport:
    """What `add_images` made, and what reading the folder found."""

    out: Path
    manifest: DatasetManifest
    added: dict[SplitName, int]
    relabelled: int
    unchanged: int  # folder images the parent holds with the same labels: nothing to do
    linked_chunks: int  # parent chunk files hard-linked (or copied) as they are
    rewritten_chunks: int  # parent chunk files written again for their relabelled records
    ingest: IngestReport  # reading the folder: rejections, duplicates, warnings
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _Entry:
    """One record of the new version, without its image bytes."""

    sha256: str
    width: int
    height: int
    classes: tuple[int, ...]
    labels: bytes  # what identifies the record's labels (label and extra fields)
    record: Record  # image bytes left out: the stats and a relabel need only the labels


def _label_bytes(record: Record) -> bytes:
    """The record's labels as bytes: its label, then each extra field (compared to find a
    relabel, hashed into the version)."""
    parts = [str(int(record["label"])).encode()]
    parts += list(extra_fields(record).values())
    return b"\0".join(hashlib.sha256(p).digest() for p in parts)


def _header_size(image: bytes, where: str) -> tuple[int, int]:
    """(width, height) from the encoded image's header; the pixels are not decoded."""
    try:
        with Image.open(io.BytesIO(image)) as im:
            return int(im.size[0]), int(im.size[1])
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(
            f"{where} holds an image whose header cannot be read ({e}); re-ingest the dataset."
        ) from e


def _entry(task: Task, record: Record, where: str) -> _Entry:
    width, height = _header_size(record["image"], where)
    bare = make_record(
        b"",
        int(record["label"]),
        int(record["index"]),
        **extra_fields(record),
    )
    return _Entry(
        sha256=hashlib.sha256(record["image"]).hexdigest(),
        width=width,
        height=height,
        classes=task.record_classes(record),
        labels=_label_bytes(record),
        record=bare,
    )


def _records(reader: ShardReader) -> Iterator[Record]:
    for start in range(0, len(reader), 256):
        yield from reader.read_many(range(start, min(start + 256, len(reader))))


def _index_doc(shard_dir: Path) -> dict[str, Any]:
    """A shard folder's index.json, once `check_shard_index` has accepted it."""
    return load_shard_index(shard_dir)[1]


class _SplitWriter:
    """Assembles one split's shard folder from whole chunk files: the parent's, linked, and
    the ones written for relabels and additions, renamed in order as chunk-0-N.bin."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        self.chunks: list[dict[str, Any]] = []
        self.config: dict[str, Any] | None = None

    def _name(self) -> str:
        return f"chunk-0-{len(self.chunks)}.bin"

    def link(self, folder: Path, chunk: dict[str, Any], config: dict[str, Any]) -> None:
        name = self._name()
        link_or_copy(folder / chunk["filename"], self.out_dir / name)
        self.chunks.append({**chunk, "filename": name})
        self.config = self.config or config

    def take(self, folder: Path) -> None:
        """Every chunk of a folder a ShardWriter wrote (moved, not copied)."""
        doc = _index_doc(folder)
        for chunk in doc["chunks"]:
            name = self._name()
            (folder / chunk["filename"]).rename(self.out_dir / name)
            self.chunks.append({**chunk, "filename": name})
        if doc["config"] is not None:
            self.config = self.config or doc["config"]
        shutil.rmtree(folder)

    def close(self) -> None:
        if not self.chunks or self.config is None:
            doc: dict[str, Any] = {"chunks": [], "config": None}
        else:
            doc = {"chunks": self.chunks, "config": self.config, "updated_at": str(time.time())}
        (self.out_dir / INDEX_NAME).write_text(json.dumps(doc, sort_keys=True))
        check_shard_index(self.out_dir)  # what every reader will check: fail here, not there


class _PixelMoments:
    """Per-channel sums over pixels, rebuilt from a manifest's means and deviations and the
    pixel count its images' headers give (the manifest keeps six rounded numbers, so the
    merge is exact to their rounding, ~1e-6)."""

    def __init__(self) -> None:
        self.pixels = 0
        self.sum = [0.0, 0.0, 0.0]
        self.sq_sum = [0.0, 0.0, 0.0]

    def add_image(self, image: bytes) -> None:
        with Image.open(io.BytesIO(image)) as im:
            x = np.asarray(im.convert("RGB"), dtype=np.float64).reshape(-1, 3) / 255.0
        self.pixels += len(x)
        for c in range(3):
            self.sum[c] += float(x[:, c].sum())
            self.sq_sum[c] += float((x[:, c] ** 2).sum())

    def merge(self, other: _PixelMoments) -> None:
        self.pixels += other.pixels
        for c in range(3):
            self.sum[c] += other.sum[c]
            self.sq_sum[c] += other.sq_sum[c]

    def add(self, stats: ChannelStats, pixels: int) -> None:
        self.pixels += pixels
        for c in range(3):
            m, s = stats.mean[c], stats.std[c]
            self.sum[c] += m * pixels
            self.sq_sum[c] += (s * s + m * m) * pixels

    def stats(self) -> ChannelStats:
        n = max(self.pixels, 1)
        mean = [self.sum[c] / n for c in range(3)]
        std = [math.sqrt(max(0.0, self.sq_sum[c] / n - mean[c] ** 2)) for c in range(3)]
        return ChannelStats(
            mean=(round(mean[0], 6), round(mean[1], 6), round(mean[2], 6)),
            std=(round(std[0], 6), round(std[1], 6), round(std[2], 6)),
        )


def _stats_split(m: DatasetManifest) -> tuple[SplitName, ...]:
    """The splits a manifest's channel stats are over: train, or every split without one."""
    train = m.splits.get("train")
    return ("train",) if train is not None and train.count else tuple(m.splits)


def _ingest_options(parent: DatasetManifest, workers: int | None) -> IngestOptions:
    p, s = parent.image_policy, parent.split_policy
    return IngestOptions(
        val_fraction=s.val_fraction,
        test_fraction=s.test_fraction,
        seed=s.seed,
        max_side=p.max_side,
        min_side=p.min_side,
        max_pixels=p.max_pixels,
        max_aspect=p.max_aspect,
        alpha_background=p.alpha_background,
        lossy_quality=p.lossy_quality,
        workers=workers if workers is not None else default_workers(),
    )


def _class_mapping(parent: DatasetManifest, incoming: DatasetManifest, source: Path) -> list[int]:
    index = {name: i for i, name in enumerate(parent.classes)}
    unknown = [name for name in incoming.classes if name not in index]
    if unknown:
        raise DataError(
            f"{source} labels images with class(es) {', '.join(map(repr, unknown[:10]))} that the parent "
            f"dataset does not have ({', '.join(parent.classes[:20])}). A new version keeps its parent's "
            "classes (a model's head is sized by them); relabel those images with one of them, or ingest "
            "a new dataset with `visionloop data ingest`."
        )
    return [index[name] for name in incoming.classes]


def _version(parent: DatasetManifest, changes: list[tuple[str, ...]]) -> str:
    """sha256 over the parent's version and this step's changes (each added image's split,
    hash and labels; each relabelled image's hash and new labels): two steps that make the
    same changes to the same parent make the same version."""
    h = hashlib.sha256()
    head = {"format_version": FORMAT_VERSION, "parent": parent.version, "classes": parent.classes}
    h.update(json.dumps(head, sort_keys=True, separators=(",", ":")).encode())
    for change in sorted(changes):
        h.update(b"\n" + json.dumps(list(change), separators=(",", ":")).encode())
    return h.hexdigest()


def add_images(
    parent: Path,
    source: Path,
    out: Path,
    *,
    selection: Path | None = None,
    cost_per_image: float | None = None,
    workers: int | None = None,
    overwrite: bool = False,
    progress: ProgressFn | None = None,
) -> AddReport:
    """Make the version of `parent` with `source`'s labelled images (a folder `visionloop
    label import` writes, or any source `visionloop data ingest` reads) at `out`."""
    started = time.monotonic()
    notify = progress or (lambda stage, done, total: None)
    parent = Path(parent).expanduser().resolve()
    out = Path(out).expanduser().resolve()
    if out == parent or out.is_relative_to(parent) or parent.is_relative_to(out):
        raise DataError(
            f"--out {out} overlaps the parent dataset {parent}; a new version goes to a new folder "
            "beside it (the parent is only ever read), e.g. --out DATASETS/NAME-v2."
        )
    src = Path(source).expanduser().resolve()
    for what, other in (("--out", out), ("the parent dataset", parent)):
        # A source that is (or holds, or lies in) the new version would be replaced by it with
        # --overwrite, or read while being written; one that is (or holds) the parent would add
        # the dataset's own files to itself.
        if src == other or src.is_relative_to(other) or other.is_relative_to(src):
            raise DataError(
                f"the source {src} overlaps {what} {other}; give the folder of newly labelled images "
                "(what `visionloop label import` wrote), kept apart from the datasets."
            )
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise DataError(
            f"--out {out} exists and is not empty; pass --overwrite to replace it, or choose a new folder."
        )
    if cost_per_image is not None and not (0.0 <= cost_per_image <= MAX_COST_PER_IMAGE):
        raise DataError(
            f"--cost-per-image {cost_per_image} is not a price per image (0 to {MAX_COST_PER_IMAGE:g}); "
            "give the price of labelling one image, e.g. 0.15."
        )
    if selection is not None and not Path(selection).is_file():
        raise DataError(
            f"--selection {selection} is not a file; give the file `visionloop label select --out` wrote."
        )
    pm = check_dataset(parent)
    if len(pm.lineage or ()) >= MAX_LINEAGE:
        # The new version's lineage would be one step past what read_manifest accepts: it
        # would be written, then refused by every reader. Refused here, before any work.
        raise DataError(
            f"{parent} already records {MAX_LINEAGE} lineage steps, the most a version may hold; "
            "ingest it afresh (`visionloop data ingest`) to start a new history, then add to that."
        )
    task = get_task(pm.task)
    from visionloop.data.ingest import ingest

    with building(out) as tmp:
        report = ingest(Path(source), tmp / "incoming", _ingest_options(pm, workers), notify)
        im = report.manifest
        if im.task != pm.task:
            raise DataError(
                f"{source} was read as a {im.task} source, but the parent dataset is {pm.task}: a new "
                f"version must be labelled for the same task. Give a {pm.task} source (for {pm.task}, "
                f"what `visionloop label import` writes from this dataset's model)."
            )
        step = _Merge(task, pm, parent, im, tmp / "incoming", tmp, notify)
        step.run(_class_mapping(pm, im, Path(source)))
        if not step.added_total and not step.relabelled:
            raise DataError(
                f"{source} adds no image and changes no label of {parent} (its {step.unchanged} image(s) "
                "are already in it with the same labels): there is no new version to make."
            )
        labelled = step.added_total + step.relabelled
        lineage = LineageStep(
            parent=pm.version,
            parent_path=str(parent),
            added={s: n for s, n in step.added.items() if n},
            relabelled=step.relabelled,
            source=str(Path(source).expanduser().resolve()),
            selection=str(Path(selection).resolve()) if selection is not None else None,
            labelling_cost=None if cost_per_image is None else round(cost_per_image * labelled, 6),
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        )
        manifest = step.manifest(Path(source), lineage)
        for name in (REJECTED_NAME, DUPLICATES_NAME):
            shutil.copyfile(tmp / "incoming" / name, tmp / name)
        shutil.rmtree(tmp / "incoming")
        write_manifest(tmp, manifest)
        publish(tmp, out, replace=overwrite)
    return AddReport(
        out=out,
        manifest=manifest,
        added=dict(step.added),
        relabelled=step.relabelled,
        unchanged=step.unchanged,
        linked_chunks=step.linked,
        rewritten_chunks=step.rewritten,
        ingest=report,
        warnings=step.warnings,
        seconds=time.monotonic() - started,
    )


class _Merge:
    """The parent's records and the incoming ones, into the new version's folder `tmp`."""

    def __init__(
        self,
        task: Task,
        parent: DatasetManifest,
        parent_dir: Path,
        incoming: DatasetManifest,
        incoming_dir: Path,
        tmp: Path,
        progress: Callable[[str, int, int], None],
    ) -> None:
        self.task, self.pm, self.parent_dir = task, parent, parent_dir
        self.im, self.incoming_dir, self.tmp = incoming, incoming_dir, tmp
        self.progress = progress
        self.entries: dict[SplitName, list[_Entry]] = {s: [] for s in SPLIT_NAMES}
        self.where: dict[str, tuple[SplitName, int]] = {}  # image sha256 -> (split, position)
        self.relabels: dict[SplitName, dict[int, Record]] = {s: {} for s in SPLIT_NAMES}
        self.added: Counter[SplitName] = Counter()
        self.relabelled = 0
        self.unchanged = 0
        self.linked = 0
        self.rewritten = 0
        self.changes: list[tuple[str, ...]] = []
        self.bytes: Counter[SplitName] = Counter()
        self.warnings: list[str] = []
        # The new images' own pixel sums (decoded once more: ingest checked them; the parent's
        # images are not decoded), over the splits the channel statistics cover.
        self.stats_splits = _stats_split(parent)
        self.added_moments = _PixelMoments()
        self.added_lines: dict[SplitName, list[str]] = {s: [] for s in SPLIT_NAMES}
        self.lines: dict[SplitName, list[str]] = {}  # each split's metadata lines, when it keeps any

    @property
    def added_total(self) -> int:
        return sum(self.added.values())

    def run(self, mapping: list[int]) -> None:
        self._read_parent()
        self._read_incoming(mapping)
        self._write()

    # ------------------------------------------------------------------ reading
    def _read_parent(self) -> None:
        total = sum(i.count for i in self.pm.splits.values())
        done = 0
        self.progress("parent", 0, total)
        self.next_index = 0
        for split, info in self.pm.splits.items():
            if not info.count:
                continue
            reader = ShardReader(shard_dir_of(self.parent_dir, info))
            self.task.check_records(reader)
            for pos, record in enumerate(_records(reader)):
                e = _entry(self.task, record, f"{self.parent_dir} ({split} record {pos})")
                self.where.setdefault(e.sha256, (split, pos))
                self.entries[split].append(e)
                self.bytes[split] += len(record["image"])
                self.next_index = max(self.next_index, int(record["index"]) + 1)
                done += 1
                if done % 1024 == 0:
                    self.progress("parent", done, total)
        self.progress("parent", done, total)

    def _read_incoming(self, mapping: list[int]) -> None:
        columns = self.pm.metadata_columns
        if self.im.metadata_columns and not columns:
            self.warnings.append(
                f"the new images' metadata ({', '.join(self.im.metadata_columns)}) is left out: the parent "
                "dataset keeps none"
            )
        for split, info in self.im.splits.items():
            if not info.count:
                continue
            reader = ShardReader(shard_dir_of(self.incoming_dir, info))
            meta = load_metadata(self.incoming_dir, self.im, split) if columns else None
            writer = ShardWriter(self.tmp / "added" / split, fields=self.task.record_fields)
            for pos, raw in enumerate(_records(reader)):
                record = self.task.remap_classes(raw, mapping)
                e = _entry(self.task, record, f"{self.incoming_dir} ({split} record {pos})")
                found = self.where.get(e.sha256)
                if found is not None:
                    self._relabel(found, e)
                    continue
                record = make_record(
                    record["image"],
                    int(record["label"]),
                    self.next_index,
                    **extra_fields(record),
                )
                self.next_index += 1
                writer.add(record)
                if split in self.stats_splits:
                    self.added_moments.add_image(record["image"])
                e.record["index"] = record["index"]
                self.entries[split].append(e)
                self.added[split] += 1
                self.bytes[split] += len(record["image"])
                self.changes.append(("added", split, e.sha256, e.labels.hex()))
                if columns is not None:
                    values = meta[pos] if meta is not None else {}
                    self.added_lines[split].append(
                        canonical_line({c: values[c] for c in columns if c in values})
                    )
            writer.close()

    def _relabel(self, found: tuple[SplitName, int], e: _Entry) -> None:
        split, pos = found
        old = self.entries[split][pos]
        if old.labels == e.labels:
            self.unchanged += 1
            return
        if pos in self.relabels[split]:
            return  # the same image twice in the folder: ingest kept the first (duplicates.jsonl)
        e.record["index"] = old.record["index"]
        e.width, e.height = old.width, old.height
        self.entries[split][pos] = e
        self.relabels[split][pos] = e.record
        self.relabelled += 1
        self.changes.append(("relabelled", e.sha256, e.labels.hex()))

    # ------------------------------------------------------------------ writing
    def _write(self) -> None:
        for split in SPLIT_NAMES:
            out = _SplitWriter(self.tmp / SHARDS_DIR / split)
            info = self.pm.splits.get(split)
            if info is not None and info.count:
                folder = shard_dir_of(self.parent_dir, info)
                self._parent_chunks(split, folder, out)
            added = self.tmp / "added" / split
            if added.is_dir():
                out.take(added)
            out.close()
        shutil.rmtree(self.tmp / "added", ignore_errors=True)
        if self.pm.metadata_columns:
            self._write_metadata()

    def _parent_chunks(self, split: SplitName, folder: Path, out: _SplitWriter) -> None:
        doc = _index_doc(folder)
        relabels = self.relabels[split]
        reader = ShardReader(folder) if relabels else None
        start = 0
        for chunk in doc["chunks"]:
            end = start + int(chunk["chunk_size"])
            if reader is None or not any(start <= p < end for p in relabels):
                out.link(folder, chunk, doc["config"])
                self.linked += 1
            else:
                scratch = self.tmp / "rewrite"
                writer = ShardWriter(scratch, fields=self.task.record_fields)
                for pos in range(start, end):
                    record = reader[pos]
                    new = relabels.get(pos)
                    if new is not None:
                        fields = extra_fields(new)
                        record = make_record(
                            record["image"], int(new["label"]), int(record["index"]), **fields
                        )
                    writer.add(record)
                writer.close()
                out.take(scratch)
                self.rewritten += 1
            start = end

    def _write_metadata(self) -> None:
        columns = self.pm.metadata_columns or []
        (self.tmp / METADATA_DIR).mkdir()
        for split in SPLIT_NAMES:
            info = self.pm.splits.get(split)
            parent = load_metadata(self.parent_dir, self.pm, split) if info is not None and info.count else []
            lines = [canonical_line({c: v[c] for c in columns if c in v}) for v in parent or []]
            lines += self.added_lines[split]
            if lines or split in self.pm.splits:
                (self.tmp / METADATA_DIR / f"{split}.jsonl").write_text(
                    "".join(line + "\n" for line in lines)
                )
                self.lines[split] = lines

    # ------------------------------------------------------------------ the manifest
    def _channel_stats(self) -> ChannelStats:
        """The parent's statistics (rebuilt from its manifest and its images' header sizes)
        and the added images' own sums, over the splits the parent's statistics cover."""
        moments = _PixelMoments()
        pm = self.pm
        parent_pixels = sum(
            e.width * e.height for s in self.stats_splits for e in self.entries[s][: pm.splits[s].count]
        )
        moments.add(pm.channel_stats, parent_pixels)
        moments.merge(self.added_moments)
        return moments.stats()

    def manifest(self, source: Path, step: LineageStep) -> DatasetManifest:
        pm = self.pm
        splits: dict[SplitName, SplitInfo] = {}
        for split in SPLIT_NAMES:
            counts: Counter[int] = Counter(c for e in self.entries[split] for c in e.classes)
            splits[split] = SplitInfo(
                count=len(self.entries[split]),
                per_class={name: counts[i] for i, name in enumerate(pm.classes)},
                shard_dir=f"{SHARDS_DIR}/{split}",
                bytes=self.bytes[split],
            )
        everything = [e for s in SPLIT_NAMES for e in self.entries[s]]
        widths, heights = [e.width for e in everything], [e.height for e in everything]
        version = _version(pm, self.changes)
        if pm.metadata_columns:
            lines = self.lines
            version = metadata_version(
                version,
                pm.metadata_columns,
                (
                    (s, e.sha256, hashlib.sha256(line.encode()).hexdigest())
                    for s in SPLIT_NAMES
                    for e, line in zip(self.entries[s], lines.get(s, []), strict=False)
                ),
            )
        task_stats = self.task.version_stats(
            pm.classes, [(s, e.record) for s in SPLIT_NAMES for e in self.entries[s]], pm, self.im
        )
        return pm.model_copy(
            update={
                "version": version,
                "splits": splits,
                "source": SourceInfo(
                    kind=self.im.source.kind, path=str(source), files_seen=self.im.source.files_seen
                ),
                "channel_stats": self._channel_stats(),
                "size_stats": SizeStats(
                    min=(min(widths), min(heights)),
                    median=(int(statistics.median_low(widths)), int(statistics.median_low(heights))),
                    max=(max(widths), max(heights)),
                ),
                "rejected": self.im.rejected,
                "duplicates": self.im.duplicates,
                "created_at": step.created_at,
                "visionloop_version": __version__,
                "task_stats": task_stats if task_stats is not None else pm.task_stats,
                "lineage": [step, *(pm.lineage or [])],
            }
        )
