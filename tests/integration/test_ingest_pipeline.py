"""Ingest end to end on ordinary sources: splits, shards, versions, resizing, and what happens
to `--out` on success, on refusal and on interruption."""

from __future__ import annotations

import io
import itertools
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from _imgfactory import image_folder, noise, png, write
from visionloop.core.errors import DataError
from visionloop.data.ingest import IngestOptions, ingest
from visionloop.data.manifest import read_manifest
from visionloop.data.shards import ShardReader
from visionloop.data.split import split_sizes

OPTS = IngestOptions(workers=2)


def records(out: Path, split: str) -> list[tuple[int, int, bytes]]:
    """(index, label, image bytes) of a split's shard, in stored order."""
    reader = ShardReader(out / "shards" / split)
    return [(r["index"], r["label"], r["image"]) for r in (reader[k] for k in range(len(reader)))]


def opts(**kw: object) -> IngestOptions:
    return IngestOptions(**{"workers": 2, **kw})  # type: ignore[arg-type]


def test_flat_imagefolder_is_split_stratified_and_shards_match_the_manifest(tmp_path: Path) -> None:
    counts = {"ant": 9, "bee": 20, "cat": 12}
    image_folder(tmp_path / "src", counts)
    out = tmp_path / "ds"
    report = ingest(tmp_path / "src", out, opts(val_fraction=0.25, test_fraction=0.1, seed=7))
    m = read_manifest(out)
    assert m.classes == ["ant", "bee", "cat"] and not m.split_policy.from_source
    for cls, n in counts.items():
        train, val, test = split_sizes(n, 0.25, 0.1)
        assert (m.splits["train"].per_class[cls], m.splits["val"].per_class[cls]) == (train, val)
        assert m.splits["test"].per_class[cls] == test
    assert report.kept == sum(counts.values())

    listing = sorted(p.relative_to(tmp_path / "src").as_posix() for p in (tmp_path / "src").rglob("*.png"))
    indices = []
    for split in ("train", "val", "test"):
        recs = records(out, split)
        assert len(recs) == m.splits[split].count
        assert m.splits[split].bytes == sum(len(r[2]) for r in recs)
        for index, label, data in recs:
            rel = listing[index]
            assert m.classes[label] == rel.split("/")[0]
            assert data == (tmp_path / "src" / rel).read_bytes()  # RGB PNGs are stored as they are
            indices.append(index)
    assert sorted(indices) == list(range(len(listing)))  # unique across splits

    # The write order is shuffled: the train shard does not run class by class.
    labels = [label for _, label, _ in records(out, "train")]
    runs = 1 + sum(1 for a, b in itertools.pairwise(labels) if a != b)
    assert runs > 6, labels
    assert m.size_stats.min == m.size_stats.max == (12, 12)
    assert 0.4 < m.channel_stats.mean[0] < 0.6


def test_same_input_gives_the_same_dataset_and_version(tmp_path: Path) -> None:
    image_folder(tmp_path / "src", {"a": 10, "b": 10})
    ingest(tmp_path / "src", tmp_path / "one", OPTS)
    ingest(tmp_path / "src", tmp_path / "two", opts(workers=1))
    one, two = read_manifest(tmp_path / "one"), read_manifest(tmp_path / "two")
    assert one.version == two.version
    for split in ("train", "val"):
        assert records(tmp_path / "one", split) == records(tmp_path / "two", split)
    assert one.model_dump(exclude={"created_at", "source"}) == two.model_dump(
        exclude={"created_at", "source"}
    )


def test_version_follows_pixels_labels_and_seed_but_not_names(tmp_path: Path) -> None:
    src = tmp_path / "src"
    image_folder(src, {"a": 8, "b": 8})
    base = ingest(src, tmp_path / "base", OPTS).manifest.version

    # Rename a file (same content, same class): same version, even though its index moved.
    (src / "a" / "a_003.png").rename(src / "a" / "zz_renamed.png")
    assert ingest(src, tmp_path / "renamed", OPTS).manifest.version == base

    # One changed pixel: a new version.
    arr = np.asarray(Image.open(src / "a" / "a_000.png")).copy()
    arr[0, 0, 0] ^= 1
    write(src / "a" / "a_000.png", png(arr))
    changed_pixel = ingest(src, tmp_path / "pixel", OPTS).manifest.version
    assert changed_pixel != base

    # One image moved to the other class: a new version again.
    shutil.move(src / "a" / "a_001.png", src / "b" / "a_001.png")
    changed_label = ingest(src, tmp_path / "label", OPTS).manifest.version
    assert changed_label not in (base, changed_pixel)

    # Another seed gives another split, so another version.
    assert ingest(src, tmp_path / "seed", opts(seed=1)).manifest.version != changed_label


def test_csv_sources_with_and_without_a_split_column(tmp_path: Path) -> None:
    paths = image_folder(tmp_path / "imgs", {"x": 6, "y": 6})
    rows = [f"imgs/{p.parent.name}/{p.name},{p.parent.name}" for p in paths]
    (tmp_path / "plain.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    m = ingest(tmp_path / "plain.csv", tmp_path / "plain", opts(val_fraction=0.5)).manifest
    assert m.source.kind == "csv" and not m.split_policy.from_source
    assert m.splits["val"].per_class == {"x": 3, "y": 3}

    splits = ["train", "val", "test"] * 4
    with_split = [f"{row},{s}" for row, s in zip(rows, splits, strict=True)]
    (tmp_path / "split.csv").write_text("path,label,split\n" + "\n".join(with_split) + "\n")
    m2 = ingest(tmp_path / "split.csv", tmp_path / "given", OPTS).manifest
    assert m2.split_policy.from_source
    assert {s: m2.splits[s].count for s in ("train", "val", "test")} == {"train": 4, "val": 4, "test": 4}
    assert m2.split_policy.val_fraction == pytest.approx(1 / 3, abs=1e-3)


def test_max_side_shrinks_large_images_only(tmp_path: Path) -> None:
    write(tmp_path / "src/a/big.png", png(noise(40, 30, seed=1)))
    write(tmp_path / "src/a/small.png", png(noise(10, 6, seed=2)))
    write(tmp_path / "src/b/tall.png", png(noise(20, 64, seed=3)))
    m = ingest(tmp_path / "src", tmp_path / "ds", opts(max_side=16, val_fraction=0.0)).manifest
    assert m.image_policy.max_side == 16
    sizes = sorted(Image.open(io.BytesIO(img)).size for _, _, img in records(tmp_path / "ds", "train"))
    assert sizes == [(5, 16), (10, 6), (16, 12)]
    assert (m.size_stats.min, m.size_stats.max) == ((5, 6), (16, 16))


def test_channel_stats_are_exact_over_the_train_split(tmp_path: Path) -> None:
    for i in range(3):  # distinct bytes, or they would be dropped as duplicates
        write(tmp_path / f"src/a/dark{i}.png", png(np.full((4, 4, 3), i, np.uint8)))
        write(tmp_path / f"src/b/light{i}.png", png(np.full((4, 4, 3), 255 - i, np.uint8)))
    m = ingest(tmp_path / "src", tmp_path / "ds", opts(val_fraction=0.0)).manifest
    values = np.array([0, 1, 2, 255, 254, 253] * 16) / 255
    assert m.channel_stats.mean == pytest.approx((values.mean(),) * 3, abs=1e-6)
    assert m.channel_stats.std == pytest.approx((values.std(),) * 3, abs=1e-6)


def test_keep_duplicates_keeps_and_still_reports_them(tmp_path: Path) -> None:
    image_folder(tmp_path / "src", {"a": 4})
    write(tmp_path / "src/a/copy.png", (tmp_path / "src/a/a_000.png").read_bytes())
    dropped = ingest(tmp_path / "src", tmp_path / "dropped", opts(val_fraction=0.0))
    kept = ingest(tmp_path / "src", tmp_path / "kept", opts(val_fraction=0.0, keep_duplicates=True))
    assert (dropped.kept, dropped.manifest.duplicates) == (4, 1)
    assert (kept.kept, kept.manifest.duplicates) == (5, 1)
    assert kept.manifest.version != dropped.manifest.version


# -- --out: refusals, overwrite, interruption ----------------------------------------------------


def siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def test_out_must_be_new_or_empty_unless_overwrite_and_overwrite_swaps(tmp_path: Path) -> None:
    src = tmp_path / "src"
    image_folder(src, {"a": 5, "b": 5})
    out = tmp_path / "ds"
    out.mkdir()  # an empty folder is fine
    first = ingest(src, out, OPTS).manifest.version
    with pytest.raises(DataError, match="exists and is not empty; pass --overwrite"):
        ingest(src, out, OPTS)
    write(src / "c" / "new.png", png(noise(12, 12, seed=99)))
    second = ingest(src, out, opts(overwrite=True)).manifest
    assert second.version != first and second.classes == ["a", "b", "c"]
    assert read_manifest(out).version == second.version
    assert siblings(out) == []  # no temporary or old folder left beside it


def test_out_inside_the_source_or_containing_it_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "src"
    image_folder(src, {"a": 3})
    with pytest.raises(DataError, match="is inside the source"):
        ingest(src, src / "ds", OPTS)
    # --overwrite on a folder holding the source would delete the source.
    write(tmp_path / "dataset.json", b"{}")
    with pytest.raises(DataError, match="contains source images"):
        ingest(src, tmp_path, opts(overwrite=True))
    # --overwrite never replaces a folder that is not a dataset.
    other = tmp_path / "photos"
    write(other / "holiday.jpg", b"precious")
    with pytest.raises(DataError, match="is not a visionloop dataset"):
        ingest(src, other, opts(overwrite=True))
    assert (other / "holiday.jpg").read_bytes() == b"precious"
    assert not (src / "ds").exists()


class BoomError(Exception):
    pass


@pytest.mark.parametrize("exc", [KeyboardInterrupt, BoomError])
def test_interrupted_ingest_leaves_no_half_dataset(tmp_path: Path, exc: type[BaseException]) -> None:
    src = tmp_path / "src"
    image_folder(src, {"a": 40, "b": 40})
    out = tmp_path / "ds"

    def stop_midway(stage: str, done: int, total: int) -> None:
        if stage == "decode" and 0 < done < total:
            raise exc

    with pytest.raises(exc):
        ingest(src, out, opts(), progress=stop_midway)
    assert not out.exists()
    assert siblings(out) == []

    # With an existing dataset and --overwrite, the old one survives an interrupted rebuild.
    old = ingest(src, out, OPTS).manifest
    write(src / "a" / "extra.png", png(noise(12, 12, seed=1234)))
    with pytest.raises(exc):
        ingest(src, out, opts(overwrite=True), progress=stop_midway)
    assert read_manifest(out) == old
    assert len(records(out, "train")) == old.splits["train"].count
    assert siblings(out) == []


def test_nothing_usable_is_an_error_and_leaves_nothing(tmp_path: Path) -> None:
    write(tmp_path / "src/a/x.jpg", b"text")
    write(tmp_path / "src/a/y.png", b"")
    with pytest.raises(DataError, match="no usable images") as e:
        ingest(tmp_path / "src", tmp_path / "ds", OPTS)
    assert "a/x.jpg is not an image" in str(e.value)
    assert not (tmp_path / "ds").exists()


def test_options_are_validated_with_a_fix() -> None:
    with pytest.raises(DataError, match="must be below 1"):
        IngestOptions(val_fraction=0.6, test_fraction=0.5)
    with pytest.raises(DataError, match=r"max_side must be a positive number of pixels, e\.g\. 512"):
        IngestOptions(max_side=0)
    assert Counter(IngestOptions().image_policy().model_dump()) == Counter(
        {
            "mode": "RGB",
            "max_side": None,
            "alpha_background": (255, 255, 255),
            "lossy_quality": 95,
            "min_side": 1,
            "max_pixels": 100_000_000,
            "max_aspect": 100.0,
        }
    )
