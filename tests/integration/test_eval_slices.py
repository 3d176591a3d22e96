"""`visionloop eval --slices`: the metric per value of a per-image metadata column, worst first,
with seeded bootstrap intervals, on the session's really trained digits model and a dataset
ingested from a CSV whose `camera` column says which images were turned sideways before
ingest (a camera mounted wrong): that slice must come first, measurably worse."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pytest
from PIL import Image

from _modelkit import ModelKit, registered_model  # noqa: F401  (session fixture)
from _trainkit import cli
from visionloop.core.errors import DataError, SpecError
from visionloop.data.ingest import IngestOptions, ingest
from visionloop.data.manifest import read_manifest
from visionloop.data.shards import ShardReader
from visionloop.eval.api import evaluate_model
from visionloop.eval.options import EvalOptions


def camera_of(i: int) -> str:
    return "sideways" if i % 4 == 0 else ("north" if i % 2 else "south")


def time_of(i: int) -> str:
    return "" if i % 5 == 0 else ("night" if i % 3 == 0 else "day")


@pytest.fixture(scope="module")
def kit(registered_model: ModelKit, tmp_path_factory: pytest.TempPathFactory) -> ModelKit:  # noqa: F811
    return registered_model.copy_home(tmp_path_factory.mktemp("slices") / "home")


@pytest.fixture(scope="module")
def camera_dataset(kit: ModelKit, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model's own validation images (never trained on), a quarter of them rotated by 90
    degrees, as a CSV source with camera and time_of_day columns; ingested, all into val."""
    root = tmp_path_factory.mktemp("camera-src")
    manifest = read_manifest(kit.dataset)
    val = ShardReader(kit.dataset / manifest.splits["val"].shard_dir)
    rows = []
    for i in range(len(val)):
        record = val[i]
        image: Image.Image = Image.open(io.BytesIO(record["image"]))
        if camera_of(i) == "sideways":
            image = image.transpose(Image.Transpose.ROTATE_90)
        name = f"images/{i:04d}.png"
        (root / "images").mkdir(exist_ok=True)
        image.save(root / name)
        rows.append([name, manifest.classes[record["label"]], "val", camera_of(i), time_of(i)])
    with open(root / "labels.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["path", "label", "split", "camera", "time_of_day"])
        w.writerows(rows)
    out = root / "ds"
    ingest(root / "labels.csv", out, IngestOptions(workers=2))
    assert read_manifest(out).classes == manifest.classes  # the model's classes, in its order
    return out


def test_slices_put_the_sideways_camera_first_with_seeded_intervals(
    kit: ModelKit, camera_dataset: Path
) -> None:
    opts = EvalOptions(dataset=camera_dataset, split="val", slices=("camera", "time_of_day"), seed=3)
    report = evaluate_model(kit.ref, opts, settings=kit.settings)
    assert report.slices is not None and list(report.slices) == ["camera", "time_of_day"]
    assert report.slice_bootstrap == {
        "confidence": 0.95,
        "resamples": 200,
        "min_images": 5,
        "max_images_resampled": 1000,
        "seed": 3,
    }
    cameras = report.slices["camera"]
    assert cameras[0]["value"] == "sideways" and {r["value"] for r in cameras[1:]} == {"north", "south"}
    assert sum(r["images"] for r in cameras) == report.images == 359
    worst, *rest = cameras
    # The sideways images are measurably worse: their whole interval lies below the others'.
    assert worst["metric"] < min(r["metric"] for r in rest) - 0.3
    assert worst["ci_high"] < min(r["ci_low"] for r in rest)
    for rows in report.slices.values():
        for r in rows:
            assert r["ci_low"] <= r["metric"] <= r["ci_high"] and r["resampled"] == r["images"]
            assert r["ci_high"] - r["ci_low"] > 0 or r["metric"] in (0.0, 1.0)
    # Each slice's metric is the accuracy over its images: the images-weighted mean is the clean one.
    total = sum(r["metric"] * r["images"] for r in cameras)
    assert total / report.images == pytest.approx(report.clean)
    # Images without a value are a slice of their own.
    times = {r["value"]: r for r in report.slices["time_of_day"]}
    assert set(times) == {"day", "night", None}
    assert times[None]["images"] == sum(1 for i in range(359) if time_of(i) == "")
    # In eval.json as in the report.
    assert json.loads(Path(report.path).read_text())["slices"] == report.slices

    # Seeded: the same seed gives the same intervals, another seed others (on 120 images;
    # time_of_day's slices mix both cameras, so their accuracy is not at an extreme).
    few = EvalOptions(dataset=camera_dataset, split="val", slices=("time_of_day",), max_images=120, seed=3)
    a = evaluate_model(kit.ref, few, settings=kit.settings)
    b = evaluate_model(kit.ref, few, settings=kit.settings)
    c = evaluate_model(kit.ref, EvalOptions(**{**few.__dict__, "seed": 4}), settings=kit.settings)
    assert a.slices is not None and b.slices is not None and c.slices is not None
    assert a.slices == b.slices
    assert [r["metric"] for r in c.slices["time_of_day"]] == [r["metric"] for r in a.slices["time_of_day"]]
    intervals = [(r["ci_low"], r["ci_high"]) for r in a.slices["time_of_day"]]
    assert [(r["ci_low"], r["ci_high"]) for r in c.slices["time_of_day"]] != intervals


def test_slices_of_a_few_images_and_the_errors(kit: ModelKit, camera_dataset: Path, tmp_path: Path) -> None:
    # 12 images spread over the split: slices under 5 images get no interval and come last.
    small = evaluate_model(
        kit.ref,
        EvalOptions(
            dataset=camera_dataset, split="val", slices=("time_of_day",), max_images=12, slice_resamples=50
        ),
        settings=kit.settings,
    )
    assert small.slices is not None
    rows = small.slices["time_of_day"]
    assert sum(r["images"] for r in rows) == 12
    sized = [r["images"] >= 5 for r in rows]
    assert sized == sorted(sized, reverse=True)  # those with an interval first
    for r in rows:
        assert (r["ci_low"] is None) == (r["images"] < 5)

    with pytest.raises(SpecError) as e:
        evaluate_model(kit.ref, EvalOptions(dataset=camera_dataset, slices=("lens",)), settings=kit.settings)
    assert "no metadata column 'lens'" in str(e.value) and "camera, time_of_day" in str(e.value)
    # The model's own dataset was ingested without metadata: say how to get some.
    with pytest.raises(DataError) as e2:
        evaluate_model(kit.ref, EvalOptions(slices=("camera",)), settings=kit.settings)
    assert "has no per-image metadata" in str(e2.value) and "CSV with extra columns" in str(e2.value)
    with pytest.raises(SpecError, match="names a column twice"):
        evaluate_model(kit.ref, EvalOptions(slices=("camera", "camera")), settings=kit.settings)
    # A column with a value per image is an id, not a slice.
    ids = tmp_path / "ids"
    shutil.copytree(camera_dataset, ids)
    m = json.loads((ids / "dataset.json").read_text())
    lines = (ids / "metadata" / "val.jsonl").read_text().splitlines()
    m["metadata_columns"] = ["camera", "time_of_day", "frame"]
    (ids / "dataset.json").write_text(json.dumps(m))
    (ids / "metadata" / "val.jsonl").write_text(
        "".join(
            line[:-1] + ("," if line != "{}" else "") + f'"frame":{k}}}\n' for k, line in enumerate(lines)
        )
    )
    with pytest.raises(SpecError, match="359 distinct values of 'frame', more than the 50"):
        evaluate_model(kit.ref, EvalOptions(dataset=ids, slices=("frame",)), settings=kit.settings)


def test_cli_prints_a_table_per_column(kit: ModelKit, camera_dataset: Path) -> None:
    env = {**kit.env(), "COLUMNS": "200"}
    r = cli(
        "eval", "digits", "--dataset", str(camera_dataset), "--split", "val",
        "--slices", "camera,time_of_day", "--slice-resamples", "100", env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "accuracy by camera (worst first; 95% bootstrap interval, 100 resamples)" in out
    assert "accuracy by time_of_day" in out and "(missing)" in out
    rows = [line for line in out.splitlines() if line.startswith("│ ")]
    first = next(line for line in rows if any(c in line for c in ("sideways", "north", "south")))
    assert "sideways" in first  # worst first
    assert " – " in first and "eval.json" in out

    r = cli(
        "eval", "digits", "--dataset", str(camera_dataset), "--slices", "camera", "--max-images", "120",
        "--json", env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["slices"]["camera"][0]["value"] == "sideways"
    assert {"value", "images", "metric", "ci_low", "ci_high", "resampled"} == set(doc["slices"]["camera"][0])

    r = cli("eval", "digits", "--dataset", str(camera_dataset), "--slices", "lens", env=env)
    assert r.returncode == 2 and "no metadata column 'lens'" in r.stderr and "camera, time_of_day" in r.stderr
    assert "Traceback" not in r.stderr
