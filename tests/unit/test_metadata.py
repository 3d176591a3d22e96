"""Per-image metadata: the rules that bound it, the files ingest writes and the reader that
accepts only those; and slices of an evaluation (metric per value, bootstrap intervals),
on hand-made per-image results of both tasks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from visionloop.core.errors import DataError
from visionloop.data.manifest import DatasetManifest, write_manifest
from visionloop.data.metadata import (
    MAX_VALUE_CHARS,
    MetadataCleaner,
    MetadataWriter,
    column_problems,
    load_metadata,
    metadata_version,
    read_metadata,
)
from visionloop.eval.run import ImageResult
from visionloop.eval.slices import MIN_INTERVAL_IMAGES, compute_slices
from visionloop.tasks import get_task

# --------------------------------------------------------------------------- the rules


def test_the_cleaner_keeps_scalars_and_counts_what_it_drops() -> None:
    c = MetadataCleaner()
    kept = c.clean(
        {
            "camera": "north",
            "site": 7,
            "indoor": True,
            "exposure": 0.25,
            "empty": "",  # no value, and no column either until a value comes
            "none": None,
            "tags": ["a", "b"],
            "extra": {"k": 1},
            "nan": float("nan"),
            "big": 2**60,
            "long": "x" * (MAX_VALUE_CHARS + 1),
            "ctrl": "a\x00b",
            "bidi": "\u202eevil",
            "a b": "spaces in the name",
            "x" * 65: "too long a name",
        }
    )
    assert kept == {"camera": "north", "site": 7, "indoor": True, "exposure": 0.25}
    # A column is admitted with its first valid value: a field without one is no column.
    assert c.columns == ["camera", "site", "indoor", "exposure"]
    text = "\n".join(c.warnings("instances.json"))
    assert "2 field name(s) left out of the metadata: 'a b' (is not a simple name" in text
    assert (
        "metadata column 'tags' left out (values that are not a string, number or boolean (a list))" in text
    )
    assert "(an object)" in text and "NaN or infinite" in text and "beyond ±2**53" in text
    assert f"longer than {MAX_VALUE_CHARS} characters" in text and "control characters" in text
    # Values keep the column order, whatever order an item gives them in.
    assert list(c.clean({"exposure": 1.0, "camera": "south"})) == ["camera", "exposure"]


def test_at_most_32_columns_in_the_order_first_seen() -> None:
    c = MetadataCleaner()
    for i in range(40):
        c.clean({f"f{i:02d}": i})
    assert c.columns == [f"f{i:02d}" for i in range(32)]
    assert c.clean({"f35": 1, "f01": 2}) == {"f01": 2}
    (warning,) = c.warnings("x.json")
    assert (
        "at most 32 columns; 8 more field name(s) left out: 'f32', 'f33'" in warning and "3 more" in warning
    )


def test_a_fixed_set_of_columns_reads_only_those() -> None:
    c = MetadataCleaner(["camera"])
    assert c.clean({"camera": "a", "other": "b"}) == {"camera": "a"}
    assert c.columns == ["camera"] and c.warnings("x") == []


@pytest.mark.parametrize(
    ("names", "problem"),
    [
        ([f"c{i}" for i in range(33)], "33 metadata columns, over the 32"),
        (["time of day"], "'time of day' is not a simple name"),
        (["ok", ""], "'' is not a simple name"),
        (["1st"], "'1st' is not a simple name"),
        (["cam", "cam"], "'cam' is named twice"),
    ],
)
def test_column_names_that_are_refused(names: list[str], problem: str) -> None:
    assert any(problem in p for p in column_problems(names))


def test_good_column_names() -> None:
    assert column_problems(["camera", "time_of_day", "Site.ID", "_x", "a-b"]) == []


# --------------------------------------------------------------------------- the files


def _manifest(dataset: Path, counts: dict[str, int], columns: list[str] | None) -> DatasetManifest:
    splits = {
        s: {"count": n, "per_class": {"a": n}, "shard_dir": f"shards/{s}", "bytes": 0}
        for s, n in counts.items()
    }
    doc: dict[str, Any] = {
        "version": "v0",
        "classes": ["a"],
        "splits": splits,
        "image_policy": {},
        "source": {"kind": "csv", "path": "/src.csv", "files_seen": sum(counts.values())},
        "split_policy": {"seed": 0, "val_fraction": 0.0, "test_fraction": 0.0, "from_source": True},
        "channel_stats": {"mean": [0.5, 0.5, 0.5], "std": [0.2, 0.2, 0.2]},
        "size_stats": {"min": [8, 8], "median": [8, 8], "max": [8, 8]},
        "created_at": "2026-01-01T00:00:00+00:00",
        "visionloop_version": "0",
    }
    if columns is not None:
        doc["metadata_columns"] = columns
    m = DatasetManifest.model_validate(doc)
    dataset.mkdir(parents=True, exist_ok=True)
    write_manifest(dataset, m)
    return m


ROWS: dict[str, list[dict[str, Any]]] = {
    "train": [{"camera": "north", "hour": 7}, {}, {"camera": "south ✓", "hour": 23}],
    "val": [{"hour": 12}],
    "test": [],
}


def _written(tmp_path: Path) -> tuple[Path, DatasetManifest]:
    ds = tmp_path / "ds"
    m = _manifest(ds, {s: len(r) for s, r in ROWS.items()}, ["camera", "hour"])
    with MetadataWriter(ds, ["camera", "hour"]) as w:
        for split, rows in ROWS.items():
            for k, row in enumerate(rows):
                w.add(split, f"sha-{split}-{k}", row)
    return ds, m


def test_what_the_writer_writes_the_reader_reads(tmp_path: Path) -> None:
    ds, _ = _written(tmp_path)
    assert (ds / "metadata" / "train.jsonl").read_text(encoding="utf-8") == (
        '{"camera":"north","hour":7}\n{}\n{"camera":"south ✓","hour":23}\n'
    )
    assert (ds / "metadata" / "test.jsonl").read_bytes() == b""
    for split, rows in ROWS.items():
        assert read_metadata(ds, split) == rows


def test_a_dataset_without_metadata_has_none(tmp_path: Path) -> None:
    m = _manifest(tmp_path / "ds", {"train": 2}, None)
    assert read_metadata(tmp_path / "ds", "train") is None
    # and its manifest is written exactly as before metadata existed: no key at all
    assert "metadata_columns" not in json.loads((tmp_path / "ds" / "dataset.json").read_text())
    assert "metadata_columns" not in m.model_dump(mode="json")


def test_the_manifest_refuses_bad_column_lists(tmp_path: Path) -> None:
    for columns in ([], ["a b"], ["x", "x"], [f"c{i}" for i in range(33)]):
        with pytest.raises(ValueError, match="metadata"):
            _manifest(tmp_path / "ds", {"train": 1}, columns)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"camera": "north"}', "not written the way ingest writes it"),
        ('{"hour":7,"camera":"north"}', "not written the way ingest writes it"),
        ('{"lens":"wide"}', "'lens' is not in the manifest's metadata_columns"),
        ('{"hour":NaN}', "NaN is not a value ingest writes"),
        ('{"hour":1,"hour":2}', "a key is given twice"),
        ('{"camera":["a"]}', "(a list)"),
        ('{"camera":""}', "no value is written as missing"),
        ('{"camera":null}', "no value is written as missing"),
        ('["north"]', "a JSON list, not an object"),
        ("not json", "Expecting value"),
        ('{"camera":"' + "x" * 300 + '"}', "longer than 256"),
    ],
)
def test_the_reader_accepts_only_what_ingest_writes(tmp_path: Path, line: str, problem: str) -> None:
    ds, m = _written(tmp_path)
    path = ds / "metadata" / "val.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(DataError) as e:
        load_metadata(ds, m, "val")
    assert problem in str(e.value) and "line 1" in str(e.value)
    assert "re-run `visionloop data ingest`" in str(e.value)


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", "has 0 lines for the 1 records"),
        (b"{}\n{}\n", "more lines than the 1 records"),
        (b"{}", "cut short"),
        (b"{}" + b" " * (70 * 1024) + b"\n", "larger than 1 lines of metadata can be"),
    ],
)
def test_the_reader_wants_one_line_per_record(tmp_path: Path, content: bytes, problem: str) -> None:
    ds, m = _written(tmp_path)
    (ds / "metadata" / "val.jsonl").write_bytes(content)
    with pytest.raises(DataError, match="re-run `visionloop data ingest`") as e:
        load_metadata(ds, m, "val")
    assert problem in str(e.value)


def test_the_reader_stays_inside_the_dataset(tmp_path: Path) -> None:
    ds, m = _written(tmp_path)
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text('{"hour":1}\n')
    (ds / "metadata" / "val.jsonl").unlink()
    os.symlink(outside, ds / "metadata" / "val.jsonl")
    with pytest.raises(DataError, match="leads outside the dataset folder"):
        load_metadata(ds, m, "val")
    (ds / "metadata" / "val.jsonl").unlink()
    with pytest.raises(DataError, match="is missing"):
        load_metadata(ds, m, "val")


def test_the_version_covers_every_value_but_not_the_order() -> None:
    entries = [("train", "sha1", "l1"), ("val", "sha2", "l2")]
    base = metadata_version("v", ["camera"], entries)
    assert metadata_version("v", ["camera"], entries[::-1]) == base
    assert metadata_version("v", ["camera"], [("train", "sha1", "l1"), ("val", "sha2", "lX")]) != base
    assert metadata_version("w", ["camera"], entries) != base
    assert metadata_version("v", ["site"], entries) != base


# --------------------------------------------------------------------------- slices

CLASSES = [str(i) for i in range(10)]


def _cls_results(n: int, correct_every: int, seed: int) -> list[ImageResult]:
    """n one-image results; every `correct_every`-th one wrong (1: all wrong)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        label = i % 10
        logits = torch.randn(1, 10, generator=g)
        logits[0, label if i % correct_every else (label + 1) % 10] += 10
        out.append(ImageResult(logits, torch.tensor([label]), 0.5))
    return out


def test_slices_worst_first_with_intervals_that_hold_the_estimate() -> None:
    task = get_task("classification")
    # 60 images at 90%, 60 at 50%, 40 without a value at 75%, 3 in a tiny slice (all wrong)
    results = (
        _cls_results(60, 10, 0) + _cls_results(60, 2, 1) + _cls_results(40, 4, 2) + _cls_results(3, 1, 3)
    )
    values: list[Any] = ["day"] * 60 + ["night"] * 60 + [None] * 40 + ["dusk"] * 3
    got = compute_slices(task, CLASSES, results, values, column="time", seed=0, resamples=100)
    assert [(s.value, s.images) for s in got] == [("night", 60), (None, 40), ("day", 60), ("dusk", 3)]
    assert [s.metric for s in got] == pytest.approx([0.5, 0.75, 0.9, 0.0])
    for s in got[:3]:
        assert s.ci_low is not None and s.ci_high is not None
        assert s.ci_low <= s.metric <= s.ci_high and s.ci_high - s.ci_low > 0.02  # type: ignore[operator]
        assert s.resampled == s.images
    # night's interval lies below day's: the difference is measurable
    assert got[0].ci_high < got[2].ci_low  # type: ignore[operator]
    tiny = got[3]
    assert tiny.images < MIN_INTERVAL_IMAGES and tiny.ci_low is None and tiny.resampled == 0
    assert got[1].label == "(missing)" and got[1].to_dict()["value"] is None
    # Seeded: the same seed, the same intervals; another seed, others.
    again = compute_slices(task, CLASSES, results, values, column="time", seed=0, resamples=100)
    assert again == got
    other = compute_slices(task, CLASSES, results, values, column="time", seed=1, resamples=100)
    assert [(s.ci_low, s.ci_high) for s in other] != [(s.ci_low, s.ci_high) for s in got]
    assert [s.metric for s in other] == [s.metric for s in got]
    # One value for every image: its slice is the whole pass.
    whole = compute_slices(task, CLASSES, results, ["all"] * len(results), column="c", seed=0, resamples=20)
    assert whole[0].metric == pytest.approx((54 + 30 + 30 + 0) / 163)


def test_values_are_told_apart_by_type() -> None:
    task = get_task("classification")
    results = _cls_results(4, 2, 0)
    got = compute_slices(task, CLASSES, results, [1, "1", True, 1.0], column="c", seed=0, resamples=10)
    assert sorted(repr(s.value) for s in got) == ["'1'", "1", "1.0", "True"]


def _det_results(n: int, good: bool, start_id: int) -> list[ImageResult]:
    """Detection results: one box per image, predicted on the spot (good) or elsewhere."""
    out = []
    for i in range(n):
        box = torch.tensor([[4.0 + i % 5, 4.0, 20.0 + i % 5, 24.0]])
        pred = box if good else box + torch.tensor([[30.0, 30.0, 30.0, 30.0]])
        target = {"boxes": box, "labels": torch.tensor([i % 2]), "image_id": start_id + i}
        outputs = [{"boxes": pred, "scores": torch.tensor([0.9]), "labels": torch.tensor([i % 2])}]
        out.append(ImageResult(outputs, [target], 0.0))
    return out


def test_slices_of_a_detector_resample_images_with_their_ids() -> None:
    # A bootstrap draws an image twice; the detection evaluator refuses an image_id given
    # twice, so the task makes a repeat another image (Task.repeated_targets).
    task = get_task("detection")
    results = _det_results(12, True, 0) + _det_results(12, False, 100)
    values = ["clear"] * 12 + ["fog"] * 12
    got = compute_slices(task, ["a", "b"], results, values, column="weather", seed=0, resamples=20)
    assert [s.value for s in got] == ["fog", "clear"]
    fog, clear = got
    assert fog.metric == pytest.approx(0.0) and clear.metric == pytest.approx(1.0)
    assert clear.ci_low == pytest.approx(1.0) and clear.ci_high == pytest.approx(1.0)
    assert fog.ci_high == pytest.approx(0.0)


def test_the_detection_task_keeps_no_input_image_with_a_result() -> None:
    task = get_task("detection")
    outputs = [
        {
            "boxes": torch.zeros(1, 4),
            "scores": torch.ones(1),
            "labels": torch.zeros(1),
            "image": torch.ones(3, 64, 64),
        }
    ]
    kept, targets = task.image_result(outputs, [{"boxes": torch.zeros(1, 4), "image_id": 3}])
    assert set(kept[0]) == {"boxes", "scores", "labels"} and targets[0]["image_id"] == 3
    assert "image_id" not in task.repeated_targets(targets, 1)[0]
    assert task.repeated_targets(targets, 0) is targets


def test_a_fifo_for_the_metadata_file_is_refused_without_waiting(tmp_path: Path) -> None:
    from _hangkit import in_thread

    ds, m = _written(tmp_path)
    path = ds / "metadata" / "val.jsonl"
    path.unlink()
    os.mkfifo(path)  # a dataset folder is handed in: before, training or `eval --slices` waited here
    got = in_thread(lambda: load_metadata(ds, m, "val"))
    assert isinstance(got, DataError), got
    assert f"{path} cannot be read (is a FIFO (named pipe)" in str(got) and "visionloop data ingest" in str(
        got
    )
