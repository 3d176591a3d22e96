"""COCO reader on hostile files: never a crash, an issue per bad item, DataError only for a
file that is unusable as a whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_annotations_common import make_image, reasons

from visionloop.core.errors import DataError
from visionloop.tasks.detection.annotations import IssueReason, read_coco
from visionloop.tasks.detection.annotations import common as common_mod


def _write(tmp_path: Path, doc: object) -> Path:
    path = tmp_path / "instances_train.json"
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return path


@pytest.fixture
def img(tmp_path: Path) -> Path:
    make_image(tmp_path / "img" / "a.jpg", 100, 80)
    make_image(tmp_path / "img" / "b.jpg", 100, 80)
    return tmp_path / "img"


GOOD = {
    "images": [
        {"id": 1, "file_name": "a.jpg", "width": 100, "height": 80},
        {"id": 2, "file_name": "b.jpg", "width": 100, "height": 80},
    ],
    "annotations": [
        {"id": 10, "image_id": 1, "category_id": 3, "bbox": [1, 2, 30, 40]},
        {"id": 11, "image_id": 1, "category_id": 7, "bbox": [5, 5, 10, 10], "iscrowd": 1},
    ],
    "categories": [{"id": 7, "name": "dog"}, {"id": 3, "name": "cat"}],
}


def test_reads_a_good_file_with_split_background_and_crowd(tmp_path: Path, img: Path) -> None:
    src = read_coco(img, _write(tmp_path, GOOD))
    assert src.classes == ["cat", "dog"]  # category id order
    a, b = src.samples
    assert (a.rel, a.split, a.width, a.height) == ("a.jpg", "train", 100, 80)
    assert a.boxes == [(1, 2, 31, 42), (5, 5, 15, 15)] and a.labels == [0, 1] and a.difficult == [False, True]
    assert b.background and src.issues == []
    counts = src.counts()
    assert (counts.images, counts.background_images, counts.difficult) == (2, 1, 1)
    assert counts.instances == {"cat": 1, "dog": 1}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"images": [', "not valid JSON"),  # truncated
        ("not json at all", "not valid JSON"),
        ("[]", "not an object"),
        ('"a string"', "not an object"),
        ('{"images": [], "categories": []}', "names no classes"),
        ('{"images": [], "annotations": []}', "`categories` is missing"),
        ('{"images": {}, "categories": [{"id": 1, "name": "x"}]}', "`images` is dict"),
        ('{"images": [], "categories": [{"id": 1, "name": "x"}], "annotations": 5}', "`annotations` is int"),
        ("[" * 100_000 + "]" * 100_000, "cannot be parsed"),  # nesting past the recursion limit
        ('{"images": [], "categories": [{"id": ' + "9" * 5000 + ', "name": "x"}]}', "cannot be parsed"),
        (b"\xff\xfe{}".decode("latin-1"), "not UTF-8"),
    ],
)
def test_unusable_files_raise_a_data_error_naming_the_file(
    tmp_path: Path, img: Path, text: str, words: str
) -> None:
    path = tmp_path / "instances.json"
    path.write_bytes(text.encode("latin-1") if "ÿ" in text else text.encode())
    with pytest.raises(DataError) as e:
        read_coco(img, path)
    assert words in str(e.value) and str(path) in str(e.value)


def test_over_the_size_cap_is_refused(tmp_path: Path, img: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common_mod, "MAX_JSON_BYTES", 100)
    with pytest.raises(DataError, match="larger than"):
        read_coco(img, _write(tmp_path, GOOD))


def test_wrong_types_everywhere_become_issues(tmp_path: Path, img: Path) -> None:
    doc = {
        "images": [
            "a.jpg",
            {"id": None, "file_name": "a.jpg"},
            {"id": 1, "file_name": 5},
            {"id": 2, "file_name": "a.jpg", "width": "wide", "height": [1]},
            {"id": 3, "file_name": "b.jpg", "width": 100, "height": 80},
            {"id": 3, "file_name": "b.jpg"},  # id again
            {"id": 4, "file_name": "a.jpg"},  # file again
            {"id": 5, "file_name": "gone.jpg"},
        ],
        "annotations": [
            7,
            {"id": 20, "image_id": 2, "category_id": 1, "bbox": "1,2,3,4"},
            {"id": 21, "image_id": 2, "category_id": 99, "bbox": [1, 2, 3, 4]},
            {"id": 22, "image_id": 2, "category_id": [1], "bbox": [1, 2, 3, 4]},
            {"id": 23, "image_id": 42, "category_id": 1, "bbox": [1, 2, 3, 4]},
            {"id": 24, "image_id": 5, "category_id": 1, "bbox": [1, 2, 3, 4]},
            {"id": 25, "image_id": 4, "category_id": 1, "bbox": [1, 2, 3, 4]},
            {"id": 26, "image_id": 2, "category_id": 1, "bbox": [1, 2, 3, 4]},
            {"id": 27, "image_id": 3, "category_id": 1, "bbox": [None, 2, 3, 4]},
        ],
        "categories": [{"id": 1, "name": "x"}, {"id": "weird"}, "y", {"id": 1, "name": "again"}],
    }
    src = read_coco(img, _write(tmp_path, doc))
    assert [(s.rel, s.boxes) for s in src.samples] == [("a.jpg", [(1, 2, 4, 6)]), ("b.jpg", [])]
    assert src.classes == ["x"]
    got = sorted(reasons(src))
    assert got == sorted(
        ["malformed_annotation"] * 3  # categories
        + ["malformed_annotation"] * 3  # images
        + ["duplicate_image", "duplicate_image", "missing_image"]  # id 3 again, a.jpg again, gone.jpg
        + ["malformed_annotation", "malformed_annotation", "unknown_class", "unknown_class"]  # 7, 20, 21, 22
        + ["missing_image"]  # image_id 42
        + ["malformed_annotation"]  # 27
    )
    gone = next(i for i in src.issues if i.reason == IssueReason.MISSING_IMAGE and "gone" in i.message)
    assert "1 annotation(s)" in gone.message
    # "image_id 42", not "42" alone: the other issue's message names a tmp path (pytest-423/...)
    lost = next(i for i in src.issues if i.reason == IssueReason.MISSING_IMAGE and "image_id 42" in i.message)
    assert lost.annotation == "id 23"


def test_two_category_ids_with_one_name_share_a_class(tmp_path: Path, img: Path) -> None:
    doc = {
        "images": [{"id": 1, "file_name": "a.jpg"}],
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, 5, 5]},
            {"id": 2, "image_id": 1, "category_id": 2, "bbox": [1, 1, 5, 5]},  # same box, same class
        ],
        "categories": [{"id": 1, "name": "x"}, {"id": 2, "name": "x"}],
    }
    src = read_coco(img, _write(tmp_path, doc))
    assert src.classes == ["x"] and src.samples[0].labels == [0] and reasons(src) == ["duplicate_box"]


def test_file_without_annotations_is_all_background(tmp_path: Path, img: Path) -> None:
    doc = {k: v for k, v in GOOD.items() if k != "annotations"}
    src = read_coco(img, _write(tmp_path, doc))
    assert [s.background for s in src.samples] == [True, True]
    assert any("no `annotations`" in w for w in src.warnings)


def test_unreadable_image_is_an_issue(tmp_path: Path, img: Path) -> None:
    (img / "a.jpg").write_bytes(b"\xff\xd8\xff garbage")
    src = read_coco(img, _write(tmp_path, GOOD))
    assert [s.rel for s in src.samples] == ["b.jpg"]
    assert reasons(src) == ["unreadable_image"] and "2 annotation(s)" in src.issues[0].message
