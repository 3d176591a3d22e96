"""Round trip through every format (read(write(x)) == x up to each format's precision), with
EXIF-rotated images, and format detection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_annotations_common import make_image, rotated_jpeg

from visionloop.core.errors import DataError
from visionloop.data.ingest import IngestOptions, ingest
from visionloop.data.manifest import read_manifest
from visionloop.data.shards import ShardReader, record_field
from visionloop.tasks.detection.annotations import (
    DetectionSample,
    DetectionSource,
    detect_format,
    read_coco,
    read_detection_source,
    read_label_studio,
    write_coco,
    write_label_studio,
    write_voc,
    write_yolo,
)
from visionloop.tasks.detection.annotations.yolo import flat_name
from visionloop.tasks.detection.boxes import decode_boxes
from visionloop.tasks.detection.task import DetectionTask


def _source(root: Path) -> DetectionSource:
    make_image(root / "train" / "plain.jpg", 640, 480)
    make_image(root / "train" / "bg.png", 64, 32, fmt="PNG")
    rotated_jpeg(root / "val" / "rot6.jpg", 6)
    rotated_jpeg(root / "val" / "rot3.jpg", 3)
    make_image(root / "val" / "odd name & co.jpg", 333, 111)
    samples = [
        DetectionSample(
            root / "train" / "plain.jpg",
            "train/plain.jpg",
            640,
            480,
            [(0.0, 0.0, 640.0, 480.0), (10.25, 20.5, 100.125, 200.75), (600.3, 400.7, 639.9, 479.95)],
            [0, 1, 2],
            [False, True, False],
            "train",
        ),
        DetectionSample(root / "train" / "bg.png", "train/bg.png", 64, 32, [], [], [], "train"),
        DetectionSample(
            root / "val" / "rot6.jpg",
            "val/rot6.jpg",
            320,
            192,
            [(32.0, 48.0, 160.0, 112.0)],
            [1],
            [False],
            "val",
        ),
        DetectionSample(
            root / "val" / "rot3.jpg",
            "val/rot3.jpg",
            320,
            192,
            [(1.5, 2.5, 300.0, 190.0)],
            [2],
            [True],
            "val",
        ),
        DetectionSample(
            root / "val" / "odd name & co.jpg",
            "val/odd name & co.jpg",
            333,
            111,
            [(3.0, 4.0, 5.0, 6.0)],
            [0],
            [False],
            "test",
        ),
    ]
    return DetectionSource("test", root, ["cat", "dog", "person <&>"], samples)


def _same(
    a: DetectionSource, b: DetectionSource, tol: float, *, difficult: bool, split: bool, by_name: bool
) -> None:
    assert b.classes == a.classes
    assert b.issues == [], [i.message for i in b.issues]
    key = (lambda s: flat_name(s.rel)) if by_name else (lambda s: s.rel)
    got = {Path(s.rel).name if by_name else s.rel: s for s in b.samples}
    assert sorted(got) == sorted(key(s) for s in a.samples)
    for s in a.samples:
        t = got[key(s)]
        assert (t.width, t.height, t.labels) == (s.width, s.height, s.labels), s.rel
        assert len(t.boxes) == len(s.boxes)
        for bt, bs in zip(t.boxes, s.boxes, strict=True):
            assert all(abs(x - y) <= tol for x, y in zip(bt, bs, strict=True)), (s.rel, bt, bs)
        if difficult:
            assert t.difficult == s.difficult
        if split:
            assert t.split == s.split


def test_round_trip_coco(tmp_path: Path) -> None:
    src = _source(tmp_path / "imgs")
    write_coco(src, tmp_path / "out.json", tmp_path / "imgs")
    doc = json.loads((tmp_path / "out.json").read_text())
    rot6 = next(i for i in doc["images"] if i["file_name"] == "val/rot6.jpg")
    assert (rot6["width"], rot6["height"]) == (192, 320)  # the stored pixel array's size
    back = read_coco(tmp_path / "imgs", tmp_path / "out.json")
    for s in back.samples:
        s.split = next(o.split for o in src.samples if o.rel == s.rel)  # COCO: one split per file
    _same(src, back, 1e-9, difficult=True, split=True, by_name=False)


def test_round_trip_yolo(tmp_path: Path) -> None:
    src = _source(tmp_path / "imgs")
    data = write_yolo(src, tmp_path / "yolo")
    back = read_detection_source(data.parent)
    assert back.format == "yolo"
    _same(src, back, 1e-6 * 640 * 1.5, difficult=False, split=True, by_name=True)


def test_round_trip_voc(tmp_path: Path) -> None:
    src = _source(tmp_path / "imgs")
    write_voc(src, tmp_path / "voc")
    back = read_detection_source(tmp_path / "voc")
    assert back.format == "voc"
    # VOC has no class list: the names found, sorted (here the same order).
    _same(src, back, 0.005 + 1e-9, difficult=True, split=True, by_name=True)


def _stored_flags(out: Path) -> dict[str, tuple[list[int], list[bool]]]:
    """rel -> (labels, ignore flags) of every stored image, decoded from the dataset's shards."""
    m = read_manifest(out)
    src = read_detection_source(Path(m.source.path))
    found = {}
    for info in m.splits.values():
        reader = ShardReader(out / info.shard_dir)
        for k in range(len(reader)):
            rec = reader[k]
            _, labels, ignore = decode_boxes(record_field(rec, "boxes"), len(m.classes))
            found[src.samples[rec["index"]].rel] = (labels.tolist(), ignore.tolist())
    return found


@pytest.mark.parametrize("fmt", ["coco", "voc"])
def test_crowd_and_difficult_flags_reach_the_shard(tmp_path: Path, fmt: str) -> None:
    src = _source(tmp_path / "imgs")
    if fmt == "coco":
        write_coco(src, tmp_path / "imgs" / "instances.json", tmp_path / "imgs")
        source = tmp_path / "imgs"
    else:
        source = write_voc(src, tmp_path / "voc")
    m = ingest(source, tmp_path / "ds", IngestOptions(workers=1)).manifest
    stored = _stored_flags(tmp_path / "ds")
    key = (lambda rel: rel) if fmt == "coco" else (lambda rel: Path(rel).name)
    assert {key(rel): v for rel, v in stored.items()} == {
        key(s.rel if fmt == "coco" else flat_name(s.rel)): (s.labels, s.difficult) for s in src.samples
    }
    stats = DetectionTask().dataset_stats(m)
    assert stats is not None and sum(s.difficult_boxes for s in stats.splits.values()) == 2
    # The flags are part of the data: without them, the same boxes give another version.
    for s in src.samples:
        s.difficult = [False] * len(s.boxes)
    if fmt == "coco":
        write_coco(src, tmp_path / "imgs" / "instances.json", tmp_path / "imgs")
    else:
        write_voc(src, tmp_path / "voc2")
        source = tmp_path / "voc2"
    plain = ingest(source, tmp_path / "plain", IngestOptions(workers=1)).manifest
    assert plain.version != m.version
    assert all(not any(flags) for _, flags in _stored_flags(tmp_path / "plain").values())


def test_round_trip_label_studio(tmp_path: Path) -> None:
    src = _source(tmp_path / "imgs")
    write_label_studio(src, tmp_path / "imgs" / "export.json", tmp_path / "imgs")
    back = read_label_studio(tmp_path / "imgs" / "export.json", tmp_path / "imgs")
    _same(src, back, 1e-9, difficult=False, split=False, by_name=False)
    assert detect_format(tmp_path / "imgs") == "label_studio"


def test_write_yolo_refuses_mixed_splits(tmp_path: Path) -> None:
    src = _source(tmp_path / "imgs")
    src.samples[0].split = None
    with pytest.raises(DataError, match="split"):
        write_yolo(src, tmp_path / "yolo")


def test_detect_format_of_each_layout(tmp_path: Path) -> None:
    coco = tmp_path / "coco"
    make_image(coco / "train2017" / "a.jpg", 10, 10)
    make_image(coco / "val2017" / "b.jpg", 10, 10)
    (coco / "annotations").mkdir()
    for split, name in (("train2017", "a.jpg"), ("val2017", "b.jpg")):
        (coco / "annotations" / f"instances_{split}.json").write_text(
            json.dumps(
                {
                    "images": [{"id": 1, "file_name": name}],
                    "annotations": [{"id": 1, "image_id": 1, "category_id": 2, "bbox": [1, 1, 2, 2]}],
                    "categories": [{"id": 1, "name": "a"}, {"id": 2, "name": "b"}]
                    if split == "val2017"
                    else [{"id": 2, "name": "b"}],
                }
            )
        )
    assert detect_format(coco) == "coco"
    assert detect_format(coco / "annotations" / "instances_val2017.json") == "coco"
    src = read_detection_source(coco)
    assert src.classes == ["b", "a"]
    assert [(s.rel, s.split, s.labels) for s in src.samples] == [
        ("train2017/a.jpg", "train", [0]),
        ("val2017/b.jpg", "val", [0]),
    ]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="no detection source"):
        detect_format(empty)
    both = tmp_path / "both"
    (both / "Annotations").mkdir(parents=True)
    (both / "data.yaml").write_text("names: [a]\n")
    with pytest.raises(DataError, match="--format"):
        detect_format(both)
    with pytest.raises(DataError, match="unknown detection format"):
        read_detection_source(both, format="kitti")
