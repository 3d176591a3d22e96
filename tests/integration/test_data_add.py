"""`visionloop data add`: new dataset versions from a parent and a labelled folder, three
versions deep, for classification and detection: what is added and relabelled, what is linked
rather than copied, merged statistics equal to recounting, the lineage in the manifest, in
`data info` and in a trained model's card, and refusals that change nothing."""

from __future__ import annotations

import hashlib
import io
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from _trainkit import cli, spec_doc
from visionloop.core.errors import DataError
from visionloop.data.derive import AddReport, add_images
from visionloop.data.ingest import IngestOptions, ingest
from visionloop.data.manifest import DatasetManifest, SplitName, read_manifest
from visionloop.data.shards import Record, ShardReader, record_field
from visionloop.specs import validate_train_spec
from visionloop.tasks import get_task
from visionloop.tasks.detection.stats import DetectionStats
from visionloop.train.api import train


def _records(dataset: Path, split: str) -> list[Record]:
    reader = ShardReader(dataset / "shards" / split)
    return [reader[i] for i in range(len(reader))]


def _tree_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(folder)).encode() + p.read_bytes())
    return h.hexdigest()


def _exact_channel_stats(dataset: Path) -> tuple[list[float], list[float]]:
    """Mean and deviation of every train pixel, decoded: what ingest would compute."""
    pixels = np.concatenate(
        [
            np.asarray(Image.open(io.BytesIO(r["image"])).convert("RGB"), dtype=np.float64).reshape(-1, 3)
            for r in _records(dataset, "train")
        ]
    )
    return list(pixels.mean(0) / 255), list(pixels.std(0) / 255)


@dataclass(frozen=True)
class Versions:
    root: Path
    v1: Path  # the shared digits dataset
    r2: AddReport  # v2: 20 new images, 3 relabelled, 1 unchanged
    r3: AddReport  # v3: 5 of v2's new images relabelled
    relabelled: dict[str, str]  # image sha256 -> the class v2 gives it
    moved: list[Record]  # v2's records that v3 relabels
    src: Path  # v2's folder


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory, digits_dataset: Path) -> Versions:
    """v1 (the shared digits dataset), v2 (20 new images, 3 relabelled, 1 unchanged) and v3
    (5 of v2's new images relabelled), with what each step was given."""
    root = tmp_path_factory.mktemp("versions")
    v1 = digits_dataset
    m1 = read_manifest(v1)
    train1 = _records(v1, "train")
    src = root / "src2"
    relabelled: dict[str, str] = {}  # image sha256 -> the class it is given
    for i in range(3):
        r = train1[i]
        new = m1.classes[(int(r["label"]) + 1) % len(m1.classes)]
        (src / new).mkdir(parents=True, exist_ok=True)
        (src / new / f"relabel-{i}.png").write_bytes(r["image"])
        relabelled[hashlib.sha256(r["image"]).hexdigest()] = new
    same = train1[5]
    cls = m1.classes[int(same["label"])]
    (src / cls).mkdir(parents=True, exist_ok=True)
    (src / cls / "unchanged.png").write_bytes(same["image"])
    rng = np.random.default_rng(0)
    for i in range(20):
        r = train1[100 + i]
        pixels = np.asarray(Image.open(io.BytesIO(r["image"])).convert("RGB"), dtype=np.int64)
        noisy = np.clip(pixels + rng.integers(-30, 30, pixels.shape), 0, 255).astype(np.uint8)
        folder = src / m1.classes[int(r["label"])]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(noisy).save(folder / f"new-{i}.png")
    selection = root / "selection.json"
    selection.write_text(json.dumps({"model": "digits/1", "chosen": []}))
    before = _tree_digest(v1)
    r2 = add_images(v1, src, root / "v2", selection=selection, cost_per_image=0.25, workers=1)
    assert _tree_digest(v1) == before, "the parent changed"

    # v3: five of v2's new images, all now labelled "3".
    src3 = root / "src3" / "3"
    src3.mkdir(parents=True)
    parent_max = max(int(x["index"]) for s2 in ("train", "val") for x in _records(v1, s2))
    added2 = [r for s in ("train", "val") for r in _records(root / "v2", s) if int(r["index"]) > parent_max]
    moved = [r for r in added2 if m1.classes[int(r["label"])] != "3"][:5]
    for k, r in enumerate(moved):
        (src3 / f"again-{k}.png").write_bytes(r["image"])
    r3 = add_images(root / "v2", root / "src3", root / "v3", workers=1)
    return Versions(root=root, v1=v1, r2=r2, r3=r3, relabelled=relabelled, moved=moved, src=src)


def test_a_version_adds_the_new_images_and_relabels_the_known_ones(versions: Versions) -> None:
    v1 = versions.v1
    r2 = versions.r2
    m1, m2 = read_manifest(v1), read_manifest(r2.out)
    assert sum(r2.added.values()) == 20 and r2.relabelled == 3 and r2.unchanged == 1
    for split in ("train", "val"):
        assert m2.splits[split].count == m1.splits[split].count + r2.added.get(split, 0)

    relabelled = versions.relabelled
    old = {hashlib.sha256(r["image"]).hexdigest(): r for s in ("train", "val") for r in _records(v1, s)}
    new_records: dict[SplitName, list[Record]] = {s: _records(r2.out, s) for s in ("train", "val")}
    parent_max = max(int(r["index"]) for r in old.values())
    seen_indices = set()
    for split, records in new_records.items():
        per_class = dict.fromkeys(m2.classes, 0)
        for r in records:
            sha = hashlib.sha256(r["image"]).hexdigest()
            idx = int(r["index"])
            assert idx not in seen_indices
            seen_indices.add(idx)
            name = m2.classes[int(r["label"])]
            per_class[name] += 1
            if sha in relabelled:
                assert (
                    name == relabelled[sha] and idx == old[sha]["index"]
                )  # same image, same index, new label
            elif sha in old:
                assert (r["label"], idx) == (old[sha]["label"], old[sha]["index"])
            else:
                assert idx > parent_max  # added after every parent record
        assert per_class == m2.splits[split].per_class
    # Parent records keep their positions (metadata lines and chunk-local shuffles rely on it).
    for split in new_records:
        parent = _records(v1, split)
        assert [r["image"] for r in new_records[split][: len(parent)]] == [r["image"] for r in parent]


def test_unchanged_shards_are_linked_and_the_statistics_match_a_recount(versions: Versions) -> None:
    v1, r2 = versions.v1, versions.r2
    out = r2.out
    # The val chunk held no relabel: the same file (inode), not a copy. The train chunk held
    # the three relabels: written again.
    parent_val = v1 / "shards" / "val" / "chunk-0-0.bin"
    assert (out / "shards" / "val" / "chunk-0-0.bin").stat().st_ino == parent_val.stat().st_ino
    assert (out / "shards" / "train" / "chunk-0-0.bin").stat().st_ino != (
        v1 / "shards/train/chunk-0-0.bin"
    ).stat().st_ino
    assert (r2.linked_chunks, r2.rewritten_chunks) == (1, 1)

    m2 = read_manifest(out)
    mean, std = _exact_channel_stats(out)
    assert all(math.isclose(a, b, abs_tol=2e-5) for a, b in zip(m2.channel_stats.mean, mean, strict=True)), (
        m2.channel_stats,
        mean,
    )
    assert all(math.isclose(a, b, abs_tol=2e-5) for a, b in zip(m2.channel_stats.std, std, strict=True))
    sizes = [Image.open(io.BytesIO(r["image"])).size for s in ("train", "val") for r in _records(out, s)]
    assert m2.size_stats.max == (max(w for w, _ in sizes), max(h for _, h in sizes))
    assert m2.splits["train"].bytes == sum(len(r["image"]) for r in _records(out, "train"))


def test_three_versions_carry_their_lineage_into_info_and_the_model_card(
    versions: Versions, tmp_path: Path
) -> None:
    v1, r2, r3 = versions.v1, versions.r2, versions.r3
    m1, m2, m3 = read_manifest(v1), read_manifest(r2.out), read_manifest(r3.out)
    assert m1.lineage is None and m3.ancestry == [m2.version, m1.version]
    assert len({m1.version, m2.version, m3.version}) == 3
    assert m2.lineage is not None and m3.lineage is not None
    step2, step3 = m2.lineage[0], m3.lineage[0]
    assert (step2.parent, step2.parent_path, step2.relabelled) == (m1.version, str(v1.resolve()), 3)
    assert sum(step2.added.values()) == 20 and step2.labelling_cost == pytest.approx(0.25 * 23)
    assert step2.selection is not None and step2.selection.endswith("selection.json")
    assert (step3.parent, step3.relabelled, step3.added, step3.labelling_cost) == (m2.version, 5, {}, None)
    assert m3.lineage[1] == step2
    # v3's relabels are v2's added images: their class is now "3".
    moved = {hashlib.sha256(r["image"]).hexdigest() for r in versions.moved}
    got = {
        hashlib.sha256(r["image"]).hexdigest(): m3.classes[int(r["label"])]
        for s in ("train", "val")
        for r in _records(r3.out, s)
    }
    assert {got[s] for s in moved} == {"3"}

    # Making the same step again gives the same version.
    again = add_images(v1, versions.src, tmp_path / "again", workers=1)
    assert again.manifest.version == m2.version

    r = cli("data", "info", str(r3.out), env={"COLUMNS": "250"})
    assert r.returncode == 0, r.stderr
    assert "lineage: 2 step(s) back to the first version" in r.stdout
    rows = [line for line in r.stdout.splitlines() if line.startswith("│ ")]
    first_cells = [c for c in (row.split("│")[1].strip() for row in rows) if c]  # wrapped rows: blank
    assert first_cells[-3:] == [m3.version[:12], m2.version[:12], m1.version[:12]]
    assert "5.75" in r.stdout and "ingested" in r.stdout

    doc = spec_doc(r3.out, epochs=None, steps=2, data__workers=0)
    result = train(validate_train_spec(doc), tmp_path / "run", track=False)
    assert result.exit_code == 0
    card = json.loads((tmp_path / "run" / "model_card.json").read_text())
    assert card["dataset_version"] == m3.version and card["dataset_lineage"] == [m2.version, m1.version]


def test_refusals_name_the_problem_and_leave_nothing_behind(versions: Versions, tmp_path: Path) -> None:
    v1, src = versions.v1, versions.src
    unknown = tmp_path / "unknown"
    (unknown / "cat").mkdir(parents=True)
    shutil.copy(next(src.rglob("new-0.png")), unknown / "cat" / "a.png")
    with pytest.raises(DataError, match="'cat' that the parent dataset does not have"):
        add_images(v1, unknown, tmp_path / "out1", workers=1)
    with pytest.raises(DataError, match="overlaps the parent dataset"):
        add_images(v1, src, v1 / "inside", workers=1)
    nothing = tmp_path / "nothing"
    shutil.copytree(src, nothing)
    for p in nothing.rglob("new-*.png"):
        p.unlink()
    for p in nothing.rglob("relabel-*.png"):
        p.unlink()
    with pytest.raises(DataError, match="adds no image and changes no label"):
        add_images(v1, nothing, tmp_path / "out2", workers=1)
    with pytest.raises(DataError, match="is not a price per image"):
        add_images(v1, src, tmp_path / "out3", cost_per_image=-1.0, workers=1)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(DataError, match="exists and is not empty"):
        add_images(v1, src, taken, workers=1)
    assert (taken / "keep.txt").read_text() == "mine"
    # Nothing half-made is left beside the outputs.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nothing", "taken", "unknown"]

    r = cli("data", "add", str(v1), str(unknown), "--out", str(tmp_path / "out4"))
    assert r.returncode != 0 and "'cat'" in r.stderr and "Traceback" not in r.stderr
    r = cli("data", "add", str(tmp_path / "nope"), str(src), "--out", str(tmp_path / "out5"))
    assert r.returncode != 0 and "not a visionloop dataset" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out4").exists() and not (tmp_path / "out5").exists()


def test_the_cli_prints_what_it_made(versions: Versions, tmp_path: Path) -> None:
    v1, src = versions.v1, versions.src
    r = cli(
        "data", "add", str(v1), str(src), "--out", str(tmp_path / "v2"), "--cost-per-image", "0.1", "-j", "1"
    )
    assert r.returncode == 0, r.stderr
    assert "20 images added, 3 relabelled" in r.stdout and "1 already there with the same labels" in r.stdout
    assert "1 of the parent's chunk files linked, 1 rewritten" in r.stdout and "labelling   2.30" in r.stdout
    doc = json.loads(cli("data", "info", str(tmp_path / "v2"), "--json").stdout)
    assert doc["lineage"][0]["relabelled"] == 3 and doc["lineage"][0]["labelling_cost"] == pytest.approx(2.3)
    # Without --cost-per-image: the settings' price for the dataset's task.
    (tmp_path / "visionloop.toml").write_text("[visionloop.labelling_cost_per_image]\nclassification = 0.5\n")
    r = cli("data", "add", str(v1), str(src), "--out", str(tmp_path / "v2b"), "-j", "1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads(cli("data", "info", str(tmp_path / "v2b"), "--json").stdout)
    assert doc["lineage"][0]["labelling_cost"] == pytest.approx(0.5 * 23)


def _boxes(dataset: Path) -> dict[str, tuple[list[str], list[list[float]]]]:
    """Each stored image's (classes of its boxes, boxes), by image hash."""
    from visionloop.tasks.detection.boxes import decode_boxes

    m = read_manifest(dataset)
    found = {}
    for split in ("train", "val"):
        for r in _records(dataset, split):
            boxes, labels, _ = decode_boxes(record_field(r, "boxes"))
            found[hashlib.sha256(r["image"]).hexdigest()] = (
                [m.classes[int(c)] for c in labels],
                boxes.tolist(),
            )
    return found


def _counted(m: DatasetManifest, found: dict[str, tuple[list[str], list[list[float]]]]) -> dict[str, int]:
    counts = dict.fromkeys(m.classes, 0)
    for classes, _ in found.values():
        for c in classes:
            counts[c] += 1
    return counts


def test_detection_versions_remap_classes_relabel_boxes_and_recount(tmp_path: Path) -> None:
    from visionloop.tasks.labels import ImageLabels, LabelledImage

    task = get_task("detection")
    v1 = tmp_path / "v1"
    ingest(
        task.example_source(tmp_path / "src1", 24, seed=0), v1, IngestOptions(val_fraction=0.25, workers=1)
    )
    # v2: new images from another seed (a COCO source).
    r2 = add_images(v1, task.example_source(tmp_path / "src2", 8, seed=1), tmp_path / "v2", workers=1)
    assert sum(r2.added.values()) == 8 and r2.relabelled == 0
    # v3: two of v1's images relabelled in a Label Studio export that names only class "2",
    # so the source numbers it 0 and the version must map it back to the parent's 2.
    m1 = read_manifest(v1)
    first = _records(v1, "train")[:2]
    items = []
    for k, r in enumerate(first):
        path = tmp_path / f"img{k}.png"
        path.write_bytes(r["image"])
        items.append(
            LabelledImage(
                id=f"img{k}.png", path=path, labels=ImageLabels(("2",), ((10.0, 10.0, 50.0, 40.0),))
            )
        )
    export = tmp_path / "ls"
    export.mkdir()
    task.write_labelled(items, export)
    r3 = add_images(tmp_path / "v2", export, tmp_path / "v3", workers=1)
    assert r3.relabelled == 2 and sum(r3.added.values()) == 0

    m3 = read_manifest(tmp_path / "v3")
    assert m3.classes == m1.classes and m3.ancestry == [r2.manifest.version, m1.version]
    found = _boxes(tmp_path / "v3")
    for r in first:
        classes, boxes = found[hashlib.sha256(r["image"]).hexdigest()]
        assert classes == ["2"] and boxes == [
            [pytest.approx(6.4), pytest.approx(6.4), pytest.approx(38.4), pytest.approx(32.0)]
        ]
    # Box counts per class recounted over the version's records.
    stats = task.dataset_stats(m3)
    assert isinstance(stats, DetectionStats)
    total = {c: sum(s.instances[c] for s in stats.splits.values()) for c in m3.classes}
    assert total == _counted(m3, found)
    assert sum(m3.splits[s].count for s in ("train", "val")) == len(found) == 32
