"""Pascal VOC reader: defusedxml refuses entity bombs and external entities; hostile XML is an
issue per file, never a crash."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_annotations_common import make_image, reasons

from visionloop.core.errors import DataError
from visionloop.tasks.detection.annotations import IssueReason, read_voc


def _xml(
    filename: str, objects: str, size: str = "<size><width>100</width><height>80</height></size>"
) -> str:
    return f"<annotation><filename>{filename}</filename>{size}{objects}</annotation>"


def _obj(name: str, box: tuple[object, ...], difficult: int = 0) -> str:
    x1, y1, x2, y2 = box
    return (
        f"<object><name>{name}</name><difficult>{difficult}</difficult><bndbox><xmin>{x1}</xmin>"
        f"<ymin>{y1}</ymin><xmax>{x2}</xmax><ymax>{y2}</ymax></bndbox></object>"
    )


@pytest.fixture
def voc(tmp_path: Path) -> Path:
    for name in ("a", "b", "c", "d"):
        make_image(tmp_path / "JPEGImages" / f"{name}.jpg", 100, 80)
    (tmp_path / "Annotations").mkdir()
    return tmp_path


def test_reads_objects_difficult_splits_and_background(voc: Path) -> None:
    (voc / "Annotations" / "a.xml").write_text(
        _xml("a.jpg", _obj("dog", (1, 1, 100, 80)) + _obj(" cat ", (11, 21, 30, 40), difficult=1))
    )
    (voc / "Annotations" / "b.xml").write_text(_xml("b.jpg", ""))
    (voc / "ImageSets" / "Main").mkdir(parents=True)
    (voc / "ImageSets" / "Main" / "train.txt").write_text("a\n")
    (voc / "ImageSets" / "Main" / "val.txt").write_text("b\na\n")
    src = read_voc(voc)
    assert src.classes == ["cat", "dog"]
    a, b = src.samples
    assert (
        a.boxes == [(0, 0, 100, 80), (10, 20, 30, 40)] and a.labels == [1, 0] and a.difficult == [False, True]
    )
    assert (a.split, b.split, b.background) == ("train", "val", True)
    assert reasons(src) == ["duplicate_image"]  # `a` listed in val too: stays in train
    assert any("2 image(s) in JPEGImages/ have no XML" in w for w in src.warnings)


BOMB = """<?xml version="1.0"?>
<!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol1 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
<!ENTITY lol2 "&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;">
<!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">]>
<annotation><filename>b.jpg</filename><object><name>&lol3;</name></object></annotation>"""

EXTERNAL = """<?xml version="1.0"?>
<!DOCTYPE a [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>
<annotation><filename>c.jpg</filename><object><name>&xxe;</name>
<bndbox><xmin>1</xmin><ymin>1</ymin><xmax>5</xmax><ymax>5</ymax></bndbox></object></annotation>"""

DTD_ONLY = """<?xml version="1.0"?><!DOCTYPE annotation SYSTEM "http://example.invalid/voc.dtd">
<annotation><filename>d.jpg</filename></annotation>"""


def test_entity_bomb_external_entity_and_dtd_are_refused(voc: Path) -> None:
    (voc / "Annotations" / "a.xml").write_text(_xml("a.jpg", _obj("dog", (1, 1, 9, 9))))
    (voc / "Annotations" / "b.xml").write_text(BOMB)
    (voc / "Annotations" / "c.xml").write_text(EXTERNAL)
    (voc / "Annotations" / "d.xml").write_text(DTD_ONLY)
    src = read_voc(voc)
    assert [s.rel for s in src.samples] == ["JPEGImages/a.jpg"] and src.classes == ["dog"]
    assert reasons(src) == ["unsafe_xml"] * 3
    assert {i.file for i in src.issues} == {"Annotations/b.xml", "Annotations/c.xml", "Annotations/d.xml"}
    assert all("root:" not in i.message for i in src.issues)  # nothing of /etc/passwd leaked


def test_hostile_xml_is_an_issue_per_file_or_object(voc: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ann = voc / "Annotations"
    (ann / "a.xml").write_text(
        _xml(
            "a.jpg",
            _obj("dog", ("x", 1, 9, 9))  # object 1: not a number
            + "<object><name>dog</name></object>"  # 2: no bndbox
            + _obj("", (1, 1, 9, 9))  # 3: no name
            + _obj("dog", (50, 50, 10, 10))  # 4: inverted
            + _obj("dog", (1, 1, 200, 9))  # 5: clipped
            + _obj("dog", ("nan", 1, 9, 9)),  # 6: NaN
        )
    )
    (ann / "b.xml").write_text("<annotation><filename>b.jpg</filename><object>")  # truncated
    (ann / "c.xml").write_text(_xml("../../etc/passwd", _obj("dog", (1, 1, 9, 9))))
    (ann / "d.xml").write_text("<notvoc/>")
    (ann / "e.xml").write_text(_xml("gone.jpg", _obj("dog", (1, 1, 9, 9))))
    (ann / "f.xml").write_bytes(b"\x00\xff garbage")
    src = read_voc(voc)
    by_ann = {(i.file, i.annotation): i.reason for i in src.issues}
    assert by_ann == {
        ("Annotations/a.xml", "object 1"): IssueReason.MALFORMED_ANNOTATION,
        ("Annotations/a.xml", "object 2"): IssueReason.MALFORMED_ANNOTATION,
        ("Annotations/a.xml", "object 3"): IssueReason.MALFORMED_ANNOTATION,
        ("Annotations/a.xml", "object 4"): IssueReason.BOX_INVERTED,
        ("Annotations/a.xml", "object 5"): IssueReason.BOX_CLIPPED,
        ("Annotations/a.xml", "object 6"): IssueReason.BOX_NOT_FINITE,
        ("Annotations/b.xml", None): IssueReason.UNREADABLE_ANNOTATION_FILE,
        ("Annotations/c.xml", None): IssueReason.PATH_OUTSIDE_SOURCE,
        ("Annotations/d.xml", None): IssueReason.UNREADABLE_ANNOTATION_FILE,
        ("Annotations/e.xml", None): IssueReason.MISSING_IMAGE,
        ("Annotations/f.xml", None): IssueReason.UNREADABLE_ANNOTATION_FILE,
    }
    assert src.samples[0].boxes == [(0, 0, 100, 9)]


def test_given_classes_make_other_names_unknown_and_size_cap(
    voc: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (voc / "Annotations" / "a.xml").write_text(
        _xml("a.jpg", _obj("dog", (1, 1, 9, 9)) + _obj("cow", (1, 1, 9, 9)))
    )
    (voc / "Annotations" / "b.xml").write_text(_xml("b.jpg", "" + " " * 5000))
    from visionloop.tasks.detection.annotations import voc as voc_mod

    monkeypatch.setattr(voc_mod, "MAX_XML_BYTES", 4000)
    src = read_voc(voc, classes=["dog"])
    assert src.samples[0].labels == [0]
    assert sorted(reasons(src)) == ["unknown_class", "unreadable_annotation_file"]


def test_missing_filename_uses_the_xml_stem_and_layout_errors(voc: Path, tmp_path: Path) -> None:
    (voc / "Annotations" / "c.xml").write_text("<annotation>" + _obj("dog", (1, 1, 9, 9)) + "</annotation>")
    src = read_voc(voc)
    assert [s.rel for s in src.samples] == ["JPEGImages/c.jpg"]
    with pytest.raises(DataError, match="Annotations/"):
        read_voc(tmp_path / "JPEGImages")
    (voc / "Annotations" / "c.xml").write_text("<annotation><filename>c.jpg</filename></annotation>")
    with pytest.raises(DataError, match="no classes"):
        read_voc(voc)
