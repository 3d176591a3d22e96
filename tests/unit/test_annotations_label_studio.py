"""Label Studio JSON export reader: percent boxes, rotation, image names from Label Studio URLs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_annotations_common import make_image, reasons

from visionloop.core.errors import DataError
from visionloop.tasks.detection.annotations import DetectionSource, IssueReason, read_label_studio


def _rect(
    x: float, y: float, w: float, h: float, label: object = "dog", **extra: object
) -> dict[str, object]:
    value = {"x": x, "y": y, "width": w, "height": h, "rotation": 0, "rectanglelabels": [label]}
    value.update({k: v for k, v in extra.items() if k == "rotation"})
    r: dict[str, object] = {
        "type": "rectanglelabels",
        "original_width": 200,
        "original_height": 100,
        "value": value,
    }
    r.update({k: v for k, v in extra.items() if k != "rotation"})
    return r


def _task(tid: int, image: str, *results: dict[str, object], **ann: object) -> dict[str, object]:
    return {"id": tid, "data": {"image": image}, "annotations": [{"id": tid, "result": list(results), **ann}]}


@pytest.fixture
def images(tmp_path: Path) -> Path:
    make_image(tmp_path / "media" / "a.jpg", 200, 100)
    make_image(tmp_path / "media" / "sub" / "b.jpg", 200, 100)
    make_image(tmp_path / "media" / "x" / "dup.jpg", 200, 100)
    make_image(tmp_path / "media" / "y" / "dup.jpg", 200, 100)
    return tmp_path / "media"


def _read(tmp_path: Path, images: Path, tasks: object) -> DetectionSource:
    (tmp_path / "export.json").write_text(json.dumps(tasks))
    return read_label_studio(tmp_path / "export.json", images)


def test_reads_percent_boxes_and_resolves_label_studio_urls(tmp_path: Path, images: Path) -> None:
    tasks = [
        _task(1, "/data/upload/3/0a1b2c3d-a.jpg", _rect(10, 20, 30, 40), {"type": "choices", "value": {}}),
        _task(2, "/data/local-files/?d=sub%2Fb.jpg", _rect(0, 0, 100, 100, "cat")),
        {
            "id": 3,
            "data": {"image": "s3://bucket/a.jpg"},
            "annotations": [{"was_cancelled": True, "result": []}],
        },
        _task(4, "https://host/dup.jpg", _rect(1, 1, 1, 1)),
    ]
    src = _read(tmp_path, images, tasks)
    assert src.classes == ["cat", "dog"]
    a, b = src.samples
    assert (a.rel, a.labels) == ("a.jpg", [1])
    assert len(a.boxes) == 1 and a.boxes[0] == pytest.approx((20, 20, 80, 60))
    assert (b.rel, b.boxes, b.labels) == ("sub/b.jpg", [(0, 0, 200, 100)], [0])
    assert reasons(src) == ["ambiguous_image"] and "x/dup.jpg" in src.issues[0].message
    assert any("1 choices" in w for w in src.warnings) and any("1 task(s) without" in w for w in src.warnings)


def test_rotation_unknown_labels_and_bad_values(tmp_path: Path, images: Path) -> None:
    tasks = [
        _task(
            1,
            "a.jpg",
            _rect(10, 10, 10, 10, rotation=30, id="rot"),
            _rect(10, 10, 10, 10, image_rotation=90, id="imgrot"),
            _rect(10, 10, 10, 10, rotation=360, id="full"),
            _rect(10, 10, "wide", 10, id="str"),  # type: ignore[arg-type]  # a hostile width
            _rect(10, 10, 10, 10, label=5, id="num"),
            _rect(95, 10, 10, 10, id="clip"),
            _rect(10, 10, 10, 10, label="cow", id="cow"),
        ),
        _task(2, "nowhere.jpg", _rect(1, 1, 1, 1)),
        {"id": 3, "data": {}, "annotations": []},
        "not a task",
    ]
    (tmp_path / "export.json").write_text(json.dumps(tasks))
    src = read_label_studio(tmp_path / "export.json", images, classes=["dog"])
    by = {i.annotation: i.reason for i in src.issues}
    assert by == {
        "task 1 result rot": IssueReason.BOX_ROTATED,
        "task 1 result imgrot": IssueReason.BOX_ROTATED,
        "task 1 result str": IssueReason.MALFORMED_ANNOTATION,
        "task 1 result num": IssueReason.MALFORMED_ANNOTATION,
        "task 1 result clip": IssueReason.BOX_CLIPPED,
        "task 1 result cow": IssueReason.UNKNOWN_CLASS,
        "task 2": IssueReason.MISSING_IMAGE,
        "task 3": IssueReason.MALFORMED_ANNOTATION,
        "task [3]": IssueReason.MALFORMED_ANNOTATION,
    }
    assert src.samples[0].boxes == [pytest.approx((20, 10, 40, 20)), pytest.approx((190, 10, 200, 20))]


def test_ground_truth_wins_then_the_last_annotation(tmp_path: Path, images: Path) -> None:
    task = {
        "id": 1,
        "data": {"image": "a.jpg"},
        "annotations": [
            {"id": 1, "result": [_rect(0, 0, 10, 10)], "ground_truth": True},
            {"id": 2, "result": [_rect(50, 50, 10, 10)]},
        ],
    }
    src = _read(tmp_path, images, [task])
    assert src.samples[0].boxes == [(0, 0, 20, 10)] and any("1 other annotation" in w for w in src.warnings)


@pytest.mark.parametrize("doc", ["{", {"tasks": []}, {"images": [], "annotations": []}])
def test_unusable_export_is_a_data_error(tmp_path: Path, images: Path, doc: object) -> None:
    (tmp_path / "export.json").write_text(doc if isinstance(doc, str) else json.dumps(doc))
    with pytest.raises(DataError, match=r"export\.json"):
        read_label_studio(tmp_path / "export.json", images)
