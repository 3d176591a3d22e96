"""Per-image metadata at ingest, through the real ingest: a CSV's extra columns and a COCO
image's own fields are kept beside the shards (one line per record, in shard order), bounded,
listed by `data info`; a source without metadata gives exactly the dataset it gave before."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import _warmcli
from visionloop.core.errors import DataError
from visionloop.data.ingest import IngestOptions, ingest
from visionloop.data.metadata import read_metadata
from visionloop.data.shards import ShardReader

SPLITS = ("train", "val", "test")


def ppm(seed: int, w: int = 12, h: int = 10) -> bytes:
    """A small image whose bytes depend only on `seed` (no codec, no library version)."""
    arr = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    return f"P6\n{w} {h}\n255\n".encode() + arr.tobytes()


def digits_pngs(folder: Path, n: int) -> list[tuple[str, int]]:
    """The first `n` of scikit-learn's digits as folder/NNNN.png: (file name, digit)."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    folder.mkdir(parents=True)
    out = []
    for i in range(n):
        img = (digits.images[i] * (255.0 / 16.0)).round().astype(np.uint8)
        Image.fromarray(img, mode="L").resize((16, 16)).save(folder / f"{i:04d}.png")
        out.append((f"{folder.name}/{i:04d}.png", int(digits.target[i])))
    return out


def write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> Path:
    import csv

    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def stored_metadata(ds: Path) -> dict[int, dict[str, Any]]:
    """Every stored record's metadata, by the record's index (its source position)."""
    got: dict[int, dict[str, Any]] = {}
    for split in SPLITS:
        rows = read_metadata(ds, split)
        assert rows is not None
        reader = ShardReader(ds / "shards" / split)
        assert len(rows) == len(reader)
        for position, row in enumerate(rows):
            got[reader[position]["index"]] = row
    return got


def vl(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return _warmcli.run([*map(str, args)], env={**os.environ, "COLUMNS": "200"}, timeout=300)


# --------------------------------------------------------------------------- CSV


def test_a_csv_s_extra_columns_are_kept_per_image(tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = digits_pngs(src / "img", 120)
    expected: dict[int, dict[str, Any]] = {}
    rows = []
    for i, (rel, digit) in enumerate(files):
        camera = f"cam{i % 3}"
        time_of_day = "" if i % 7 == 0 else ("night" if i % 2 else "day")
        rows.append([rel, digit, camera, time_of_day])
        expected[i] = {"camera": camera} | ({"time_of_day": time_of_day} if time_of_day else {})
    csv = write_csv(src / "labels.csv", ["path", "label", "camera", "time_of_day"], rows)
    out = tmp_path / "ds"
    report = ingest(csv, out, IngestOptions(workers=2, val_fraction=0.25, seed=0))
    m = report.manifest
    assert m.metadata_columns == ["camera", "time_of_day"] and report.kept == 120
    assert json.loads((out / "dataset.json").read_text())["metadata_columns"] == ["camera", "time_of_day"]
    assert sorted(p.name for p in (out / "metadata").iterdir()) == ["test.jsonl", "train.jsonl", "val.jsonl"]
    # Line k of a split's file is the record at position k of its shards: the record's index
    # is its position in the (sorted) source, so each record gets back its own row's values.
    assert stored_metadata(out) == expected
    assert report.warnings == []

    # The version covers the metadata: the same source, the same version; one value changed,
    # another; the same images and labels without the columns, another again.
    again = ingest(csv, tmp_path / "ds2", IngestOptions(workers=2, val_fraction=0.25, seed=0))
    assert again.manifest.version == m.version
    rows[5][2] = "cam9"
    changed = write_csv(src / "changed.csv", ["path", "label", "camera", "time_of_day"], rows)
    other = ingest(changed, tmp_path / "ds3", IngestOptions(workers=2, val_fraction=0.25, seed=0))
    assert other.manifest.version != m.version
    plain = write_csv(src / "plain.csv", ["path", "label"], [r[:2] for r in rows])
    bare = ingest(plain, tmp_path / "ds4", IngestOptions(workers=2, val_fraction=0.25, seed=0))
    assert bare.manifest.metadata_columns is None and not (tmp_path / "ds4" / "metadata").exists()
    assert bare.manifest.version not in (m.version, other.manifest.version)
    assert bare.manifest.splits == m.splits  # metadata changes nothing else

    # As a user sees it: the ingest summary names the columns, `data info` counts their values.
    r = vl("data", "ingest", csv, "--out", tmp_path / "ds5", "--val-fraction", "0.25", "-j", "1")
    assert r.returncode == 0, r.stderr
    assert f"metadata    camera, time_of_day (per image) → {tmp_path / 'ds5' / 'metadata'}/" in r.stdout
    assert f"version     {m.version}" in r.stdout
    r = vl("data", "info", out)
    assert r.returncode == 0, r.stderr
    assert "per-image metadata" in r.stdout
    lines = {line.split("│")[1].strip(): line for line in r.stdout.splitlines() if line.count("│") >= 4}
    assert [c.strip() for c in lines["camera"].split("│")[2:4]] == ["3", "0"]
    missing = sum(1 for i in range(120) if i % 7 == 0)
    assert [c.strip() for c in lines["time_of_day"].split("│")[2:4]] == ["2", str(missing)]
    assert "cam0 (40)" in lines["camera"]


def test_hostile_csv_headers_are_refused_before_any_work(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.ppm").write_bytes(ppm(1))
    cases = [
        (
            ["path", "label", *[f"c{i}" for i in range(33)]],
            "33 metadata columns, over the 32 a dataset keeps",
        ),
        (["path", "label", "time of day"], "metadata column 'time of day' is not a simple name"),
        (["path", "label", "\u202ecamera"], "is not a simple name"),
        (["path", "label", "x" * 100], "is not a simple name"),
        (["path", "label", "camera", "camera"], "metadata column 'camera' is named twice"),
        (["path", "label", "splt"], "unknown column(s) 'splt' (did you mean split?)"),
        (["path", "label", "lable"], "unknown column(s) 'lable' (did you mean label?)"),
    ]
    for header, problem in cases:
        row = ["a.ppm", "cat", *["v"] * (len(header) - 2)]
        csv = write_csv(src / "labels.csv", header, [row])
        with pytest.raises(DataError) as e:
            ingest(csv, tmp_path / "ds", IngestOptions(workers=1))
        assert problem in str(e.value), (header, str(e.value))
        assert "path,label,split" in str(e.value)  # the example of a good header
        assert not (tmp_path / "ds").exists()


def test_hostile_csv_values_are_left_out_with_a_warning(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    rows = []
    for i in range(6):
        (src / f"{i}.ppm").write_bytes(ppm(i))
        note = {1: "x" * 10_000, 2: "bell\x07", 3: "  padded  "}.get(i, f"n{i}")
        rows.append([f"{i}.ppm", "cat" if i % 2 else "dog", "train", note])
    csv = write_csv(src / "labels.csv", ["path", "label", "split", "note"], rows)
    report = ingest(csv, tmp_path / "ds", IngestOptions(workers=1))
    assert report.kept == 6
    got = stored_metadata(tmp_path / "ds")
    assert got == {
        0: {"note": "n0"},
        1: {},
        2: {},
        3: {"note": "padded"},
        4: {"note": "n4"},
        5: {"note": "n5"},
    }
    text = "\n".join(report.warnings)
    assert (
        "labels.csv: 1 value(s) of metadata column 'note' left out (values longer than 256 characters)"
        in text
    )
    assert (
        "labels.csv: 1 value(s) of metadata column 'note' left out (values with control characters)" in text
    )


# --------------------------------------------------------------------------- no metadata


def plain_csv_source(root: Path) -> Path:
    root.mkdir(parents=True)
    rows = []
    for i in range(12):
        (root / f"img{i:02d}.ppm").write_bytes(ppm(i))
        rows.append([f"img{i:02d}.ppm", "cat" if i % 2 else "dog", "val" if i % 4 == 0 else "train"])
    return write_csv(root / "labels.csv", ["path", "label", "split"], rows)


def coco_source(root: Path, extra: dict[int, dict[str, Any]] | None = None) -> Path:
    """Eight images with one box each and COCO's own image fields (license, URLs, date)."""
    (root / "images").mkdir(parents=True)
    images, anns = [], []
    for i in range(8):
        (root / "images" / f"im{i}.ppm").write_bytes(ppm(100 + i, 20, 16))
        entry = {
            "id": i + 1,
            "file_name": f"im{i}.ppm",
            "width": 20,
            "height": 16,
            "license": 1,
            "coco_url": "",
            "flickr_url": "",
            "date_captured": "2024-01-01 10:00:00",
            **(extra or {}).get(i, {}),
        }
        images.append(entry)
        anns.append(
            {
                "id": i + 1,
                "image_id": i + 1,
                "category_id": 1 + i % 2,
                "bbox": [2, 3, 8, 6],
                "iscrowd": 0,
                "area": 48,
            }
        )
    doc = {
        "images": images,
        "annotations": anns,
        "categories": [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}],
    }
    # NaN and Infinity are what Python's json writes for them; json.loads reads them back.
    (root / "instances.json").write_text(json.dumps(doc))
    return root


# Versions of these two sources as ingest gave them before metadata existed (their bytes
# depend on no codec): a source without metadata must keep its dataset's version.
PLAIN_CSV_VERSION = "ab303e5bcc37488593e391a3e3810a9b5c6d964886a34b7c89d32bc68e08fe65"
PLAIN_COCO_VERSION = "26a6c917c9df700f7a3804ce35a23eb3cdb57815441225e1522e36a2c2d2b4c4"
MANIFEST_KEYS = [
    "format_version", "version", "task", "classes", "splits", "image_policy", "source", "split_policy",
    "channel_stats", "size_stats", "rejected", "duplicates", "created_at", "visionloop_version",
]  # fmt: skip


def test_a_dataset_without_metadata_keeps_its_version_and_its_files(tmp_path: Path) -> None:
    opts = IngestOptions(workers=1, val_fraction=0.25, seed=0)
    for src, version, extra_keys in (
        (plain_csv_source(tmp_path / "csv"), PLAIN_CSV_VERSION, []),
        (coco_source(tmp_path / "coco"), PLAIN_COCO_VERSION, ["task_stats"]),
    ):
        out = tmp_path / f"{src.name}-ds"
        report = ingest(src, out, opts)
        assert report.manifest.version == version
        assert report.manifest.metadata_columns is None
        assert list(json.loads((out / "dataset.json").read_text())) == MANIFEST_KEYS + extra_keys
        assert sorted(p.name for p in out.iterdir()) == [
            "dataset.json",
            "duplicates.jsonl",
            "rejected.jsonl",
            "shards",
        ]
        assert read_metadata(out, "train") is None


# --------------------------------------------------------------------------- COCO


def test_coco_image_fields_are_kept_and_hostile_ones_left_out(tmp_path: Path) -> None:
    extra: dict[int, dict[str, Any]] = {
        i: {"camera": f"cam{i % 2}", "site": i // 4, "indoor": i == 3, "exposure": 0.5 * i} for i in range(8)
    }
    extra[0] |= {"tags": ["a", "b"], "pose": {"yaw": 1}, "nothing": None, "a b": "bad name"}
    extra[1] |= {"camera": "c" * 1000, "exposure": float("nan")}
    extra[2] |= {"site": 2**70}
    src = coco_source(tmp_path / "coco", extra)
    out = tmp_path / "ds"
    report = ingest(src, out, IngestOptions(workers=1, val_fraction=0.25, seed=0))
    m = report.manifest
    assert m.task == "detection"
    # COCO's own fields (license, URLs, date_captured) are not metadata; the image's are.
    # A field with no valid value anywhere (tags, pose, nothing) is no column.
    assert m.metadata_columns == ["camera", "site", "indoor", "exposure"]
    got = stored_metadata(out)
    assert got[0] == {"camera": "cam0", "site": 0, "indoor": False, "exposure": 0.0}
    assert got[1] == {"site": 0, "indoor": False}
    assert got[2] == {"camera": "cam0", "indoor": False, "exposure": 1.0}
    assert got[3] == {"camera": "cam1", "site": 0, "indoor": True, "exposure": 1.5}
    assert got[7] == {"camera": "cam1", "site": 1, "indoor": False, "exposure": 3.5}
    text = "\n".join(report.warnings)
    assert "instances.json: 1 field name(s) left out of the metadata: 'a b' (is not a simple name" in text
    assert (
        "metadata column 'tags' left out (values that are not a string, number or boolean (a list))" in text
    )
    assert (
        "metadata column 'pose' left out (values that are not a string, number or boolean (an object))"
        in text
    )
    assert "metadata column 'camera' left out (values longer than 256 characters)" in text
    assert "metadata column 'exposure' left out (NaN or infinite numbers)" in text
    assert "metadata column 'site' left out (integers beyond ±2**53)" in text
    # The metadata enters the version: the same images and boxes without it give another one.
    assert m.version != PLAIN_COCO_VERSION


def test_coco_keeps_at_most_32_columns(tmp_path: Path) -> None:
    extra = {i: {f"f{i}_{k:02d}": k for k in range(10)} for i in range(8)}  # 80 field names
    report = ingest(coco_source(tmp_path / "coco", extra), tmp_path / "ds", IngestOptions(workers=1))
    columns = report.manifest.metadata_columns
    assert columns is not None and len(columns) == 32
    assert columns[:10] == [f"f0_{k:02d}" for k in range(10)]  # the order first seen
    assert any(
        "metadata keeps at most 32 columns; 48 more field name(s) left out" in w for w in report.warnings
    )
    got = stored_metadata(tmp_path / "ds")
    assert got[0] == {f"f0_{k:02d}": k for k in range(10)} and got[7] == {}
