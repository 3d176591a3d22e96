"""A source full of trouble, ingested for real (worker processes, shards, manifest): every bad
file is rejected with the right reason, every good one is stored, and the source is untouched."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image

from _imgfactory import (
    bomb_png,
    cmyk_jpeg,
    encode,
    exif_jpeg,
    gray16_png,
    noise,
    png,
    tree_digest,
    truncate,
    write,
)
from visionloop.data.ingest import IngestOptions, ingest
from visionloop.data.manifest import read_manifest
from visionloop.data.shards import ShardReader

pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")

EXPECTED_REJECTED = {
    "train/cat/bomb.png": "too_large",
    "train/cat/empty.jpg": "empty_file",
    "train/cat/random.png": "not_an_image",
    "train/cat/sliver.png": "bad_aspect",
    "train/cat/text.jpg": "not_an_image",
    "train/cat/truncated.jpg": "truncated",
    "train/cat/truncated.png": "truncated",
    "val/dog/truncated_copy.jpg": "truncated",  # same bytes as a rejected file: same fate
}
EXPECTED_DUPLICATES = {
    # duplicate -> (kept, labels conflict)
    "train/cat/good_0_copy.png": ("train/cat/good_0.png", False),
    "train/dog/conflict.png": ("train/cat/good_1.png", True),
    "val/dog/cross.png": ("train/dog/good_2.png", False),  # across splits: leakage
}


def _good(root: Path, split: str, cls: str, n: int, seed: int) -> None:
    for i in range(n):
        write(root / split / cls / f"good_{i}.png", png(noise(16, 16, seed=seed + i)))


def build_hostile_source(root: Path) -> None:
    _good(root, "train", "cat", 6, seed=100)
    _good(root, "train", "dog", 6, seed=200)
    _good(root, "val", "cat", 3, seed=300)
    _good(root, "val", "dog", 3, seed=400)
    cat = root / "train" / "cat"
    # every colour mode ingest must convert
    write(cat / "mode_l.png", png(noise(16, 16, seed=1, channels=1)))
    write(cat / "mode_la.png", encode(Image.fromarray(noise(16, 16, seed=2, channels=2), mode="LA"), "PNG"))
    write(cat / "mode_rgba.png", png(noise(16, 16, seed=3, channels=4)))
    pal = Image.fromarray(noise(16, 16, seed=4, channels=1) % 4, mode="P")
    pal.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255, 9, 9, 9] + [0] * 756)
    write(cat / "mode_p.png", encode(pal, "PNG"))
    write(cat / "mode_p_trns.png", encode(pal, "PNG", transparency=3))
    write(cat / "mode_cmyk.jpg", cmyk_jpeg(16, 16, (0, 255, 0, 0)))
    write(cat / "mode_i16.png", gray16_png(noise(16, 16, seed=5, channels=1).astype(np.uint16) * 257))
    write(cat / "mode_1.png", encode(Image.fromarray(noise(16, 16, seed=6, channels=1) > 127), "PNG"))
    corner = np.full((32, 64, 3), 128, dtype=np.uint8)
    corner[:16, :16] = (255, 0, 0)
    write(cat / "mode_exif6.jpg", exif_jpeg(corner, orientation=6))
    # hostile files
    good_jpeg = encode(Image.fromarray(noise(32, 32, seed=7)), "JPEG", quality=90)
    write(cat / "truncated.jpg", truncate(good_jpeg, 0.6))
    write(cat / "truncated.png", truncate(png(noise(32, 32, seed=8)), 0.6))
    write(cat / "empty.jpg", b"")
    write(cat / "text.jpg", b"this is not a jpeg at all\n")
    write(cat / "random.png", bytes(np.random.default_rng(9).integers(0, 256, 700, dtype=np.uint8)))
    write(cat / "bomb.png", bomb_png(100_000, 100_000))
    write(cat / "sliver.png", png(noise(1, 2000, seed=10)))
    write(cat / "notes.txt", b"skipped: not an image extension")
    write(cat / ".hidden.png", png(noise(4, 4, seed=11)))
    # duplicates: within a class, with a conflicting label, across splits, of a rejected file
    write(cat / "good_0_copy.png", (cat / "good_0.png").read_bytes())
    write(root / "train/dog/conflict.png", (cat / "good_1.png").read_bytes())
    write(root / "val/dog/cross.png", (root / "train/dog/good_2.png").read_bytes())
    write(root / "val/dog/truncated_copy.jpg", (cat / "truncated.jpg").read_bytes())


def read_jsonl(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_hostile_source_is_ingested_with_every_problem_accounted_for(tmp_path: Path) -> None:
    src = tmp_path / "src"
    build_hostile_source(src)
    src.chmod(0o555)  # a read-only source must be enough
    before = tree_digest(src)
    out = tmp_path / "ds"
    try:
        report = ingest(src, out, IngestOptions(workers=2))
    finally:
        src.chmod(0o755)
    assert tree_digest(src) == before, "ingest modified the source tree"

    m = read_manifest(out)
    rejected = read_jsonl(out / "rejected.jsonl")
    assert {r["path"]: r["reason"] for r in rejected} == EXPECTED_REJECTED
    assert all(str(r["message"]).startswith(str(r["path"])) for r in rejected)
    assert m.rejected == len(EXPECTED_REJECTED)
    assert report.rejected_by_reason == {
        "bad_aspect": 1,
        "empty_file": 1,
        "not_an_image": 2,
        "too_large": 1,
        "truncated": 3,
    }

    dups = read_jsonl(out / "duplicates.jsonl")
    assert {d["duplicate"]: (d["kept"], d["labels_conflict"]) for d in dups} == EXPECTED_DUPLICATES
    cross = next(d for d in dups if d["duplicate"] == "val/dog/cross.png")
    assert (cross["kept_split"], cross["duplicate_split"]) == ("train", "val")
    assert m.duplicates == 3 and report.conflicting_duplicates == 1

    assert m.classes == ["cat", "dog"]
    assert m.split_policy.from_source
    assert {s: m.splits[s].per_class for s in ("train", "val", "test")} == {
        "train": {"cat": 6 + 9, "dog": 6},
        "val": {"cat": 3, "dog": 3},
        "test": {"cat": 0, "dog": 0},
    }
    assert report.skipped == 1
    assert m.source.files_seen == 39  # 38 candidates + notes.txt; the hidden file is not seen
    assert report.stored_as == {"original": 18, "png": 7, "jpeg": 2}

    # Shards: every record's label and index agree with the listing, across all splits.
    listing = sorted(
        p.relative_to(src).as_posix()
        for p in src.rglob("*")
        if p.is_file() and not p.name.startswith(".") and p.suffix != ".txt"
    )
    dropped = set(EXPECTED_REJECTED) | set(EXPECTED_DUPLICATES)
    seen: dict[str, bytes] = {}
    for split in ("train", "val", "test"):
        reader = ShardReader(out / m.splits[split].shard_dir)
        assert len(reader) == m.splits[split].count
        for k in range(len(reader)):
            rec = reader[k]
            rel = listing[rec["index"]]
            assert rel.split("/")[0] == split
            assert m.classes[rec["label"]] == rel.split("/")[1]
            assert rel not in seen
            seen[rel] = rec["image"]
    assert set(seen) == set(listing) - dropped

    # Every stored image decodes to 8-bit RGB; the EXIF-rotated one is upright.
    for rel, data in seen.items():
        t = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        assert t.dtype == torch.uint8 and t.shape[0] == 3, rel
    upright = decode_image(
        torch.frombuffer(bytearray(seen["train/cat/mode_exif6.jpg"]), dtype=torch.uint8),
        mode=ImageReadMode.RGB,
    )
    assert tuple(upright.shape) == (3, 64, 32)
    top_right = upright[:, 2:14, 18:30].float().mean(dim=(1, 2))
    top_left = upright[:, 2:14, 2:14].float().mean(dim=(1, 2))
    assert top_right[0] > 200 and top_right[1] < 60  # the red corner moved to the top right
    assert top_left[0] < 160
    # Composited onto white: a fully transparent palette entry is white, not index colour 9,9,9.
    p_trns = decode_image(
        torch.frombuffer(bytearray(seen["train/cat/mode_p_trns.png"]), dtype=torch.uint8),
        mode=ImageReadMode.RGB,
    )
    pal_idx = noise(16, 16, seed=4, channels=1) % 4
    assert (p_trns.permute(1, 2, 0).numpy()[pal_idx == 3] == 255).all()
