"""`visionloop data ingest` on detection sources, run as a user runs it: a subprocess, its exit
code, and what it prints."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import _warmcli
from _imgfactory import tree_digest
from visionloop.data.manifest import DatasetManifest, read_manifest
from visionloop.tasks.detection.stats import DetectionStats
from visionloop.tasks.detection.synthetic import generate_detection_dataset
from visionloop.tasks.detection.task import DetectionTask


def stats_of(m: DatasetManifest) -> DetectionStats | None:
    """The manifest's detection statistics, as the task reads them back."""
    return DetectionTask().dataset_stats(m)


def vl(*args: str | Path) -> subprocess.CompletedProcess[str]:
    # No wrapping of the lines asserted on.
    return _warmcli.run([*map(str, args)], env={**os.environ, "COLUMNS": "200"}, timeout=300)


def test_cli_ingests_a_coco_source_and_prints_the_summary(tmp_path: Path) -> None:
    src = tmp_path / "src"
    generate_detection_dataset(src, 12, image_size=(48, 40), digit_size=(8, 20), classes=(4, 7))
    doc = json.loads((src / "instances.json").read_text())
    first = doc["annotations"][0]
    doc["annotations"].append({**first, "id": 999, "category_id": 42})  # an unknown class
    doc["annotations"].append({**first, "id": 1000, "bbox": [40, 30, 20, 20]})  # past the edge
    (src / "instances.json").write_text(json.dumps(doc))
    before = tree_digest(src)
    out = tmp_path / "ds"

    r = vl("data", "ingest", src, "--out", out, "--max-side", "24", "-j", "1", "--val-fraction", "0.25")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert tree_digest(src) == before
    m = read_manifest(out)
    det = stats_of(m)
    assert m.task == "detection" and det is not None
    boxes = sum(sum(s.instances.values()) for s in det.splits.values())
    background = sum(s.background_images for s in det.splits.values())
    assert f"Ingested 12 images with {boxes} boxes in 2 classes from {src} (coco)" in r.stdout
    assert f"kept        train {m.splits['train'].count} · val {m.splits['val'].count} · test 0" in r.stdout
    assert f"background  {background} images with no box (kept)" in r.stdout
    assert "clipped     1 boxes clipped to the image edges (kept)" in r.stdout
    assert f"rejected    1 (unknown_class 1) → {out}/rejected.jsonl" in r.stdout
    assert f"version     {m.version}" in r.stdout
    # the per-class table: boxes (images) per split, and the background row
    for cls in ("4", "7"):
        total = sum(s.instances[cls] for s in det.splits.values())
        with_cls = sum(info.per_class[cls] for info in m.splits.values())
        assert f"{total} ({with_cls})" in r.stdout
    assert "background" in r.stdout and "small/medium/large" in r.stdout

    info = vl("data", "info", out)
    assert info.returncode == 0, info.stderr
    assert "detection" in info.stdout and "unknown_class" in info.stdout


def test_cli_unreadable_source_exits_non_zero_with_a_message(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "images").mkdir(parents=True)
    (src / "instances.json").write_text('{"images": [')  # a truncated export
    r = vl("data", "ingest", src, "--out", tmp_path / "ds")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert "instances.json is not valid JSON" in r.stderr
    assert not (tmp_path / "ds").exists()

    r = vl("data", "ingest", src, "--out", tmp_path / "ds", "--format", "kitti")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "format must be one of coco, yolo, voc, label_studio" in r.stderr

    help_text = vl("data", "ingest", "--help").stdout
    assert "--format" in help_text and "label_studio" in help_text and "data.yaml" in help_text
