"""`visionloop data ingest` and `visionloop data info`, run as a user runs them: a subprocess,
its exit code, and what it prints."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import _warmcli
from _imgfactory import image_folder, noise, png, truncate, write
from visionloop.data.manifest import read_manifest


def vl(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    # A wide terminal, so Rich does not wrap the lines asserted on below.
    return _warmcli.run([*map(str, args)], cwd=cwd, env={**os.environ, "COLUMNS": "200"}, timeout=300)


def assert_clean_error(r: subprocess.CompletedProcess[str], *needles: str, code: int = 1) -> None:
    assert r.returncode == code, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr


def test_ingest_then_info(tmp_path: Path) -> None:
    src = tmp_path / "src"
    image_folder(src, {"cat": 6, "dog": 4})
    write(src / "cat" / "broken.png", truncate(png(noise(32, 32, seed=5))))
    write(src / "dog" / "fake.jpg", b"plain text")
    write(src / "dog" / "same.png", (src / "cat" / "cat_000.png").read_bytes())
    out = tmp_path / "ds"

    # One real run (each loads torch through litdata), with every policy flag set, so the
    # manifest shows they all reached the library.
    r = vl(
        "data", "ingest", src, "--out", out, "--val-fraction", "0.2", "--seed", "3", "-j", "2",
        "--max-side", "10", "--alpha-background", "0,0,0", "--jpeg-quality", "90",
        "--min-side", "2", "--max-pixels", "1000000", "--max-aspect", "50",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    m = read_manifest(out)
    assert f"Ingested 10 images in 2 classes from {src} (imagefolder)" in r.stdout
    assert f"kept        train {m.splits['train'].count} · val {m.splits['val'].count} · test 0" in r.stdout
    assert m.splits["val"].count == 2  # one per class: 6*0.2 and 4*0.2 both round to 1
    assert f"rejected    2 (not_an_image 1, truncated 1) → {out}/rejected.jsonl" in r.stdout
    assert "duplicates  1 byte-identical, 1 with conflicting labels" in r.stdout
    assert f"version     {m.version}" in r.stdout
    assert f"visionloop data info {out}" in r.stdout
    assert f"data: {{dataset: {out}}}" in r.stdout
    assert "decoding images" in r.stderr  # the progress bar

    info = vl("data", "info", out)
    assert info.returncode == 0, info.stderr
    for needle in (
        m.version,
        "cat, dog",
        "images per split and class",
        "rejected: 2",
        "not_an_image",
        "truncated",
    ):
        assert needle in info.stdout
    assert "duplicates: 1 byte-identical files (1 with conflicting labels), dropped" in info.stdout

    raw = vl("data", "info", out, "--json")
    assert raw.returncode == 0
    assert json.loads(raw.stdout) == json.loads((out / "dataset.json").read_text())

    policy = m.image_policy
    assert (policy.max_side, policy.alpha_background, policy.lossy_quality) == (10, (0, 0, 0), 90)
    assert (policy.min_side, policy.max_pixels, policy.max_aspect) == (2, 1_000_000, 50)
    assert m.split_policy.seed == 3
    assert m.size_stats.max == (10, 10)  # 12x12 sources, shrunk by --max-side

    assert_clean_error(vl("data", "ingest", src, "--out", out), "exists and is not empty; pass --overwrite")
    photos = tmp_path / "photos"
    write(photos / "keep.jpg", b"precious")
    r = vl("data", "ingest", src, "--out", photos, "--overwrite")
    assert_clean_error(r, "is not a visionloop dataset", "refusing to replace it")


def test_help_lists_the_options() -> None:
    r = vl("data", "ingest", "--help")
    assert r.returncode == 0
    for flag in (
        "--out",
        "--val-fraction",
        "--test-fraction",
        "--seed",
        "--max-side",
        "--min-side",
        "--max-pixels",
    ):
        assert flag in r.stdout
    for flag in ("--max-aspect", "--workers", "--overwrite", "--keep-duplicates", "--alpha-background"):
        assert flag in r.stdout


def _layout(tmp_path: Path, case: str) -> Path:
    """Build the bad input for `case`; return the SOURCE argument."""
    src = tmp_path / "src"
    if case == "missing":
        return tmp_path / "nowhere"
    if case == "empty":
        write(src / "cat" / "readme.txt", b"x")
    elif case == "top-level":
        write(src / "loose.jpg", b"x")
        write(src / "cat" / "a.jpg", b"x")
    elif case == "mixed":
        write(src / "train" / "cat" / "a.jpg", b"x")
        write(src / "dog" / "b.jpg", b"x")
    else:
        csv = {
            "csv-header": "file,class\na.jpg,cat\n",
            "csv-missing-column": "path\na.jpg\n",
            "csv-split": "path,label,split\na.jpg,cat,training\n",
            "csv-empty-label": "path,label\na.jpg,\n",
        }[case]
        return write(tmp_path / "labels.csv", csv.encode())
    return src


@pytest.mark.parametrize(
    ("case", "needles"),
    [
        ("missing", ["does not exist", "SOURCE/cat/001.jpg"]),
        ("empty", ["found no image files", "SOURCE/cat/001.jpg"]),
        ("top-level", ["1 image(s) directly inside it (loose.jpg)", "/cat/loose.jpg"]),
        ("mixed", ["mixes split folders (train) with class folders (dog)"]),
        ("csv-header", ["bad header `file,class`", "missing column(s) path, label", "path,label,split"]),
        ("csv-missing-column", ["missing column(s) label"]),
        ("csv-split", ["line 2 (a.jpg) has split 'training'; use one of train, val, test"]),
        ("csv-empty-label", ["line 2 (a.jpg) has an empty label"]),
    ],
)
def test_bad_sources_get_a_clear_error(tmp_path: Path, case: str, needles: list[str]) -> None:
    r = vl("data", "ingest", _layout(tmp_path, case), "--out", tmp_path / "ds")
    assert_clean_error(r, "error:", *needles)
    assert not (tmp_path / "ds").exists()


def test_bad_out_and_options_get_a_clear_error(tmp_path: Path) -> None:
    src = tmp_path / "src"
    image_folder(src, {"cat": 2})
    assert_clean_error(vl("data", "ingest", src, "--out", src / "ds"), "is inside the source")
    assert_clean_error(
        vl("data", "ingest", src, "--out", "x", "--val-fraction", "1.5"), "must each be in [0, 1)"
    )
    r = vl("data", "ingest", src, "--out", "x", "--alpha-background", "sky")
    assert_clean_error(r, "is not a colour", code=2)


def test_info_on_something_that_is_not_a_dataset(tmp_path: Path) -> None:
    assert_clean_error(vl("data", "info", tmp_path / "nope"), "does not exist", "visionloop data ingest")
    write(tmp_path / "bad" / "dataset.json", b"{not json")
    assert_clean_error(vl("data", "info", tmp_path / "bad"), "cannot be read as JSON")
