"""A shard record is image/label/index plus the extra bytes fields its task declares: any
identifier-named field goes through ShardWriter → check → ShardReader, while an index that
declares anything else (another type, an odd name, too many fields, another order) is refused
before litdata reads it, and a task refuses records whose fields are not its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from visionloop.core.errors import DataError
from visionloop.data.shardcheck import MAX_EXTRA_FIELDS, check_shard_index
from visionloop.data.shards import ShardReader, ShardWriter, make_record, record_field
from visionloop.tasks import get_task

FIX = "visionloop data ingest"
_LEAF: dict[str, object] = {"type": None, "context": None, "children_spec": []}


def write_points(folder: Path, n: int = 5) -> Path:
    w = ShardWriter(folder, fields=("points",))
    for i in range(n):
        w.add(make_record(bytes([i]) * 20, i % 2, 10 + i, points=bytes([i, i + 1, i + 2])))
    w.close()
    return folder


def rewrite_config(folder: Path, fields: list[Any], data_format: list[Any], types: dict[str, Any]) -> None:
    """The index as a hostile writer would make it: a spec of `fields` in the writer's own
    encoding, with this data_format and these types."""
    index = json.loads((folder / "index.json").read_text())
    spec = [
        1,
        {"type": "builtins.dict", "context": json.dumps(fields), "children_spec": [_LEAF] * len(fields)},
    ]
    index["config"].update(data_spec=json.dumps(spec), data_format=data_format, types=types)
    (folder / "index.json").write_text(json.dumps(index))


def refused(folder: Path) -> str:
    with pytest.raises(DataError) as e:
        ShardReader(folder)
    message = str(e.value)
    assert str(folder / "index.json") in message and FIX in message
    return message


def test_a_new_field_goes_from_writer_through_the_check_to_the_reader(tmp_path: Path) -> None:
    folder = write_points(tmp_path / "s")
    checked = check_shard_index(folder)
    assert checked.fields == ("image", "label", "index", "points")
    assert checked.extra_fields == ("points",) and checked.chunk_sizes == [5]
    reader = ShardReader(folder)
    assert reader.fields == ("points",)
    assert reader[3] == {"image": bytes([3]) * 20, "label": 1, "index": 13, "points": bytes([3, 4, 5])}
    assert [record_field(r, "points") for r in reader.read_many([4, 0])] == [b"\x04\x05\x06", b"\x00\x01\x02"]


def test_several_fields_keep_their_order(tmp_path: Path) -> None:
    w = ShardWriter(tmp_path / "s")  # no fields given: the first record's fix the layout
    w.add(make_record(b"img", 0, 0, masks=b"m0", points=b"p0"))
    w.add(make_record(b"img", 1, 1, masks=b"m1", points=b"p1"))
    w.close()
    assert check_shard_index(tmp_path / "s").extra_fields == ("masks", "points")
    assert list(ShardReader(tmp_path / "s")[1]) == ["image", "label", "index", "masks", "points"]


@pytest.mark.parametrize(
    ("fields", "data_format", "types", "words"),
    [
        (
            ["image", "label", "index", "points"],
            ["bytes", "int", "int", "int"],
            {"image": "bytes", "index": "int", "label": "int", "points": "int"},
            "data_format ['bytes', 'int', 'int', 'int'] (expected ['bytes', 'int', 'int', 'bytes'])",
        ),
        (
            ["image", "label", "index", "points"],
            ["bytes", "int", "int", "pickle"],
            {"image": "bytes", "index": "int", "label": "int", "points": "pickle"},
            "data_format ['bytes', 'int', 'int', 'pickle']",
        ),
        (
            ["image", "label", "index", "points"],
            ["bytes", "int", "int", "bytes"],
            {"image": "bytes", "index": "int", "label": "int", "points": "pickle"},
            "types {'image': 'bytes', 'index': 'int', 'label': 'int', 'points': 'pickle'}",
        ),
        (
            ["image", "label", "index", "__class__"],
            ["bytes", "int", "int", "bytes"],
            {"__class__": "bytes", "image": "bytes", "index": "int", "label": "int"},
            "extra field name '__class__' is not a lowercase identifier",
        ),
        (
            ["image", "label", "index", "../x"],
            ["bytes", "int", "int", "bytes"],
            {"../x": "bytes", "image": "bytes", "index": "int", "label": "int"},
            "extra field name '../x'",
        ),
        (
            ["image", "label", "index", 7],
            ["bytes", "int", "int", "bytes"],
            {"7": "bytes", "image": "bytes", "index": "int", "label": "int"},
            "extra field name 7",
        ),
        (
            ["image", "label", "index", *[f"f{i}" for i in range(MAX_EXTRA_FIELDS + 1)]],
            ["bytes", "int", "int", *["bytes"] * (MAX_EXTRA_FIELDS + 1)],
            {"image": "bytes", "index": "int", "label": "int", **{f"f{i}": "bytes" for i in range(5)}},
            f"{MAX_EXTRA_FIELDS + 1} extra fields",
        ),
        (
            ["image", "label", "points", "index"],
            ["bytes", "int", "bytes", "int"],
            {"image": "bytes", "index": "int", "label": "int", "points": "bytes"},
            "is not a record of image/label/index (in this order)",
        ),
        (
            ["points", "image", "label", "index"],
            ["bytes", "bytes", "int", "int"],
            {"image": "bytes", "index": "int", "label": "int", "points": "bytes"},
            "is not a record of image/label/index (in this order)",
        ),
        (
            ["image", "label", "index", "points", "points"],
            ["bytes", "int", "int", "bytes", "bytes"],
            {"image": "bytes", "index": "int", "label": "int", "points": "bytes"},
            "name one field twice",
        ),
        (
            ["image", "label", "index", "label"],
            ["bytes", "int", "int", "int"],
            {"image": "bytes", "index": "int", "label": "int"},
            "extra field 'label' repeats one of",
        ),
    ],
    ids=[
        "int extra",
        "pickle extra",
        "pickle type",
        "dunder name",
        "path name",
        "int name",
        "too many",
        "extra before index",
        "extra first",
        "twice",
        "base name",
    ],
)
def test_an_index_declaring_other_fields_is_refused(
    tmp_path: Path, fields: list[Any], data_format: list[Any], types: dict[str, Any], words: str
) -> None:
    folder = write_points(tmp_path / "s")
    rewrite_config(folder, fields, data_format, types)
    message = refused(folder)
    assert words in message, message


def test_the_writers_spec_encoding_is_what_the_check_accepts(tmp_path: Path) -> None:
    # rewrite_config must write exactly the writer's encoding, or the refusals above would
    # prove nothing: rewriting the real layout leaves the index acceptable.
    folder = write_points(tmp_path / "s")
    types = {"image": "bytes", "index": "int", "label": "int", "points": "bytes"}
    rewrite_config(folder, ["image", "label", "index", "points"], ["bytes", "int", "int", "bytes"], types)
    assert record_field(ShardReader(folder)[0], "points") == b"\x00\x01\x02"


@pytest.mark.parametrize(
    ("fields", "record", "words"),
    [
        (None, {"image": b"i", "label": 0, "index": 0, "points": 3}, "extra field 'points' is int"),
        (None, {"image": b"i", "label": 0, "index": 0, "Points": b"p"}, "not a lowercase identifier"),
        (
            None,
            {"image": b"i", "label": 0, "index": 0, **{f"f{i}": b"" for i in range(MAX_EXTRA_FIELDS + 1)}},
            f"at most {MAX_EXTRA_FIELDS}",
        ),
        (("points",), {"image": b"i", "label": 0, "index": 0}, "this record has extra fields []"),
        (("a", "b"), {"image": b"i", "label": 0, "index": 0, "b": b"", "a": b""}, "same names, same order"),
    ],
    ids=["int value", "odd name", "too many", "missing", "other order"],
)
def test_the_writer_refuses_what_the_check_would(
    tmp_path: Path, fields: tuple[str, ...] | None, record: dict[str, Any], words: str
) -> None:
    w = ShardWriter(tmp_path / "s", fields=fields)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        w.add(record)  # type: ignore[arg-type]


def test_a_task_refuses_records_of_another_task(tmp_path: Path) -> None:
    reader = ShardReader(write_points(tmp_path / "s"))
    with pytest.raises(DataError) as e:
        get_task("classification").check_records(reader)
    message = str(e.value)
    assert "extra fields [points]" in message and "task 'classification' reads records with [none]" in message
    assert "Re-ingest" in message
    with pytest.raises(DataError, match=r"\[points\], but task 'detection' reads records with \[boxes\]"):
        get_task("detection").check_records(reader)
    with pytest.raises(DataError, match="record 10 has no 'boxes' field \\(its extra fields: points\\)"):
        record_field(reader[0], "boxes")
