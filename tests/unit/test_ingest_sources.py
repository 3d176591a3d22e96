"""Listing sources: what counts as an image, where labels and splits come from, and the errors
a user sees for every layout visionloop cannot use."""

from __future__ import annotations

from pathlib import Path

import pytest

from _imgfactory import write
from visionloop.core.errors import DataError
from visionloop.data.sources import list_source

IMG = b"not decoded while listing"


def make(root: Path, *rels: str) -> None:
    for rel in rels:
        write(root / rel, IMG)


def test_imagefolder_lists_sorted_paths_with_sorted_class_labels(tmp_path: Path) -> None:
    make(tmp_path, "dog/b.jpg", "cat/z.PNG", "cat/a.jpeg", "cat/sub/deep.webp", "ant/x.bmp")
    make(tmp_path, "cat/notes.txt", "README.md", ".DS_Store", "cat/.hidden.jpg", ".git/x.png", "dog/._b.jpg")
    listing = list_source(tmp_path)
    assert listing.kind == "imagefolder" and not listing.split_from_source
    assert listing.classes == ["ant", "cat", "dog"]
    assert [c.rel for c in listing.candidates] == [
        "ant/x.bmp",
        "cat/a.jpeg",
        "cat/sub/deep.webp",  # nested folders belong to their class
        "cat/z.PNG",
        "dog/b.jpg",
    ]
    assert [c.label for c in listing.candidates] == [0, 1, 1, 1, 2]
    assert all(c.split is None for c in listing.candidates)
    assert listing.candidates[0].path == str(tmp_path / "ant/x.bmp")
    # notes.txt and README.md are skipped; hidden files are not even counted.
    assert listing.skipped == 2
    assert listing.files_seen == 7


def test_imagefolder_with_split_folders_takes_the_split_from_the_source(tmp_path: Path) -> None:
    make(tmp_path, "train/cat/1.jpg", "train/dog/2.jpg", "train/dog/3.jpg", "val/cat/4.jpg", "test/dog/5.jpg")
    listing = list_source(tmp_path)
    assert listing.split_from_source
    assert listing.classes == ["cat", "dog"]
    got = [(c.rel, listing.classes[c.label], c.split) for c in listing.candidates]
    assert got == [
        ("test/dog/5.jpg", "dog", "test"),
        ("train/cat/1.jpg", "cat", "train"),
        ("train/dog/2.jpg", "dog", "train"),
        ("train/dog/3.jpg", "dog", "train"),
        ("val/cat/4.jpg", "cat", "val"),
    ]
    assert any("val/ has no images of class(es): dog" in w for w in listing.warnings)


def test_empty_class_folders_are_not_classes(tmp_path: Path) -> None:
    make(tmp_path, "cat/1.jpg", "empty/readme.txt")
    (tmp_path / "nothing").mkdir()
    listing = list_source(tmp_path)
    assert listing.classes == ["cat"]
    assert any("empty" in w and "nothing" in w for w in listing.warnings)


def test_csv_without_split_column(tmp_path: Path) -> None:
    make(tmp_path, "img/a.jpg", "img/b.png")
    absolute = tmp_path / "elsewhere" / "c.jpg"
    write(absolute, IMG)
    csv = tmp_path / "labels.csv"
    csv.write_text(
        f"\ufeffPath, Label\nimg/b.png,dog\nimg/a.jpg, cat \n\n{absolute},dog\nimg/readme.txt,cat\n"
    )
    listing = list_source(csv)
    assert listing.kind == "csv" and not listing.split_from_source
    assert listing.root == csv
    assert listing.classes == ["cat", "dog"]
    got = [(c.rel, c.path, listing.classes[c.label]) for c in listing.candidates]
    assert got == sorted(
        [
            ("img/a.jpg", str(tmp_path / "img/a.jpg"), "cat"),
            ("img/b.png", str(tmp_path / "img/b.png"), "dog"),
            (absolute.as_posix(), str(absolute), "dog"),
        ]
    )
    assert listing.skipped == 1


def test_csv_with_split_column(tmp_path: Path) -> None:
    csv = write(tmp_path / "m.csv", b"path,label,split\na.jpg,cat,train\nb.jpg,cat,VAL\nc.jpg,dog,test\n")
    listing = list_source(csv)
    assert listing.split_from_source
    assert [(c.rel, c.split) for c in listing.candidates] == [
        ("a.jpg", "train"),
        ("b.jpg", "val"),
        ("c.jpg", "test"),
    ]


# -- errors: each names the problem and the fix --------------------------------------------------


def error(source: Path) -> str:
    with pytest.raises(DataError) as e:
        list_source(source)
    return str(e.value)


def test_missing_source(tmp_path: Path) -> None:
    msg = error(tmp_path / "nope")
    assert "does not exist" in msg and "SOURCE/cat/001.jpg" in msg


def test_empty_source(tmp_path: Path) -> None:
    make(tmp_path, "cat/notes.txt")
    msg = error(tmp_path)
    assert "found no image files" in msg and "1 other file(s) skipped" in msg and "SOURCE/cat/001.jpg" in msg


def test_images_at_the_top_level(tmp_path: Path) -> None:
    make(tmp_path, "a.jpg", "b.jpg", "cat/c.jpg")
    msg = error(tmp_path)
    assert "2 image(s) directly inside it (a.jpg, b.jpg)" in msg
    assert f"{tmp_path}/cat/a.jpg" in msg  # the fix, spelled out


def test_images_directly_inside_a_split_folder(tmp_path: Path) -> None:
    make(tmp_path, "train/a.jpg", "train/cat/c.jpg")
    assert "the split folder train/" in error(tmp_path)


def test_split_folders_mixed_with_class_folders(tmp_path: Path) -> None:
    make(tmp_path, "train/cat/1.jpg", "dog/2.jpg")
    msg = error(tmp_path)
    assert "mixes split folders (train) with class folders (dog)" in msg
    assert "SOURCE/train/cat/001.jpg" in msg


def test_source_file_that_is_not_a_csv(tmp_path: Path) -> None:
    assert "not a .csv" in error(write(tmp_path / "labels.json", b"{}"))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "the file is empty"),
        ("file,label\na.jpg,cat\n", "missing column(s) path; unknown column(s) 'file'"),
        ("path\na.jpg\n", "missing column(s) label"),
        ("path,label,splt\na.jpg,cat,train\n", "unknown column(s) 'splt'"),
        ("path,label,label\na.jpg,cat,cat\n", "a column is named twice"),
        ("path,label\na.jpg\n", "line 2 has 1 field(s), but the header has 2"),
        ("path,label\na.jpg,\n", "line 2 (a.jpg) has an empty label"),
        ("path,label\n,cat\n", "line 2 has an empty path"),
        (
            "path,label,split\na.jpg,cat,train\nb.jpg,cat,validation\n",
            "line 3 (b.jpg) has split 'validation'",
        ),
        ("path,label\nnotes.txt,cat\n", "lists no image files"),
    ],
)
def test_bad_csv(tmp_path: Path, text: str, expected: str) -> None:
    msg = error(write(tmp_path / "bad.csv", text.encode()))
    assert expected in msg
    assert "path,label,split" in msg  # every CSV error shows a valid example


def test_csv_that_is_not_utf8(tmp_path: Path) -> None:
    assert "save it as UTF-8" in error(write(tmp_path / "x.csv", b"path,label\n\xff\xfe.jpg,cat\n"))
