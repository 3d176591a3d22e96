"""A shard folder's index.json is checked against exactly what ShardWriter writes, and shards
are opened with a serializer table that has no pickle: each way of tampering with an index
written by the real writer is refused, naming the file, what it holds and what to do."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from visionloop.core.errors import DataError, VisionloopError
from visionloop.data.shardcheck import INDEX_MAX_BYTES, check_shard_index, safe_serializers
from visionloop.data.shards import ShardReader, ShardWriter

FIX = "visionloop data ingest"


def write_shards(folder: Path, n: int = 6, chunk_bytes: str = "32MB") -> Path:
    w = ShardWriter(folder, chunk_bytes=chunk_bytes)
    for i in range(n):
        w.add({"image": bytes([i]) * 50, "label": i % 3, "index": 100 + i})
    w.close()
    return folder


def index_of(folder: Path) -> dict[str, Any]:
    return dict(json.loads((folder / "index.json").read_text()))


def rewrite(folder: Path, change: Callable[[dict[str, Any]], None]) -> None:
    index = index_of(folder)
    change(index)
    (folder / "index.json").write_text(json.dumps(index))


def refused(folder: Path) -> str:
    with pytest.raises(DataError) as e:
        ShardReader(folder)
    message = str(e.value)
    assert str(folder / "index.json") in message or str(folder) in message
    assert FIX in message
    return message


def test_what_the_writer_writes_is_accepted_and_read_back(tmp_path: Path) -> None:
    folder = write_shards(tmp_path / "s")
    assert check_shard_index(folder).chunk_sizes == [6]
    r = ShardReader(folder)
    assert [r[i]["index"] for i in range(6)] == [100, 101, 102, 103, 104, 105]
    assert r[4] == {"image": bytes([4]) * 50, "label": 1, "index": 104}


@pytest.mark.filterwarnings("ignore:An item was larger than the target chunk size")
def test_several_chunks_and_an_empty_split_are_accepted(tmp_path: Path) -> None:
    many = write_shards(tmp_path / "many", n=40, chunk_bytes="1KB")
    sizes = check_shard_index(many).chunk_sizes
    assert len(sizes) > 1 and sum(sizes) == 40
    assert ShardReader(many)[39]["index"] == 139
    empty = write_shards(tmp_path / "empty", n=0)
    assert index_of(empty) == {"chunks": [], "config": None}
    assert len(ShardReader(empty)) == 0


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(index: dict[str, Any]) -> None:
        node: Any = index
        *parents, last = path.split(".")
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value

    return change


TAMPERS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("pickle", _set("config.data_format", ["pickle", "int", "int"]), "data_format ['pickle', 'int', 'int']"),
    ("graph", _set("config.data_format", ["graph", "int", "int"]), "data_format ['graph'"),
    ("subtype", _set("config.data_format", ["bytes:pickle", "int", "int"]), "data_format ['bytes:pickle'"),
    ("compression", _set("config.compression", "zstd"), "compression 'zstd' (expected null)"),
    ("compression level", _set("config.compression_level", "sample"), "compression_level 'sample'"),
    ("encryption", _set("config.encryption", {"algorithm": "fernet"}), "encryption {'algorithm': 'fernet'}"),
    ("item loader", _set("config.item_loader", "TokensLoader"), "item_loader 'TokensLoader'"),
    ("chunk_size", _set("config.chunk_size", 10), "chunk_size 10 (expected null)"),
    (
        "types",
        _set("config.types", {"image": "json", "index": "int", "label": "int"}),
        "types {'image': 'json'",
    ),
    ("data_spec", _set("config.data_spec", json.dumps([1, {"type": "builtins.list"}])), "data_spec"),
    ("mds format", _set("config.format", "mds"), "unexpected fields ['format']"),
    ("no config", _set("config", None), "config is None"),
    ("mds shards", _set("shards", []), "fields ['chunks', 'config', 'shards', 'updated_at']"),
    ("traversal", _set("chunks.0.filename", "../../etc/passwd"), "filename '../../etc/passwd'"),
    ("absolute", _set("chunks.0.filename", "/etc/passwd"), "filename '/etc/passwd'"),
    ("subfolder", _set("chunks.0.filename", "sub/chunk-0-0.bin"), "filename 'sub/chunk-0-0.bin'"),
    ("compressed name", _set("chunks.0.filename", "chunk-0-0.zstd.bin"), "filename 'chunk-0-0.zstd.bin'"),
    ("size as text", _set("chunks.0.chunk_size", "6"), "chunk_size '6'"),
    ("size as float", _set("chunks.0.chunk_size", 6.0), "chunk_size 6.0"),
    ("size as bool", _set("chunks.0.chunk_size", True), "chunk_size True"),
    ("negative size", _set("chunks.0.chunk_size", -1), "chunk_size -1"),
    ("dim", _set("chunks.0.dim", 3), "dim 3"),
    ("chunk extra", _set("chunks.0.region", [0, 1]), "chunk 0 is {"),
    ("no chunks", _set("chunks", []), "chunks is [], not a non-empty list"),
]


@pytest.mark.parametrize(("change", "words"), [t[1:] for t in TAMPERS], ids=[t[0] for t in TAMPERS])
def test_each_tampered_index_is_refused_naming_what_it_holds(
    tmp_path: Path, change: Callable[[dict[str, Any]], None], words: str
) -> None:
    folder = write_shards(tmp_path / "s")
    rewrite(folder, change)
    message = refused(folder)
    assert words in message, message


def test_a_chunk_listed_twice_is_refused(tmp_path: Path) -> None:
    folder = write_shards(tmp_path / "s")
    rewrite(folder, lambda ix: ix["chunks"].append(dict(ix["chunks"][0])))
    assert "chunk file chunk-0-0.bin is listed twice" in refused(folder)


def test_a_chunk_of_another_size_than_indexed_or_missing_is_refused(tmp_path: Path) -> None:
    folder = write_shards(tmp_path / "s")
    chunk = folder / "chunk-0-0.bin"
    size = chunk.stat().st_size
    with chunk.open("ab") as f:
        f.write(b"\0")
    message = refused(folder)
    assert f"holds {size + 1} bytes but {folder / 'index.json'} says {size}" in message
    chunk.unlink()
    assert "cannot be read" in refused(folder)


def test_an_oversized_index_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    folder = write_shards(tmp_path / "s")
    valid = (folder / "index.json").read_bytes()
    # still valid JSON (trailing whitespace): only the size is wrong
    (folder / "index.json").write_bytes(valid + b" " * (INDEX_MAX_BYTES + 1 - len(valid)))
    assert "larger than 16 MiB" in refused(folder)
    (folder / "index.json").write_bytes(valid + b" " * (INDEX_MAX_BYTES - len(valid)))
    assert len(ShardReader(folder)) == 6  # exactly at the cap is fine


@pytest.mark.parametrize(
    ("content", "words"),
    [(b"{not json", "not valid JSON"), (b"[1, 2]", "holds list"), (b"\xff\xfe", "not valid JSON")],
)
def test_an_index_that_is_not_a_json_object_is_refused(tmp_path: Path, content: bytes, words: str) -> None:
    folder = write_shards(tmp_path / "s")
    (folder / "index.json").write_bytes(content)
    assert words in refused(folder)


def test_a_fifo_or_a_missing_index_is_refused_without_blocking(tmp_path: Path) -> None:
    folder = write_shards(tmp_path / "s")
    (folder / "index.json").unlink()
    os.mkfifo(folder / "index.json")  # opening it for reading would wait for a writer forever
    assert "not a regular file" in refused(folder)
    with pytest.raises(DataError, match="is not a readable shard folder"):
        ShardReader(tmp_path / "nowhere")


def test_a_folder_named_index_json_is_refused_not_a_traceback(tmp_path: Path) -> None:
    folder = write_shards(tmp_path / "s")
    (folder / "index.json").unlink()
    (folder / "index.json").mkdir()
    # Before: os.fdopen of the folder raised a bare IsADirectoryError (a traceback).
    assert "not a regular file" in refused(folder)


def test_an_index_changed_after_the_check_is_refused_at_open(tmp_path: Path) -> None:
    folder = write_shards(tmp_path / "s")
    reader = ShardReader(folder)  # checked here; litdata opens lazily on the first read
    rewrite(folder, _set("updated_at", "later"))
    with pytest.raises(DataError, match="changed after it was checked"):
        reader[0]


def test_the_index_is_checked_once_per_open_not_per_record(tmp_path: Path) -> None:
    folder = write_shards(tmp_path / "s")
    reader = ShardReader(folder)
    assert reader[0]["index"] == 100  # opened (and re-checked) here
    (folder / "index.json").write_text("{not json")  # any further check would now fail
    assert [r["index"] for r in reader.read_many([5, 1, 3])] == [105, 101, 103]


def test_the_serializer_table_has_no_pickle_under_any_name(tmp_path: Path) -> None:
    from litdata.streaming import serializers as ls

    table = safe_serializers()
    assert set(table) == set(ls._SERIALIZERS)  # every name litdata would otherwise fill in
    effective = ls._get_serializers(table)
    assert isinstance(effective["bytes"], ls.BytesSerializer)
    assert isinstance(effective["int"], ls.IntegerSerializer)
    assert not [k for k, v in effective.items() if isinstance(v, (ls.PickleSerializer, ls.GraphSerializer))]
    for name in ("pickle", "graph", "json", "tensor", "numpy"):
        with pytest.raises(VisionloopError, match=f"litdata's '{name}' serializer"):
            table[name].deserialize(b"\x80\x04N.")  # pickle.dumps(None)
        with pytest.raises(VisionloopError, match="never unpickles"):
            table[name].setup(name)
