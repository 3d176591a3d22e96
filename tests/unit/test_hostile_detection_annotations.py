"""Detection annotation readers and detection ingest against files written to hurt them: links
out of the source, lone surrogates, terminal escapes in class names, malformed URLs, results
built so that reading them is quadratic or copies one huge value into every message."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from test_annotations_common import make_image, reasons

from visionloop.core.errors import DataError
from visionloop.data.ingest import IngestOptions
from visionloop.data.manifest import REJECTED_NAME, read_manifest
from visionloop.tasks.detection.annotations import (
    IssueReason,
    read_coco,
    read_label_studio,
    read_voc,
    read_yolo,
)
from visionloop.tasks.detection.annotations import label_studio as ls_mod
from visionloop.tasks.detection.annotations.common import MAX_CLASS_NAME_CHARS, MAX_ID_CHARS
from visionloop.tasks.detection.ingest import ingest_detection

SECRET = "root:x:0:0:SECRET-FROM-OUTSIDE"

# ---------------------------------------------------------------------------------------------
# Label Studio


def _rect(label: object = "cat", **extra: object) -> dict[str, object]:
    value = {"x": 10, "y": 10, "width": 20, "height": 20, "rotation": 0, "rectanglelabels": [label]}
    return {"type": "rectanglelabels", "value": value, **extra}


def _ls(tmp_path: Path, tasks: Sequence[object]) -> Path:
    make_image(tmp_path / "a.jpg", 100, 80)
    make_image(tmp_path / "b.jpg", 100, 80)
    path = tmp_path / "export.json"
    path.write_text(json.dumps(tasks))
    return path


class _CountingDict(dict):  # type: ignore[type-arg]
    """A result whose every comparison with another is counted."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _CountingDict.compared += 1
        return dict.__eq__(self, other)

    __hash__ = None


def test_label_studio_results_are_counted_without_comparing_them_to_each_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each result used to be searched for in the list of rectangles (`r not in rects`): n**2/2
    # whole-dict comparisons, hours for a million boxes on one image.
    results = [_CountingDict(_rect(id=f"r{i}")) for i in range(200)]
    results.append(_CountingDict({"type": "polygonlabels"}))
    tasks = [{"id": 1, "data": {"image": "a.jpg"}, "annotations": [{"result": results}]}]
    path = _ls(tmp_path, tasks)
    monkeypatch.setattr(ls_mod, "load_json", lambda p, what: tasks)  # the parsed file, counting
    _CountingDict.compared = 0
    src = read_label_studio(path, tmp_path)
    assert _CountingDict.compared == 0
    assert len(src.samples) == 1 and len(src.samples[0].boxes) == 1  # the 200 boxes are one box
    assert reasons(src) == ["duplicate_box"] * 199
    assert "result(s) other than rectanglelabels ignored: 1 polygonlabels" in src.warnings


def test_label_studio_huge_result_id_is_not_copied_into_every_issue(tmp_path: Path) -> None:
    huge = "X" * 1_000_000
    labels = [7] * 50  # 50 bad labels on one result: 50 issues naming it
    rect = _rect(id=huge)
    rect["value"]["rectanglelabels"] = labels  # type: ignore[index]
    path = _ls(tmp_path, [{"id": 1, "data": {"image": "a.jpg"}, "annotations": [{"result": [rect]}]}])
    src = read_label_studio(path, tmp_path, classes=["cat"])
    assert reasons(src) == ["malformed_annotation"] * 50
    for issue in src.issues:
        assert issue.message.startswith("export.json annotation task 1 result 'XXXX")
        assert issue.message.endswith("X... (image a.jpg): label 7 is not a name")
        assert len(issue.message) < 2 * MAX_ID_CHARS + 100
        assert issue.annotation is not None and len(issue.annotation) < MAX_ID_CHARS + 40


def test_label_studio_ignored_result_types_are_listed_up_to_ten(tmp_path: Path) -> None:
    results: list[object] = [_rect()]
    results += [{"type": f"t{i:02d}"} for i in range(30)] + [{"type": "t00"}, {"type": "\x1b[2J" + "y" * 500}]
    path = _ls(tmp_path, [{"id": 1, "data": {"image": "a.jpg"}, "annotations": [{"result": results}]}])
    src = read_label_studio(path, tmp_path)
    (warning,) = [w for w in src.warnings if "other than rectanglelabels" in w]
    assert warning.startswith("result(s) other than rectanglelabels ignored: ")
    assert warning.endswith(" and 21 result(s) of 21 other type(s)")
    assert "2 t00" in warning and "\x1b" not in warning and "y" * 300 not in warning
    assert len(warning) < 1000


def test_label_studio_unparsable_image_url_is_an_issue_of_its_task(tmp_path: Path) -> None:
    # urlsplit raises ValueError on `http://[x/...` (an IPv6 bracket never closed) and on a host
    # that NFKC normalisation changes: it used to end the whole read with a traceback.
    tasks = [
        {"id": 1, "data": {"image": "http://[x/a.jpg"}, "annotations": [{"result": [_rect()]}]},
        {"id": 2, "data": {"image": "http://a\uff03b/a.jpg"}, "annotations": [{"result": [_rect()]}]},
        {"id": 3, "data": {"image": "/data/upload/1/b.jpg"}, "annotations": [{"result": [_rect()]}]},
    ]
    src = read_label_studio(_ls(tmp_path, tasks), tmp_path)
    assert [s.rel for s in src.samples] == ["b.jpg"]
    assert reasons(src) == ["malformed_annotation", "malformed_annotation"]
    first, second = src.issues
    assert first.message == (
        "export.json annotation task 1: image 'http://[x/a.jpg' is not a URL or path that can be read "
        "(Invalid IPv6 URL); its 1 box(es) are left out; fix it in Label Studio"
    )
    assert "invalid characters under NFKC normalization" in second.message


def test_label_studio_label_with_control_characters_is_left_out_alone(tmp_path: Path) -> None:
    tasks = [
        {
            "id": 1,
            "data": {"image": "a.jpg"},
            "annotations": [{"result": [_rect("\x1b]0;pwned\x07"), _rect()]}],
        }
    ]
    src = read_label_studio(_ls(tmp_path, tasks), tmp_path)
    assert src.classes == ["cat"] and len(src.samples[0].boxes) == 1
    assert reasons(src) == ["malformed_annotation"]
    assert src.issues[0].message.endswith(
        "label '\\x1b]0;pwned\\x07' has control characters or unpaired surrogates"
    )


# ---------------------------------------------------------------------------------------------
# COCO


def _coco(tmp_path: Path, doc: Mapping[str, object]) -> Path:
    make_image(tmp_path / "img" / "a.jpg", 100, 80)
    make_image(tmp_path / "img" / "b.jpg", 100, 80)
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(doc))  # ensure_ascii: a lone surrogate is written as \ud800
    return path


def test_coco_file_name_with_a_lone_surrogate_is_an_issue_not_a_crash(tmp_path: Path) -> None:
    # `"\ud800"` is valid JSON; realpath raised UnicodeEncodeError on it and ended the read.
    doc = {
        "images": [{"id": 1, "file_name": "\ud800.jpg"}, {"id": 2, "file_name": "b.jpg"}],
        "annotations": [{"id": 5, "image_id": 1, "category_id": 1, "bbox": [1, 1, 5, 5]}],
        "categories": [{"id": 1, "name": "cat"}],
    }
    src = read_coco(tmp_path / "img", _coco(tmp_path, doc))
    assert [s.rel for s in src.samples] == ["b.jpg"]
    assert reasons(src) == ["malformed_annotation"]
    assert src.issues[0].message == (
        "instances.json annotation image id 1: image path '\\ud800.jpg' is empty or invalid; "
        "its 1 annotation(s) are left out"
    )


@pytest.mark.parametrize(
    ("name", "shown", "problem"),
    [
        ("\ud800", "'\\ud800'", "has control characters or unpaired surrogates"),
        ("red\x1b[2J\ncar", "'red\\x1b[2J\\ncar'", "has control characters or unpaired surrogates"),
        ("n" * (MAX_CLASS_NAME_CHARS + 1), "'nnnn", f"is longer than {MAX_CLASS_NAME_CHARS} characters"),
    ],
)
def test_coco_category_with_an_unusable_name_is_left_out_with_its_boxes(
    tmp_path: Path, name: str, shown: str, problem: str
) -> None:
    doc = {
        "images": [{"id": 1, "file_name": "a.jpg"}],
        "annotations": [
            {"id": 5, "image_id": 1, "category_id": 1, "bbox": [1, 1, 5, 5]},
            {"id": 6, "image_id": 1, "category_id": 2, "bbox": [1, 1, 5, 5]},
        ],
        "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": name}],
    }
    src = read_coco(tmp_path / "img", _coco(tmp_path, doc))
    assert src.classes == ["cat"] and src.samples[0].labels == [0]
    assert reasons(src) == ["malformed_annotation", "unknown_class"]
    assert src.issues[0].message.startswith(
        f"instances.json annotation categories[1]: category 2's name {shown}"
    )
    assert src.issues[0].message.endswith(f"{problem}; rename it")


def test_ingest_of_a_coco_class_name_with_a_surrogate_completes_and_records_it(tmp_path: Path) -> None:
    # Before: every image was decoded and written, then the manifest could not be encoded as
    # UTF-8 and ingest ended with a PydanticSerializationError.
    root = tmp_path / "src"
    images = []
    for i in range(6):
        make_image(root / "images" / f"{i}.jpg", 60, 40 + i)  # distinct bytes: no duplicates
        images.append({"id": i + 1, "file_name": f"{i}.jpg"})
    doc = {
        "images": images,
        "annotations": [
            {"id": 1, "image_id": 1, "category_id": 1, "bbox": [1, 1, 20, 20]},
            {"id": 2, "image_id": 2, "category_id": 2, "bbox": [1, 1, 20, 20]},
        ],
        "categories": [{"id": 1, "name": "cat"}, {"id": 2, "name": "\udcff\ud800"}],
    }
    (root / "instances.json").write_text(json.dumps(doc))
    report = ingest_detection(root, tmp_path / "ds", IngestOptions(workers=1))
    assert read_manifest(tmp_path / "ds").classes == ["cat"]
    assert report.rejected_by_reason == {"malformed_annotation": 1, "unknown_class": 1}
    rows = [json.loads(line) for line in (tmp_path / "ds" / REJECTED_NAME).read_text().splitlines()]
    assert sorted(r["reason"] for r in rows) == ["malformed_annotation", "unknown_class"]
    (bad,) = [r for r in rows if r["reason"] == "malformed_annotation"]
    assert bad["message"].endswith(
        "category 2's name '\\udcff\\ud800' has control characters or unpaired surrogates; rename it"
    )


# ---------------------------------------------------------------------------------------------
# YOLO


def test_yolo_image_list_linked_outside_the_source_is_not_read(tmp_path: Path) -> None:
    # Its lines used to be quoted into rejected.jsonl, one per line: a list linked to
    # /etc/passwd printed the file.
    (tmp_path / "secret.txt").write_text(SECRET + "\n")
    root = tmp_path / "ds"
    make_image(root / "images" / "a.jpg", 100, 80)
    os.symlink(tmp_path / "secret.txt", root / "list.txt")
    (root / "data.yaml").write_text("train: list.txt\nval: images\nnames: [cat]\n")
    src = read_yolo(root / "data.yaml")
    assert [s.rel for s in src.samples] == ["images/a.jpg"]
    assert reasons(src) == ["link_outside_source"]
    assert src.issues[0].message == (
        f"list.txt: image list list.txt is a symbolic link (or under one) to a file outside the source "
        f"folder {root}; not read, copy the file into the source instead"
    )
    assert all(SECRET not in i.message for i in src.issues)


def test_yolo_class_name_with_control_characters_is_a_data_error(tmp_path: Path) -> None:
    make_image(tmp_path / "images" / "a.jpg", 100, 80)
    (tmp_path / "data.yaml").write_text('names: ["cat", "dog\\e[31m"]\n')
    with pytest.raises(DataError) as e:
        read_yolo(tmp_path / "data.yaml")
    assert str(e.value) == (
        f"{tmp_path / 'data.yaml'}: the class name 'dog\\x1b[31m' has control characters or unpaired "
        "surrogates; rename the class."
    )


def test_ingest_refusing_a_yolo_class_name_writes_nothing(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_image(src / "images" / "a.jpg", 100, 80)
    (src / "data.yaml").write_text("names: [" + "c" * (MAX_CLASS_NAME_CHARS + 1) + "]\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(
        DataError, match=f"is longer than {MAX_CLASS_NAME_CHARS} characters; rename the class"
    ):
        ingest_detection(src, tmp_path / "ds", IngestOptions(workers=1))
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# ---------------------------------------------------------------------------------------------
# VOC

_XML = (
    "<annotation><filename>{file}</filename><object><name>{name}</name><bndbox><xmin>2</xmin>"
    "<ymin>2</ymin><xmax>20</xmax><ymax>20</ymax></bndbox></object></annotation>"
)


def _voc(root: Path) -> Path:
    make_image(root / "JPEGImages" / "a.jpg", 100, 80)
    make_image(root / "JPEGImages" / "b.jpg", 100, 80)
    (root / "Annotations").mkdir(parents=True)
    (root / "Annotations" / "b.xml").write_text(_XML.format(file="b.jpg", name="dog"))
    return root


def test_voc_annotation_and_split_list_linked_outside_are_not_read(tmp_path: Path) -> None:
    root = _voc(tmp_path / "voc")
    (tmp_path / "outside.xml").write_text(_XML.format(file="a.jpg", name="SECRETCLASS"))
    os.symlink(tmp_path / "outside.xml", root / "Annotations" / "a.xml")
    (tmp_path / "secret.txt").write_text(f"{SECRET}\n{SECRET}\n")  # twice: a duplicate-id issue
    (root / "ImageSets" / "Main").mkdir(parents=True)
    os.symlink(tmp_path / "secret.txt", root / "ImageSets" / "Main" / "train.txt")
    src = read_voc(root)
    assert src.classes == ["dog"] and [s.rel for s in src.samples] == ["JPEGImages/b.jpg"]
    assert sorted(reasons(src)) == ["link_outside_source", "link_outside_source"]
    by_file = {i.file: i.message for i in src.issues}
    assert by_file["ImageSets/Main/train.txt"] == (
        "ImageSets/Main/train.txt: split list ImageSets/Main/train.txt is a symbolic link (or under one) "
        f"to a file outside the source folder {root}; not read, copy the file into the source instead"
    )
    assert by_file["Annotations/a.xml"].endswith(
        "not read, copy the file into the source instead; its image is left out"
    )
    assert all(SECRET not in i.message for i in src.issues)


def test_voc_annotations_folder_linked_outside_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "a.xml").write_text(_XML.format(file="a.jpg", name="SECRETCLASS"))
    root = tmp_path / "voc"
    make_image(root / "JPEGImages" / "a.jpg", 100, 80)
    os.symlink(tmp_path / "elsewhere", root / "Annotations")
    with pytest.raises(DataError, match="names no classes"):
        read_voc(root)


def test_voc_object_name_with_control_characters_is_left_out_alone(tmp_path: Path) -> None:
    root = _voc(tmp_path / "voc")
    (root / "Annotations" / "a.xml").write_text(_XML.format(file="a.jpg", name="red\ncar"))
    src = read_voc(root)
    assert src.classes == ["dog"] and [len(s.boxes) for s in src.samples] == [0, 1]
    assert reasons(src) == ["malformed_annotation"]
    assert src.issues[0].message == (
        "Annotations/a.xml annotation object 1 (image JPEGImages/a.jpg): <name> 'red\\ncar' has control "
        "characters or unpaired surrogates"
    )


# ---------------------------------------------------------------------------------------------
# Images that are not files


def test_image_that_is_a_fifo_is_said_to_be_one(tmp_path: Path) -> None:
    make_image(tmp_path / "img" / "b.jpg", 100, 80)
    os.mkfifo(tmp_path / "img" / "a.jpg")
    doc = {
        "images": [{"id": 1, "file_name": "a.jpg"}, {"id": 2, "file_name": "b.jpg"}],
        "categories": [{"id": 1, "name": "cat"}],
    }
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(doc))
    src = read_coco(tmp_path / "img", path)
    assert [s.rel for s in src.samples] == ["b.jpg"]
    assert reasons(src) == [IssueReason.UNREADABLE_IMAGE.value]
    assert src.issues[0].message == (
        "instances.json annotation image id 1: image 'a.jpg' is not a regular file (a folder, FIFO or "
        "device); replace it with the image file"
    )
