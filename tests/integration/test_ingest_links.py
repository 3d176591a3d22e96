"""Symbolic links in a source, ingested for real: a link (to a file or to a folder, at any
level) that leads outside the source folder is not followed but listed in rejected.jsonl
with its reason, so nothing from elsewhere on the machine lands in a dataset; links that stay
inside are followed; `--follow-links` follows them all. Through the library and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _imgfactory import noise, png, write
from _trainkit import cli
from visionloop.core.errors import DataError
from visionloop.data.ingest import IngestOptions, ingest
from visionloop.data.manifest import read_manifest
from visionloop.data.shards import ShardReader

OUTSIDE = "link_outside_source"


def _img(path: Path, seed: int) -> Path:
    return write(path, png(noise(16, 16, seed=seed)))


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """Images outside the source: what a hostile source's links point at."""
    other = tmp_path / "elsewhere"
    _img(other / "secret.png", 900)
    for i in range(3):
        _img(other / "folder" / f"s{i}.png", 910 + i)
    _img(other / "classdir" / "x.png", 920)
    _img(other / "splitdir" / "cat" / "y.png", 930)
    return other


@pytest.fixture
def source(tmp_path: Path, elsewhere: Path) -> Path:
    src = tmp_path / "src"
    for split, n in (("train", 4), ("val", 2)):
        for cls, seed in (("cat", 100), ("dog", 200)):
            for i in range(n):
                _img(src / split / cls / f"good_{i}.png", seed + 10 * (split == "val") + i)
    cat = src / "train" / "cat"
    (cat / "leak.png").symlink_to(elsewhere / "secret.png")  # a file link leading outside
    (cat / "leaks").symlink_to(elsewhere / "folder")  # a folder link leading outside, in a class
    (src / "train" / "bird").symlink_to(elsewhere / "classdir")  # a whole class folder
    (src / "test").symlink_to(elsewhere / "splitdir")  # a whole split folder
    (cat / "dotdot.png").symlink_to(Path("..") / ".." / ".." / "elsewhere" / "secret.png")  # relative
    (cat / "alias.png").symlink_to(cat / "good_0.png")  # inside: followed (a duplicate)
    (cat / "inside").symlink_to(src / "val" / "dog")  # a folder link inside: followed
    (cat / "loop").symlink_to(cat)  # inside, and a loop: walked once
    return src


def _rows(out: Path, name: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


def _stored_bytes(out: Path) -> set[bytes]:
    m = read_manifest(out)
    stored: set[bytes] = set()
    for info in m.splits.values():
        reader = ShardReader(out / info.shard_dir)
        stored.update(reader[i]["image"] for i in range(len(reader)))
    return stored


def test_links_leading_outside_are_skipped_and_listed_with_their_reason(
    source: Path, elsewhere: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ds"
    report = ingest(source, out, IngestOptions(workers=1))
    links = {r["path"]: r for r in _rows(out, "rejected.jsonl") if r["reason"] == OUTSIDE}
    assert set(links) == {
        "train/cat/leak.png",
        "train/cat/leaks",
        "train/bird",
        "test",
        "train/cat/dotdot.png",
    }
    assert links["train/cat/leak.png"]["label"] == "cat" and links["test"]["label"] == ""
    assert "folder outside the source" in str(links["train/cat/leaks"]["message"])
    assert "--follow-links" in str(links["train/bird"]["message"])
    assert all(str(elsewhere) not in str(r["message"]) for r in links.values())  # targets untold
    assert report.rejected_by_reason[OUTSIDE] == 5
    m = report.manifest
    assert m.classes == ["cat", "dog"] and m.splits["test"].count == 0
    assert m.rejected == len(_rows(out, "rejected.jsonl"))
    assert any("symbolic link" in w for w in report.warnings)
    # Not one byte from elsewhere was stored.
    secret = {p.read_bytes() for p in elsewhere.rglob("*.png")}
    assert not secret & _stored_bytes(out)
    # Links inside were followed: the alias is a duplicate of its target, the linked folder's
    # images were listed as cat (duplicates of val/dog's), and the loop ended.
    dups = {str(d["duplicate"]): d for d in _rows(out, "duplicates.jsonl")}
    pairs = {frozenset((str(d["kept"]), dup)) for dup, d in dups.items()}
    assert frozenset(("train/cat/alias.png", "train/cat/good_0.png")) in pairs
    assert any("train/cat/inside/good_0.png" in (d["kept"], dup) for dup, d in dups.items())
    listed = {str(d["kept"]) for d in dups.values()} | set(dups)
    assert not any("/loop/" in p for p in listed)


def test_follow_links_follows_them_all(source: Path, elsewhere: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    report = ingest(source, out, IngestOptions(workers=1, follow_links=True))
    assert OUTSIDE not in report.rejected_by_reason
    m = report.manifest
    assert m.classes == ["bird", "cat", "dog"] and m.splits["test"].count == 1
    secret = {p.read_bytes() for p in elsewhere.rglob("*.png")}
    assert secret <= _stored_bytes(out)


def test_a_source_of_nothing_but_outside_links_says_so(elsewhere: Path, tmp_path: Path) -> None:
    src = tmp_path / "links-only"
    src.mkdir()
    (src / "cat").symlink_to(elsewhere / "folder")
    with pytest.raises(DataError, match=r"1 symbolic link\(s\) leading outside the source not followed"):
        ingest(src, tmp_path / "ds", IngestOptions(workers=1))


def test_csv_rows_that_resolve_outside_the_csvs_folder_are_skipped(elsewhere: Path, tmp_path: Path) -> None:
    src = tmp_path / "csvsrc"
    rows = ["path,label"]
    for i in range(4):
        _img(src / "images" / f"{i}.png", 300 + i)
        rows.append(f"images/{i}.png,{'ab'[i % 2]}")
    (src / "images" / "leak.png").symlink_to(elsewhere / "secret.png")
    (src / "linked").symlink_to(elsewhere / "folder")
    rows += ["images/leak.png,a", "linked/s0.png,b", "../elsewhere/folder/s1.png,b"]
    rows.append(f"{elsewhere / 'folder' / 's2.png'},a")  # absolute: the CSV author's explicit choice
    (src / "list.csv").write_text("\n".join(rows) + "\n")
    out = tmp_path / "ds"
    report = ingest(src / "list.csv", out, IngestOptions(workers=1, val_fraction=0.0))
    skipped = sorted(str(r["path"]) for r in _rows(out, "rejected.jsonl") if r["reason"] == OUTSIDE)
    assert skipped == ["../elsewhere/folder/s1.png", "images/leak.png", "linked/s0.png"]
    assert report.kept == 5  # the four images and the absolute row


def test_the_cli_skips_outside_links_by_default_and_follows_them_with_the_flag(
    source: Path, tmp_path: Path
) -> None:
    plain = cli("data", "ingest", str(source), "--out", str(tmp_path / "plain"), "-j", "1")
    assert plain.returncode == 0, plain.stderr
    assert f"{OUTSIDE} 5" in plain.stdout
    rejected = _rows(tmp_path / "plain", "rejected.jsonl")
    assert {r["path"] for r in rejected if r["reason"] == OUTSIDE} >= {"train/cat/leak.png", "test"}
    followed = cli(
        "data", "ingest", str(source), "--out", str(tmp_path / "followed"), "-j", "1", "--follow-links"
    )
    assert followed.returncode == 0, followed.stderr
    assert OUTSIDE not in followed.stdout
    assert read_manifest(tmp_path / "followed").classes == ["bird", "cat", "dog"]
