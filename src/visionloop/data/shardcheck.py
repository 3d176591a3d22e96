"""A shard folder's `index.json` is untrusted: it is checked before litdata sees the folder.

litdata decodes each record field with the serializer that the folder's own `index.json`
names, and one of its serializers is `pickle` (another, `graph`, unpickles a part of its
payload). A dataset folder written by anyone with litdata's `BinaryWriter` and an object
whose `__reduce__` runs code would run that code in whichever process reads it: the trainer,
export, bench, a queue job. So:

1. `check_shard_index` accepts exactly the `index.json` that `ShardWriter` writes (records of
   image bytes, label int, index int, then up to `MAX_EXTRA_FIELDS` fields of opaque bytes that
   a task declares, named like identifiers; no compression, no encryption, litdata's PyTree
   item loader; plain chunk files in the folder, of the size the index says), and refuses
   anything else with a `DataError` that names the file, what it holds and what to do.
2. `safe_serializers()` is the only serializer table a folder is opened with: `bytes` and `int`
   are litdata's own; every other name litdata knows (pickle, graph, json, tensor, ...) maps to
   a serializer that refuses. litdata fills any name missing from a table it is given with its
   default (pickle included), so every name must be taken, not just the two we use.

The check reads the index once per open, never per record.
"""

from __future__ import annotations

import hashlib
import json
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from visionloop.core.errors import DataError
from visionloop.core.fsutil import NotRegularFileError, TooLargeError, read_capped
from visionloop.data.manifest import DatasetManifest, read_manifest, shard_dir_of

INDEX_NAME = "index.json"
# A 32 MB chunk takes about 100 bytes of index; 16 MiB of index is petabytes of images.
INDEX_MAX_BYTES = 16 * 1024 * 1024

# The record ShardWriter writes, field for field: {"image": bytes, "label": int, "index": int},
# then the task's extra fields (`Task.record_fields`), each opaque bytes that the task encodes
# and decodes itself. Only `bytes` and `int` are ever decoded, whatever a field is called.
ITEM_LOADER = "PyTreeLoader"
BASE_FIELDS: tuple[str, ...] = ("image", "label", "index")
_BASE_TYPES = {"image": "bytes", "label": "int", "index": "int"}
EXTRA_TYPE = "bytes"
# A task's record carries a few side payloads (masks, points, ...), not a table of columns.
MAX_EXTRA_FIELDS = 4
# Plain identifiers: they become dict keys in every reader and appear in error messages.
EXTRA_FIELD_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
_LEAF: dict[str, Any] = {"type": None, "context": None, "children_spec": []}


@dataclass(frozen=True)
class _Layout:
    fields: tuple[str, ...]

    @property
    def data_format(self) -> list[str]:
        return [_BASE_TYPES.get(f, EXTRA_TYPE) for f in self.fields]

    @property
    def types(self) -> dict[str, str]:
        return {f: _BASE_TYPES.get(f, EXTRA_TYPE) for f in sorted(self.fields)}

    @property
    def data_spec(self) -> list[Any]:
        # torch's pytree spec of the record dict (protocol 1): its leaves, keys in this order.
        return [
            1,
            {
                "type": "builtins.dict",
                "context": list(self.fields),
                "children_spec": [_LEAF] * len(self.fields),
            },
        ]


def extra_field_problem(fields: Any) -> str | None:
    """What is wrong with `fields` as a record's extra field names, or None when they are
    usable: a sequence of at most MAX_EXTRA_FIELDS distinct identifiers, none a base field."""
    if not isinstance(fields, list | tuple):
        return f"extra fields {_short(fields)} are not a list of names"
    if len(fields) > MAX_EXTRA_FIELDS:
        return f"{len(fields)} extra fields {_short(list(fields))} (at most {MAX_EXTRA_FIELDS})"
    for name in fields:
        if not isinstance(name, str) or not EXTRA_FIELD_NAME.fullmatch(name):
            return f"extra field name {_short(name)} is not a lowercase identifier like 'points'"
        if name in BASE_FIELDS:
            return f"extra field {name!r} repeats one of {list(BASE_FIELDS)}"
    if len(set(fields)) != len(fields):
        return f"extra fields {_short(list(fields))} name one field twice"
    return None


def layout_of(extra_fields: Sequence[str]) -> _Layout:
    """The layout ShardWriter writes for records with these extra fields (ValueError if the
    names are not usable)."""
    problem = extra_field_problem(tuple(extra_fields))
    if problem is not None:
        raise ValueError(problem)
    return _Layout((*BASE_FIELDS, *extra_fields))


# The layout with no extra field (kept under its old names for callers and tests).
_PLAIN = _Layout(BASE_FIELDS)
DATA_FORMAT = _PLAIN.data_format
TYPES = _PLAIN.types
DATA_SPEC = _PLAIN.data_spec
# Config fields that must be null: what they would switch on is not what ingest writes.
_NULL_FIELDS = (
    "chunk_size",
    "compression",
    "compression_batch_size",
    "compression_level",
    "encryption",
    "ipc_compression",
)
_CONFIG_KEYS = frozenset((*_NULL_FIELDS, "chunk_bytes", "data_format", "data_spec", "item_loader", "types"))
_CHUNK_KEYS = frozenset(("chunk_bytes", "chunk_size", "dim", "filename"))
_CHUNK_NAME = re.compile(r"chunk-[0-9]{1,9}-[0-9]{1,9}\.bin")

_FIX = "Re-ingest the images with `visionloop data ingest SOURCE --out DIR` and use that folder."


@dataclass(frozen=True)
class ShardIndex:
    """What a checked `index.json` says: records per chunk, and a digest of its bytes (so a
    later open can tell that the file is still the one that was checked)."""

    chunk_sizes: list[int]
    digest: str
    # The record's fields: ("image", "label", "index"), then the task's extra fields.
    fields: tuple[str, ...] = BASE_FIELDS

    @property
    def extra_fields(self) -> tuple[str, ...]:
        return self.fields[len(BASE_FIELDS) :]


def _refuse(index_file: Path, what: str) -> DataError:
    return DataError(
        f"{index_file} is not a shard index that `visionloop data ingest` writes: {what}. "
        "visionloop opens shards only in the exact format ingest writes (image bytes, label and "
        "index ints, a task's extra bytes fields; no pickle, compression or encryption). "
        f"{_FIX}"
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def _read_capped(index_file: Path) -> bytes:
    """The file's bytes, refusing anything but a regular file of at most INDEX_MAX_BYTES
    (read_capped: a FIFO named index.json cannot hang the reader)."""
    try:
        return read_capped(index_file, INDEX_MAX_BYTES, what="a shard index")
    except NotRegularFileError:
        raise _refuse(index_file, "it is not a regular file") from None
    except OSError as e:
        raise DataError(
            f"{index_file.parent} is not a readable shard folder ({e.strerror or e}). {_FIX}"
        ) from e
    except TooLargeError:
        raise _refuse(index_file, f"it is larger than {INDEX_MAX_BYTES // (1024 * 1024)} MiB") from None


def _is_int(value: Any) -> bool:
    return type(value) is int  # not bool, not float


def _check_config(index_file: Path, config: Any) -> _Layout:
    if not isinstance(config, dict):
        raise _refuse(index_file, f"config is {_short(config)}, not an object")
    keys = set(config)
    if keys != _CONFIG_KEYS:
        extra, missing = sorted(keys - _CONFIG_KEYS), sorted(_CONFIG_KEYS - keys)
        raise _refuse(index_file, f"config has unexpected fields {extra} and lacks {missing}")
    if config["item_loader"] != ITEM_LOADER:
        raise _refuse(index_file, f"item_loader {_short(config['item_loader'])} (expected {ITEM_LOADER!r})")
    for name in _NULL_FIELDS:
        if config[name] is not None:
            raise _refuse(index_file, f"{name} {_short(config[name])} (expected null)")
    if not _is_int(config["chunk_bytes"]) or config["chunk_bytes"] < 1:
        raise _refuse(index_file, f"chunk_bytes {_short(config['chunk_bytes'])} (expected a positive int)")
    layout = _check_spec(index_file, config["data_spec"])
    if config["data_format"] != layout.data_format:
        raise _refuse(
            index_file, f"data_format {_short(config['data_format'])} (expected {layout.data_format})"
        )
    if config["types"] != layout.types:
        raise _refuse(index_file, f"types {_short(config['types'])} (expected {layout.types})")
    return layout


def _check_spec(index_file: Path, spec: Any) -> _Layout:
    """The layout a `data_spec` describes, when it is exactly what ShardWriter writes for some
    valid set of extra fields; the rest of the config is then checked against that layout."""
    try:
        parsed = json.loads(spec) if isinstance(spec, str) else None
        if isinstance(parsed, list) and len(parsed) == 2 and isinstance(parsed[1], dict):
            context = parsed[1].get("context")
            parsed[1]["context"] = json.loads(context) if isinstance(context, str) else None
    except (ValueError, RecursionError):
        parsed = None
    fields = parsed[1]["context"] if isinstance(parsed, list) and len(parsed) == 2 else None
    if not isinstance(fields, list) or tuple(fields[: len(BASE_FIELDS)]) != BASE_FIELDS:
        raise _refuse(
            index_file, f"data_spec {_short(spec)} is not a record of {'/'.join(BASE_FIELDS)} (in this order)"
        )
    problem = extra_field_problem(fields[len(BASE_FIELDS) :])
    if problem is not None:
        raise _refuse(index_file, f"data_spec {_short(spec)}: {problem}")
    layout = _Layout(tuple(fields))
    if parsed != layout.data_spec:
        raise _refuse(index_file, f"data_spec {_short(spec)} is not the {'/'.join(layout.fields)} record")
    return layout


def _check_chunks(index_file: Path, chunks: Any) -> list[int]:
    folder = index_file.parent
    if not isinstance(chunks, list) or not chunks:
        raise _refuse(index_file, f"chunks is {_short(chunks)}, not a non-empty list")
    sizes: list[int] = []
    seen: set[str] = set()
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict) or set(chunk) != _CHUNK_KEYS:
            fields = ", ".join(sorted(_CHUNK_KEYS))
            raise _refuse(index_file, f"chunk {i} is {_short(chunk)}, not an object of {fields}")
        name = chunk["filename"]
        if not isinstance(name, str) or not _CHUNK_NAME.fullmatch(name):
            raise _refuse(
                index_file,
                f"chunk {i} has filename {_short(name)}, not a plain chunk file name in this folder "
                "(chunk-N-N.bin)",
            )
        if name in seen:
            raise _refuse(index_file, f"chunk file {name} is listed twice")
        seen.add(name)
        size, nbytes = chunk["chunk_size"], chunk["chunk_bytes"]
        if not _is_int(size) or size < 1 or not _is_int(nbytes) or nbytes < 1 or chunk["dim"] is not None:
            raise _refuse(
                index_file,
                f"chunk {i} has chunk_size {_short(size)}, chunk_bytes {_short(nbytes)}, dim "
                f"{_short(chunk['dim'])} (expected positive ints and a null dim)",
            )
        try:
            st = (folder / name).stat()
        except OSError as e:
            raise DataError(
                f"{folder / name}, listed in {index_file}, cannot be read ({e.strerror or e}): the "
                f"shard folder is incomplete. Copy the whole dataset folder again. {_FIX}"
            ) from e
        if not stat.S_ISREG(st.st_mode) or st.st_size != nbytes:
            raise DataError(
                f"{folder / name} holds {st.st_size} bytes but {index_file} says {nbytes}: the shard "
                f"is truncated or was replaced. Copy the whole dataset folder again. {_FIX}"
            )
        sizes.append(size)
    return sizes


def check_shard_index(shard_dir: Path) -> ShardIndex:
    """Check `shard_dir/index.json` against what `ShardWriter` writes; raise DataError if it is
    anything else. Reads the index and stats each chunk file; reads no chunk."""
    return load_shard_index(shard_dir)[0]


def load_shard_index(shard_dir: Path) -> tuple[ShardIndex, dict[str, Any]]:
    """`check_shard_index`, and the index document it checked, parsed from the same bytes (a
    second read could find another file, or a FIFO, in its place)."""
    index_file = Path(shard_dir) / INDEX_NAME
    raw = _read_capped(index_file)
    digest = hashlib.sha256(raw).hexdigest()
    try:
        index = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise _refuse(index_file, f"it is not valid JSON ({str(e)[:200]})") from e
    if not isinstance(index, dict):
        raise _refuse(index_file, f"it holds {type(index).__name__}, not an object")
    if index == {"chunks": [], "config": None}:  # ShardWriter's empty split
        return ShardIndex(chunk_sizes=[], digest=digest), index
    keys = set(index)
    if keys != {"chunks", "config", "updated_at"}:
        raise _refuse(index_file, f"it has fields {sorted(keys)} (expected chunks, config, updated_at)")
    if not isinstance(index["updated_at"], str):
        raise _refuse(index_file, f"updated_at {_short(index['updated_at'])} is not a string")
    layout = _check_config(index_file, index["config"])
    checked = ShardIndex(
        chunk_sizes=_check_chunks(index_file, index["chunks"]), digest=digest, fields=layout.fields
    )
    return checked, index


class RefusedSerializer:
    """Stands in for every litdata serializer we do not use (litdata duck-types its
    serializers). Refuses at setup, which litdata calls for each format a folder's index
    names, and, should anything get past that, at every other call."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _refuse(self) -> DataError:
        return DataError(
            f"a shard folder asks for litdata's {self.name!r} serializer; visionloop decodes only "
            f"bytes and ints and never unpickles a dataset. {_FIX}"
        )

    def setup(self, metadata: Any) -> None:
        raise self._refuse()

    def serialize(self, data: Any) -> tuple[bytes, str | None]:
        raise self._refuse()

    def deserialize(self, data: bytes) -> Any:
        raise self._refuse()

    def can_serialize(self, data: Any) -> bool:
        return False


def safe_serializers() -> dict[str, Any]:
    """The serializer table shards are opened with: litdata's `bytes` and `int`, and a refusing
    stand-in under every other name litdata knows, so that litdata's defaults (pickle among
    them) never fill a gap. Verified against the table litdata actually builds from it."""
    from litdata.streaming import serializers as ls

    table: dict[str, Any] = {name: RefusedSerializer(name) for name in ls._SERIALIZERS}
    table["bytes"] = ls.BytesSerializer()
    table["int"] = ls.IntegerSerializer()
    effective = ls._get_serializers(table)
    allowed = (ls.BytesSerializer, ls.IntegerSerializer, RefusedSerializer)
    unsafe = sorted(k for k, v in effective.items() if not isinstance(v, allowed))
    if unsafe:  # litdata changed how it merges tables: fail closed
        raise DataError(
            f"this litdata version adds serializers {unsafe} to any table it is given, so shards "
            "cannot be opened safely; install the litdata version visionloop pins."
        )
    return table


def check_dataset(dataset_dir: Path) -> DatasetManifest:
    """The dataset's manifest, once every split's shard folder lies inside the dataset and
    its index is exactly what ingest writes: what a control plane checks before it queues a
    job, so a hostile or broken dataset is refused at submit, not when the job starts."""
    manifest = read_manifest(dataset_dir)
    for info in manifest.splits.values():
        check_shard_index(shard_dir_of(dataset_dir, info))
    return manifest
