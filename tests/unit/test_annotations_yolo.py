"""YOLO reader on hostile files: wrong column counts, non-numbers, unknown class ids, orphans,
paths leading outside, broken data.yaml."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_annotations_common import make_image, reasons

from visionloop.core.errors import DataError
from visionloop.tasks.detection.annotations import IssueReason, read_detection_source, read_yolo


def _dataset(
    root: Path, yaml_text: str = "path: .\ntrain: images/train\nval: images/val\nnames: [cat, dog]\n"
) -> Path:
    make_image(root / "images" / "train" / "a.jpg", 200, 100)
    make_image(root / "images" / "train" / "b.png", 200, 100, fmt="PNG")
    make_image(root / "images" / "val" / "c.jpg", 200, 100)
    (root / "labels" / "train").mkdir(parents=True)
    (root / "labels" / "val").mkdir(parents=True)
    (root / "data.yaml").write_text(yaml_text)
    return root / "data.yaml"


def test_reads_boxes_segments_splits_and_background(tmp_path: Path) -> None:
    data = _dataset(tmp_path)
    (tmp_path / "labels" / "train" / "a.txt").write_text(
        "0 0.5 0.5 0.2 0.4\n\n1 0.1 0.1 0.3 0.1 0.2 0.3\n1 0.6 0.2 0.9 0.2 0.9 0.4 0.6 0.4\n"
    )
    (tmp_path / "labels" / "val" / "c.txt").write_text("")
    src = read_yolo(data)
    a, b, c = src.samples
    assert [(s.rel, s.split) for s in src.samples] == [
        ("images/train/a.jpg", "train"),
        ("images/train/b.png", "train"),
        ("images/val/c.jpg", "val"),
    ]
    assert a.labels == [0, 1, 1]
    expected = [(80, 30, 120, 70), (20, 10, 60, 30), (120, 20, 180, 40)]
    assert all(
        abs(x - y) < 1e-9
        for got, want in zip(a.boxes, expected, strict=True)
        for x, y in zip(got, want, strict=True)
    )
    assert b.background and c.background and src.issues == []
    assert src.counts().background_images == 2


def test_hostile_label_lines_are_issues_with_file_and_line(tmp_path: Path) -> None:
    data = _dataset(tmp_path)
    (tmp_path / "labels" / "train" / "a.txt").write_text(
        "0 0.5 0.5 0.2\n"  # 1: four columns
        "0 0.5 0.5 0.2 0.2 0.9\n"  # 2: six columns
        "0 0.5 0.5 0.2 0.2 0.9 0.1 0.1\n"  # 3: eight columns
        "cat 0.5 0.5 0.2 0.2\n"  # 4: class not a number
        "0 0.5 half 0.2 0.2\n"  # 5: value not a number
        "1.5 0.5 0.5 0.2 0.2\n"  # 6: fractional class
        "2 0.5 0.5 0.2 0.2\n"  # 7: class id past names
        "-1 0.5 0.5 0.2 0.2\n"  # 8: negative class id
        "0 nan 0.5 0.2 0.2\n"  # 9: NaN
        "0 0.5 0.5 -0.2 0.2\n"  # 10: inverted
        "0 0.5 0.5 0 0.2\n"  # 11: zero area
        "0 1.5 1.5 0.2 0.2\n"  # 12: outside
        "0 0.95 0.5 0.2 0.2\n"  # 13: clipped
        "0 0.95 0.5 0.2 0.2\n"  # 14: duplicate
        "1.0 0.5 0.5 0.2 0.2\n"  # 15: class 1.0 is class 1
        "0 0.1 0.1 0.2 inf 0.3 0.3\n"  # 16: polygon with inf
    )
    src = read_yolo(data)
    by_line = {i.line: i.reason for i in src.issues}
    assert by_line == {
        1: IssueReason.MALFORMED_ANNOTATION,
        2: IssueReason.MALFORMED_ANNOTATION,
        3: IssueReason.MALFORMED_ANNOTATION,
        4: IssueReason.MALFORMED_ANNOTATION,
        5: IssueReason.MALFORMED_ANNOTATION,
        6: IssueReason.MALFORMED_ANNOTATION,
        7: IssueReason.UNKNOWN_CLASS,
        8: IssueReason.UNKNOWN_CLASS,
        9: IssueReason.BOX_NOT_FINITE,
        10: IssueReason.BOX_INVERTED,
        11: IssueReason.BOX_ZERO_AREA,
        12: IssueReason.BOX_OUTSIDE_IMAGE,
        13: IssueReason.BOX_CLIPPED,
        14: IssueReason.DUPLICATE_BOX,
        16: IssueReason.BOX_NOT_FINITE,
    }
    first = src.issues[0]
    assert first.file == "labels/train/a.txt" and "labels/train/a.txt:1" in first.message
    assert "4 column(s)" in first.message
    a = src.samples[0]
    assert a.labels == [0, 1] and a.boxes[0] == pytest.approx((170, 40, 200, 60))


def test_orphan_label_and_unreadable_label_file(tmp_path: Path) -> None:
    data = _dataset(tmp_path)
    (tmp_path / "labels" / "train" / "ghost.txt").write_text("0 0.5 0.5 0.2 0.2\n")
    (tmp_path / "labels" / "train" / "classes.txt").write_text("cat\ndog\n")
    (tmp_path / "labels" / "train" / "a.txt").write_bytes(b"0 0.5 \xff\xfe 0.2 0.2\n")
    src = read_yolo(data)
    assert [s.rel for s in src.samples] == ["images/train/b.png", "images/val/c.jpg"]
    assert sorted(reasons(src)) == ["missing_image", "unreadable_annotation_file"]
    assert (
        next(i for i in src.issues if i.reason == IssueReason.MISSING_IMAGE).file == "labels/train/ghost.txt"
    )


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("names: [cat\n", "not valid YAML"),
        ("- a\n- b\n", "not a mapping"),
        ("train: images/train\n", "`names` is missing"),
        ("names: 5\n", "`names` is int"),
        ("names: []\n", "names no classes"),
        ("names: [cat, cat]\n", "twice"),
        ("names: {zero: cat}\n", "ids must be integers"),
        ("names: [cat]\ntrain: 5\n", "must be a path"),
        ("names: !!python/object/apply:os.system ['echo hi']\n", "not valid YAML"),
        (
            'a: &a ["x","x","x","x","x","x","x","x","x"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n'
            "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
            "names: [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n",
            "alias",
        ),  # a YAML alias bomb: aliases are refused, never expanded
    ],
)
def test_broken_data_yaml_is_a_data_error(tmp_path: Path, text: str, words: str) -> None:
    data = _dataset(tmp_path, text)
    with pytest.raises(DataError, match=words):
        read_yolo(data)


def test_names_as_dict_with_gaps_and_nc_mismatch(tmp_path: Path) -> None:
    data = _dataset(tmp_path, "train: images/train\nnc: 5\nnames: {0: cat, 3: dog}\n")
    (tmp_path / "labels" / "train" / "a.txt").write_text("3 0.5 0.5 0.2 0.2\n1 0.5 0.5 0.2 0.2\n")
    src = read_yolo(data)
    assert src.classes == ["cat", "dog"] and src.samples[0].labels == [1]
    assert reasons(src) == ["unknown_class"] and any("nc: 5" in w for w in src.warnings)


def test_split_entries_stay_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "set"
    _dataset(root)
    make_image(tmp_path / "outside" / "x.jpg", 10, 10)
    (root / "lists").mkdir()
    (root / "lists" / "val.txt").write_text(
        "../images/val/c.jpg\n../../outside/x.jpg\n" + str(tmp_path / "outside" / "x.jpg") + "\nmissing.jpg\n"
    )
    (root / "data.yaml").write_text(
        f"path: {tmp_path / 'elsewhere'}\ntrain: ../images/train\nval: lists/val.txt\n"
        "test: ../outside\nnames: [cat]\n"
    )
    src = read_yolo(root / "data.yaml")
    assert [(s.rel, s.split) for s in src.samples] == [
        ("images/train/a.jpg", "train"),  # `../images/train` retried as `images/train`, as Ultralytics
        ("images/train/b.png", "train"),
        ("images/val/c.jpg", "val"),
    ]
    assert sorted(reasons(src)) == sorted(
        ["path_outside_source", "path_outside_source", "missing_image", "path_outside_source"]
    )
    assert any("elsewhere" in w for w in src.warnings)


def test_image_folder_linked_from_outside_is_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "set"
    data = _dataset(root)
    make_image(tmp_path / "outside" / "x.jpg", 10, 10)
    (root / "images" / "train" / "more").symlink_to(tmp_path / "outside")
    src = read_yolo(data)
    assert "images/train/more/x.jpg" not in [s.rel for s in src.samples]
    assert reasons(src) == ["link_outside_source"]


def test_no_split_keys_reads_images_folder_with_split_from_subfolder(tmp_path: Path) -> None:
    make_image(tmp_path / "images" / "valid" / "a.jpg", 20, 20)
    make_image(tmp_path / "images" / "misc" / "b.jpg", 20, 20)
    (tmp_path / "data.yaml").write_text("names: [x]\n")
    src = read_detection_source(tmp_path)
    assert src.format == "yolo" and [(s.rel, s.split) for s in src.samples] == [
        ("images/misc/b.jpg", None),
        ("images/valid/a.jpg", "val"),
    ]


def test_image_listed_in_two_splits_is_kept_once(tmp_path: Path) -> None:
    data = _dataset(tmp_path, "train: images\nval: images/val\nnames: [cat]\n")
    src = read_yolo(data)
    assert [(s.rel, s.split) for s in src.samples if "val" in s.rel] == [("images/val/c.jpg", "train")]
    assert reasons(src) == ["duplicate_image"]


def test_pose_lines_keep_their_box(tmp_path: Path) -> None:
    data = _dataset(tmp_path, "train: images/train\nkpt_shape: [2, 3]\nnames: [person]\n")
    (tmp_path / "labels" / "train" / "a.txt").write_text("0 0.5 0.5 0.2 0.2 0.4 0.4 2 0.6 0.6 2\n")
    src = read_yolo(data)
    assert src.samples[0].boxes == [pytest.approx((80, 40, 120, 60))] and src.issues == []
