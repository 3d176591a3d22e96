"""Shards on disk: litdata chunk folders holding one record per image.

A record is `{"image": <encoded PNG or JPEG bytes>, "label": int, "index": int}` where
`index` is the image's id, unique across the whole dataset (it seeds per-sample
augmentation, so it must never change once written), followed by the extra fields its task
declares (`Task.record_fields`), each opaque `bytes` that the task encodes and decodes itself
(what `label` means beyond an int is the task's too). One folder holds one layout: every
record has the same extra fields, in the same order.

`Record` types the three fields every record has; the extra ones ride in the same dict (made
with `make_record`, read with `record_field`), since a TypedDict cannot declare keys that
only a task knows.

Writing goes through litdata's `BinaryWriter`; reading through litdata's `StreamingDataset`
with random access, after `shardcheck` has checked that the folder's `index.json` is exactly
what the writer writes, and with a serializer table that has no pickle. The reader also
exposes the chunk boundaries so that samplers can shuffle chunk-locally (reading one chunk at
a time is ~4x faster than jumping between them).
"""

from __future__ import annotations

import bisect
import itertools
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict, cast

from visionloop.core.errors import DataError
from visionloop.data.shardcheck import BASE_FIELDS, check_shard_index, layout_of, safe_serializers

CHUNK_BYTES = "32MB"
_INDEX = "index.json"


class Record(TypedDict):
    image: bytes
    label: int
    index: int


def make_record(image: bytes, label: int, index: int, **fields: bytes) -> Record:
    """A record with the task's extra fields (`fields`, in the task's declared order)."""
    return cast(Record, {"image": image, "label": label, "index": index, **fields})


def extra_fields_of(record: Record) -> tuple[str, ...]:
    """The names of the record's extra fields, in order."""
    return tuple(k for k in record if k not in BASE_FIELDS)


def extra_fields(record: Record) -> dict[str, bytes]:
    """The record's extra fields by name, in order (to copy a record with another label or
    index: `make_record(image, label, index, **extra_fields(record))`)."""
    return {name: record_field(record, name) for name in extra_fields_of(record)}


def record_field(record: Record, name: str) -> bytes:
    """The record's extra field `name`; DataError naming the record when it has none."""
    value = cast(Mapping[str, object], record).get(name)
    if not isinstance(value, bytes):
        have = ", ".join(extra_fields_of(record)) or "none"
        raise DataError(
            f"record {record.get('index')} has no {name!r} field (its extra fields: {have}); the "
            "dataset was made for another task. Re-ingest the source with `visionloop data ingest`."
        )
    return value


class ShardWriter:
    """Append records to a litdata chunk folder; call `close()` to write its index.

    `fields` are the extra fields every record carries, in order (the task's `record_fields`);
    None takes them from the first record."""

    def __init__(
        self, out_dir: Path, chunk_bytes: str = CHUNK_BYTES, *, fields: Sequence[str] | None = None
    ) -> None:
        from litdata.streaming.writer import BinaryWriter

        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir = out_dir
        self._writer = BinaryWriter(str(out_dir), chunk_bytes=chunk_bytes)
        self._n = 0
        self.bytes = 0
        self.fields: tuple[str, ...] | None = None
        if fields is not None:
            self.fields = layout_of(fields).fields[len(BASE_FIELDS) :]

    def add(self, record: Record) -> None:
        extra = extra_fields_of(record)
        if self.fields is None:
            self.fields = layout_of(extra).fields[len(BASE_FIELDS) :]
        elif extra != self.fields:
            raise ValueError(
                f"a shard folder holds one record layout: this record has extra fields {list(extra)}, "
                f"the folder {list(self.fields)} (same names, same order)"
            )
        values = cast(Mapping[str, object], record)
        item: dict[str, Any] = {
            "image": record["image"],
            "label": int(record["label"]),
            "index": int(record["index"]),
        }
        for name in self.fields:
            value = values[name]
            # litdata would pick a serializer by the value's type (pickle for most); only bytes
            # are ever read back.
            if not isinstance(value, bytes | bytearray | memoryview):
                kind = type(value).__name__
                raise ValueError(f"extra field {name!r} is {kind}; a task encodes its fields as bytes")
            item[name] = bytes(value)
        self._writer[self._n] = item
        self._n += 1
        self.bytes += len(record["image"])

    def __len__(self) -> int:
        return self._n

    def close(self) -> None:
        if self._n == 0:
            # litdata cannot represent an empty folder; an index with no chunks says "empty".
            (self.out_dir / _INDEX).write_text(json.dumps({"chunks": [], "config": None}))
            return
        self._writer.done()
        self._writer.merge()


class ShardReader:
    """Random access to a shard folder. Safe to pickle into DataLoader workers: the litdata
    dataset is opened lazily in whichever process first reads."""

    def __init__(self, shard_dir: Path) -> None:
        self.shard_dir = Path(shard_dir)
        # The folder is untrusted: its index must be exactly what ShardWriter writes, or
        # litdata would decode with whatever serializer it names (pickle included).
        checked = check_shard_index(self.shard_dir)
        self.chunk_sizes: list[int] = checked.chunk_sizes
        self._digest = checked.digest
        # The task's extra fields, in order (`Task.record_fields` names what it expects).
        self.fields: tuple[str, ...] = checked.extra_fields
        self._starts = list(itertools.accumulate(self.chunk_sizes, initial=0))
        self._len = self._starts[-1]
        self._ds: Any = None

    def __len__(self) -> int:
        return self._len

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_ds"] = None  # each process opens its own
        return state

    def _open(self) -> Any:
        if self._ds is None:
            from litdata import StreamingDataset

            # litdata logs at INFO on every open; that is noise in a training log.
            logging.getLogger("litdata").setLevel(logging.WARNING)
            # Once per process: the folder may have changed since __init__ checked it (a
            # DataLoader worker opens later), and litdata reads index.json again itself.
            if check_shard_index(self.shard_dir).digest != self._digest:
                raise DataError(
                    f"{self.shard_dir / _INDEX} changed after it was checked; a dataset must not change "
                    "while it is read. Start again on a dataset folder nothing writes to."
                )
            # Decoders only for image bytes and ints: never litdata's pickle, whatever the
            # index says (the check above already refuses such an index).
            self._ds = StreamingDataset(str(self.shard_dir), serializers=safe_serializers())
        return self._ds

    def read_many(self, positions: Sequence[int]) -> list[Record]:
        """Records at `positions`, in that order, read in position order: litdata decodes
        records in blocks (Arrow record batches), so reading a shuffled batch sorted is ~7x
        cheaper than reading it as given, and the caller still gets its own order."""
        by_position = {p: self[p] for p in sorted(set(positions))}
        return [by_position[p] for p in positions]

    def __getitem__(self, i: int) -> Record:
        if not 0 <= i < self._len:
            raise IndexError(f"record {i} out of range for {self._len} records in {self.shard_dir}")
        # Name the chunk ourselves: given a bare int, litdata scans every chunk's range for
        # each sample. Our chunks have no region-of-interest, so the global index is the
        # index to read.
        from litdata.streaming.sampler import ChunkedIndex

        chunk = bisect.bisect_right(self._starts, i) - 1
        item = self._open()[ChunkedIndex(index=i, chunk_index=chunk)]
        fields = {name: bytes(item[name]) for name in self.fields}
        return make_record(bytes(item["image"]), int(item["label"]), int(item["index"]), **fields)

    def require_fields(self, expected: Sequence[str], *, task: str) -> None:
        """DataError unless the records carry exactly the extra fields `task` reads."""
        if tuple(expected) != self.fields:
            have = ", ".join(self.fields) or "none"
            want = ", ".join(expected) or "none"
            raise DataError(
                f"{self.shard_dir} holds records with extra fields [{have}], but task {task!r} reads "
                f"records with [{want}]: the dataset was ingested for another task or by another "
                "visionloop. Re-ingest the source with `visionloop data ingest` for this task, or set "
                "the train spec's task to the dataset's."
            )
