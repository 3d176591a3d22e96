"""Detection ingest (`tasks.detection.ingest`): boxes survive the trip from an annotation source
into shards exactly (scaled with the image), every reader issue lands in rejected.jsonl, the
split and the version behave, and the source is never touched."""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from _imgfactory import exif_jpeg, png, tree_digest, truncate, write
from visionloop.core.errors import DataError
from visionloop.data.ingest import IngestOptions, IngestReport, ingest
from visionloop.data.manifest import REJECTED_NAME, DatasetManifest, read_manifest
from visionloop.data.shards import ShardReader, record_field
from visionloop.data.split import BACKGROUND_GROUP, rarest_class_groups
from visionloop.tasks.detection.annotations import (
    DetectionSample,
    DetectionSource,
    read_detection_source,
    write_coco,
    write_label_studio,
    write_voc,
    write_yolo,
)
from visionloop.tasks.detection.boxes import decode_boxes
from visionloop.tasks.detection.ingest import is_detection_source, scale_boxes
from visionloop.tasks.detection.stats import DetectionStats
from visionloop.tasks.detection.synthetic import generate_detection_dataset
from visionloop.tasks.detection.task import DetectionTask

W, H = 48, 40  # generated image size; --max-side 24 halves both sides exactly


def stats_of(m: DatasetManifest) -> DetectionStats | None:
    """The manifest's detection statistics, as the task reads them back."""
    return DetectionTask().dataset_stats(m)


def _opts(**kw: object) -> IngestOptions:
    kw.setdefault("workers", 1)
    return IngestOptions(**kw)  # type: ignore[arg-type]


def _records(out: Path, num_classes: int) -> dict[int, tuple[str, bytes, np.ndarray, np.ndarray]]:
    """index -> (split, image bytes, boxes, labels) over every split of a built dataset."""
    m = read_manifest(out)
    found: dict[int, tuple[str, bytes, np.ndarray, np.ndarray]] = {}
    for split, info in m.splits.items():
        reader = ShardReader(out / info.shard_dir)
        for k in range(len(reader)):
            rec = reader[k]
            boxes, labels, _ = decode_boxes(record_field(rec, "boxes"), num_classes)
            assert rec["label"] == len(labels)  # a detection record's label is its box count
            found[rec["index"]] = (split, rec["image"], boxes, labels)
    return found


def _rejected(out: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / REJECTED_NAME).read_text().splitlines()]


@pytest.fixture(scope="module")
def coco_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("coco")
    generate_detection_dataset(root, 30, image_size=(W, H), digit_size=(8, 20), classes=(1, 2, 3))
    return root


def test_coco_boxes_come_back_scaled_by_max_side(coco_src: Path, tmp_path: Path) -> None:
    before = tree_digest(coco_src)
    report = ingest(coco_src, tmp_path / "ds", _opts(max_side=24))
    assert tree_digest(coco_src) == before  # the source is only read
    src = read_detection_source(coco_src)
    m = report.manifest
    assert m.task == "detection" and m.source.kind == "coco" and m.classes == ["1", "2", "3"]
    records = _records(tmp_path / "ds", 3)
    assert sorted(records) == list(range(30))
    for index, (_, image, boxes, labels) in records.items():
        sample = src.samples[index]
        assert Image.open(io.BytesIO(image)).size == (24, 20)
        want = np.asarray(sample.boxes, dtype=np.float64).reshape(-1, 4) * 0.5
        np.testing.assert_allclose(boxes, want, atol=1e-5)
        assert labels.tolist() == sample.labels
    det = stats_of(m)
    assert det is not None
    counts = src.counts()
    assert sum(s.images for s in det.splits.values()) == 30
    assert sum(s.background_images for s in det.splits.values()) == counts.background_images
    for cls in m.classes:
        assert sum(s.instances[cls] for s in det.splits.values()) == counts.instances[cls]
        # per_class of a detection split: images that contain the class
        with_cls = Counter(
            records[i][0] for i, s in enumerate(src.samples) if m.classes.index(cls) in s.labels
        )
        assert {s: m.splits[s].per_class[cls] for s in m.splits} == {s: with_cls.get(s, 0) for s in m.splits}
    # 24x20 images: every box is COCO-small
    n_boxes = sum(len(s.boxes) for s in src.samples)
    assert sum(s.box_sizes.small for s in det.splits.values()) == n_boxes
    assert m.rejected == 0 and report.rejected_by_reason == {}
    assert m.size_stats.max == (24, 20)
    assert m.split_policy.from_source is False and m.splits["val"].count > 0


def test_yolo_voc_and_coco_give_the_same_boxes(coco_src: Path, tmp_path: Path) -> None:
    src = read_detection_source(coco_src)
    for k, s in enumerate(src.samples):  # a split the writers carry over
        s.split = "val" if k % 4 == 0 else "train"
    yaml = write_yolo(src, tmp_path / "yolo")
    voc = write_voc(src, tmp_path / "voc")
    shutil.copytree(coco_src / "images", tmp_path / "ls" / "images")
    ls = DetectionSource(
        "ls", tmp_path / "ls", src.classes, [_moved(s, tmp_path / "ls") for s in src.samples]
    )
    write_label_studio(ls, tmp_path / "ls" / "export.json", tmp_path / "ls")
    got = {}
    for name, path in (("yolo", yaml.parent), ("voc", voc), ("label_studio", tmp_path / "ls")):
        report = ingest(path, tmp_path / f"ds_{name}", _opts())
        assert report.manifest.source.kind == name
        if name != "label_studio":  # Label Studio has no splits: seeded
            assert report.manifest.split_policy.from_source is True
            assert report.manifest.splits["val"].count == 8
        by_image = {}
        for split, image, boxes, labels in _records(tmp_path / f"ds_{name}", 3).values():
            by_image[hashlib.sha256(image).hexdigest()] = (split, boxes, labels)
        got[name] = by_image
    assert got["yolo"].keys() == got["voc"].keys() == got["label_studio"].keys() and len(got["yolo"]) == 30
    for sample in src.samples:
        key = hashlib.sha256(sample.image.read_bytes()).hexdigest()  # PNG stored as is
        want = np.asarray(sample.boxes, dtype=np.float64).reshape(-1, 4)
        for name in ("yolo", "voc", "label_studio"):
            split, boxes, labels = got[name][key]
            assert split == sample.split or name == "label_studio"
            # YOLO keeps 6 decimals of the image size, VOC 2 decimals of a pixel, Label Studio percents
            np.testing.assert_allclose(boxes, want, atol=0.01)
            assert labels.tolist() == sample.labels


def _moved(sample: DetectionSample, root: Path) -> DetectionSample:
    image = root / "images" / sample.image.name
    return DetectionSample(
        image, image.relative_to(root).as_posix(), sample.width, sample.height, sample.boxes, sample.labels
    )


def _hostile_coco(root: Path) -> Path:
    images = root / "images"
    arr = np.full((40, 50, 3), 90, dtype=np.uint8)
    write(images / "a.png", png(arr))
    write(images / "b.png", png(arr + 1))
    write(images / "bg.png", png(arr + 2))
    write(
        images / "broken.png", truncate(png(np.random.default_rng(0).integers(0, 255, (40, 50, 3), np.uint8)))
    )
    doc = {
        "images": [
            {"id": 1, "file_name": "a.png", "width": 50, "height": 40},
            {"id": 2, "file_name": "b.png", "width": 50, "height": 40},
            {"id": 3, "file_name": "bg.png", "width": 50, "height": 40},
            {"id": 4, "file_name": "missing.png", "width": 50, "height": 40},
            {"id": 5, "file_name": "broken.png", "width": 50, "height": 40},
        ],
        "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "dog"}],
        "annotations": [
            {"id": 10, "image_id": 1, "category_id": 1, "bbox": [40, 30, 20, 20]},  # past the edge
            {"id": 11, "image_id": 1, "category_id": 7, "bbox": [1, 1, 5, 5]},  # no category 7
            {"id": 12, "image_id": 2, "category_id": 2, "bbox": [float("nan"), 1, 5, 5]},
            {"id": 13, "image_id": 2, "category_id": 2, "bbox": [2, 3, 10, 10]},
            {"id": 14, "image_id": 2, "category_id": 2, "bbox": [100, 100, 5, 5]},  # outside
            "not an annotation",
            {"id": 15, "image_id": 4, "category_id": 1, "bbox": [1, 1, 5, 5]},
            {"id": 16, "image_id": 5, "category_id": 1, "bbox": [1, 1, 5, 5]},
        ],
    }
    write(root / "instances.json", json.dumps(doc).encode())  # NaN written as JSON's NaN
    return root


def test_hostile_coco_rows_in_rejected_and_clipped_box_kept(tmp_path: Path) -> None:
    src = _hostile_coco(tmp_path / "src")
    before = tree_digest(src)
    report = ingest(src, tmp_path / "ds", _opts())
    assert tree_digest(src) == before
    rows = _rejected(tmp_path / "ds")
    reasons = Counter(str(r["reason"]) for r in rows)
    assert reasons == {
        "box_clipped": 1,
        "unknown_class": 1,
        "box_not_finite": 1,
        "box_outside_image": 1,
        "malformed_annotation": 1,
        "missing_image": 1,
        "truncated": 1,
    }
    assert all(r["kept"] is (r["reason"] == "box_clipped") for r in rows)
    assert next(r for r in rows if r["reason"] == "truncated")["path"] == "images/broken.png"
    assert report.repaired_by_reason == {"box_clipped": 1}
    assert report.rejected_by_reason["missing_image"] == 1 and sum(report.rejected_by_reason.values()) == 6
    m = report.manifest
    assert m.rejected == 6
    det = stats_of(m)
    assert det is not None
    assert det.clipped_boxes == 1 and sum(s.clipped_boxes for s in det.splits.values()) == 1
    # not finite, outside, unknown class, the malformed one, and the truncated image's box
    assert det.dropped_boxes == 5
    assert sum(s.images for s in det.splits.values()) == 3
    assert sum(s.background_images for s in det.splits.values()) == 1
    records = _records(tmp_path / "ds", 2)
    stored = {tuple(map(float, b)) for _, _, boxes, _ in records.values() for b in boxes.tolist()}
    assert stored == {(40.0, 30.0, 50.0, 40.0), (2.0, 3.0, 12.0, 13.0)}  # clipped at 50x40


def test_malformed_json_is_a_clear_error_and_out_is_not_made(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src / "images" / "a.png", png(np.zeros((8, 8, 3), np.uint8)))
    write(src / "instances.json", b'{"images": [{"id": 1, "file_name": "a.png"')
    with pytest.raises(DataError, match="not valid JSON"):
        ingest(src, tmp_path / "ds", _opts())
    assert not (tmp_path / "ds").exists()


def test_hostile_yolo_lines(tmp_path: Path) -> None:
    src = tmp_path / "yolo"
    write(src / "data.yaml", b"path: .\ntrain: images/train\nval: images/val\nnames: [a, b]\n")
    for split, name in (("train", "x"), ("train", "y"), ("val", "z")):
        write(src / "images" / split / f"{name}.png", png(np.full((20, 30, 3), ord(name), np.uint8)))
    write(
        src / "labels" / "train" / "x.txt",
        b"0 0.5 0.5 0.2 0.2\n0 0.5 0.5\n5 0.5 0.5 0.2 0.2\n1 nan 0.5 0.2 0.2\n1 0.9 0.9 0.4 0.4 \n",
    )
    write(src / "labels" / "train" / "y.txt", b"")  # a background image
    write(src / "labels" / "val" / "z.txt", b"\xff\xfe not utf-8")
    report = ingest(src, tmp_path / "ds", _opts(max_side=15))
    reasons = Counter(str(r["reason"]) for r in _rejected(tmp_path / "ds"))
    assert reasons == {
        "malformed_annotation": 1,  # 3 columns
        "unknown_class": 1,  # class 5 of 2
        "box_not_finite": 1,
        "box_clipped": 1,
        "unreadable_annotation_file": 1,
    }
    records = _records(tmp_path / "ds", 2)
    assert len(records) == 2  # z left out with its unreadable label file
    boxes = sorted(
        tuple(round(float(v), 4) for v in b) for _, _, bs, _ in records.values() for b in bs.tolist()
    )
    # 30x20 -> 15x10: the centre box (12, 8, 18, 12) halves, the corner one is clipped at the edge
    assert boxes == [(6.0, 4.0, 9.0, 6.0), (10.5, 7.0, 15.0, 10.0)]
    det = stats_of(report.manifest)
    assert det is not None and det.splits["train"].background_images == 1


def test_box_with_no_area_after_scaling_is_rejected(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src / "images" / "a.png", png(np.zeros((40, 48, 3), np.uint8)))
    doc = {
        "images": [{"id": 1, "file_name": "a.png", "width": 48, "height": 40}],
        "categories": [{"id": 1, "name": "thin"}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 1, "bbox": [10, 10, 0.015, 5]},
            {"id": 2, "image_id": 1, "category_id": 1, "bbox": [20, 10, 4, 4]},
        ],
    }
    write(src / "instances.json", json.dumps(doc).encode())
    report = ingest(src, tmp_path / "ds", _opts(max_side=24, val_fraction=0.0))
    rows = _rejected(tmp_path / "ds")
    assert [r["reason"] for r in rows] == ["box_zero_area"] and "--max-side" in str(rows[0]["message"])
    ((_, _, boxes, _),) = _records(tmp_path / "ds", 1).values()
    assert boxes.tolist() == [[10.0, 5.0, 12.0, 7.0]]
    stats = stats_of(report.manifest)
    assert stats is not None and stats.dropped_boxes == 1


def test_exif_rotated_jpeg_keeps_its_box_on_the_object(tmp_path: Path) -> None:
    # Upright 40 wide x 60 tall, a white block at upright (8, 30)-(24, 50) on black.
    upright = np.zeros((60, 40, 3), np.uint8)
    upright[30:50, 8:24] = 255
    # Stored rotated: orientation 6 means "rotate 90 clockwise to show", so the raw pixels are
    # the upright ones turned 90 counter-clockwise.
    raw = np.ascontiguousarray(np.rot90(upright, k=1))
    src = tmp_path / "src"
    path = write(src / "images" / "r.jpg", exif_jpeg(raw, orientation=6))
    sample = DetectionSample(path, "r.jpg", 40, 60, [(8.0, 30.0, 24.0, 50.0)], [0], [False])
    write_coco(
        DetectionSource("coco", src / "images", ["block"], [sample]), src / "instances.json", src / "images"
    )
    read_back = read_detection_source(src)
    assert read_back.samples[0].boxes == [(8.0, 30.0, 24.0, 50.0)]  # upright frame
    ingest(src, tmp_path / "ds", _opts(max_side=30, val_fraction=0.0))
    ((_, image, boxes, _),) = _records(tmp_path / "ds", 1).values()
    stored = np.asarray(Image.open(io.BytesIO(image)).convert("L"), dtype=np.float64)
    assert stored.shape == (30, 20)  # upright, halved
    x1, y1, x2, y2 = (round(float(v)) for v in boxes[0])
    assert (x1, y1, x2, y2) == (4, 15, 12, 25)
    inside = stored[y1 + 1 : y2 - 1, x1 + 1 : x2 - 1]
    outside = stored.copy()
    outside[y1 - 1 : y2 + 1, x1 - 1 : x2 + 1] = np.nan
    assert inside.mean() > 200 and np.nanmean(outside) < 30


def test_version_stable_across_reingest_and_moves_with_a_box(coco_src: Path, tmp_path: Path) -> None:
    copy = tmp_path / "src"
    shutil.copytree(coco_src, copy)
    v1 = ingest(copy, tmp_path / "a", _opts()).manifest.version
    v2 = ingest(copy, tmp_path / "b", _opts(workers=2)).manifest.version
    assert v1 == v2
    doc = json.loads((copy / "instances.json").read_text())
    doc["annotations"][0]["bbox"][0] += 1  # one box moves one pixel
    (copy / "instances.json").write_text(json.dumps(doc))
    v3 = ingest(copy, tmp_path / "c", _opts()).manifest.version
    assert v3 != v1


def test_split_is_seeded_and_stratified_by_rarest_class() -> None:
    present = [[0, 1], [1], [1], [], [0], [2, 1]]
    # class 0 in 2 images, class 1 in 4, class 2 in 1
    assert rarest_class_groups(present) == [0, 1, 1, BACKGROUND_GROUP, 0, 2]


def test_seeded_split_is_deterministic(coco_src: Path, tmp_path: Path) -> None:
    def splits(out: Path, seed: int) -> dict[int, str]:
        ingest(coco_src, out, _opts(seed=seed, val_fraction=0.3))
        return {i: r[0] for i, r in _records(out, 3).items()}

    a, b, c = splits(tmp_path / "a", 0), splits(tmp_path / "b", 0), splits(tmp_path / "c", 1)
    assert a == b and a != c
    assert 6 <= Counter(a.values())["val"] <= 12  # ~30% of 30 images, per stratum within half an image


def test_scale_boxes_uses_each_axis_factor() -> None:
    s = DetectionSample(Path("x"), "x", 100, 30, [(0.0, 0.0, 100.0, 30.0), (50.0, 10.0, 60.0, 20.0)], [0, 1])
    boxes, labels, kept, moved = scale_boxes(s, 64, 19)  # target_size(100, 30, 64) = (64, 19)
    np.testing.assert_allclose(boxes, [[0.0, 0.0, 64.0, 19.0], [32.0, 19 / 3, 38.4, 38 / 3]])
    assert labels.tolist() == [0, 1] and kept == [0, 1] and moved == 0
    # A box past the edge (no reader in front) is clipped to the stored image and counted.
    s.boxes = [(90.0, 0.0, 110.0, 30.0)]
    s.labels = [0]
    boxes, _, kept, moved = scale_boxes(s, 64, 19)
    np.testing.assert_allclose(boxes, [[57.6, 0, 64, 19]])
    assert kept == [0] and moved == 1


def test_dispatch_only_for_detection_sources(coco_src: Path, tmp_path: Path) -> None:
    assert is_detection_source(coco_src)
    assert is_detection_source(coco_src / "instances.json")
    folder = tmp_path / "folder"
    write(folder / "cat" / "a.png", png(np.zeros((8, 8, 3), np.uint8)))
    write(tmp_path / "list.csv", b"path,label\nfolder/cat/a.png,cat\n")
    assert not is_detection_source(folder) and not is_detection_source(tmp_path / "list.csv")
    # --format forces a detection read, and an unknown one is refused up front
    listed = r"format must be one of coco, yolo, voc, label_studio, .*\(detection\)"
    with pytest.raises(DataError, match=listed):
        ingest(coco_src, tmp_path / "ds0", _opts(format="pascal"))
    assert not (tmp_path / "ds0").exists()
    with pytest.raises(DataError, match=r"no data\.yaml"):
        ingest(folder, tmp_path / "ds", _opts(format="yolo"))
    report: IngestReport = ingest(coco_src / "instances.json", tmp_path / "ds2", _opts(format="coco"))
    assert report.manifest.source.kind == "coco" and report.kept == 30


def test_a_manifest_with_stats_under_the_task_key_still_loads(coco_src: Path, tmp_path: Path) -> None:
    # Manifests written before the task owned its statistics hold them under "detection".
    report = ingest(coco_src, tmp_path / "ds", _opts())
    path = tmp_path / "ds" / "dataset.json"
    raw = json.loads(path.read_text())
    assert "detection" not in raw and raw["task_stats"]["dropped_boxes"] == 0
    raw["detection"] = raw.pop("task_stats")
    path.write_text(json.dumps(raw))
    old = read_manifest(tmp_path / "ds")
    assert old == report.manifest and old.version == report.manifest.version
    assert stats_of(old) == stats_of(report.manifest) and stats_of(old) is not None
    # and a manifest with no statistics is written without the key, as before
    plain = old.model_copy(update={"task_stats": None})
    assert "task_stats" not in json.loads(plain.model_dump_json())
