"""The Label Studio round trip's pieces, per task: labelling configs, pre-annotations from
served answers, annotations read back, the folders written for ingest (read by the real
ingest), the export file's rules, and the QA (Fleiss' kappa, contradictions)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from visionloop.core.errors import DataError
from visionloop.data.ingest import IngestOptions, ingest
from visionloop.data.manifest import read_manifest
from visionloop.label.qa import agreement, contradictions
from visionloop.label.studio import ID_KEY, image_path, read_tasks
from visionloop.tasks import get_task
from visionloop.tasks.labels import ImageLabels, LabelledImage
from visionloop.tasks.serving import ImageContext

CLS = get_task("classification")
DET = get_task("detection")


def _png(path: Path, w: int = 40, h: int = 30, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return path


@pytest.mark.parametrize(
    ("task", "control", "item"), [(CLS, "Choices", "Choice"), (DET, "RectangleLabels", "Label")]
)
def test_the_config_names_every_class_once_and_escapes_them(task: object, control: str, item: str) -> None:
    names = ["cat", 'a "quoted" <b>', "dog & co"]
    root = ET.fromstring(task.labelling_config(names))  # type: ignore[attr-defined]
    ctl = root.find(control)
    assert ctl is not None and ctl.get("name") == "label" and ctl.get("toName") == "image"
    assert [e.get("value") for e in ctl.findall(item)] == names
    assert root.find("Image").get("value") == "$image"  # type: ignore[union-attr]


def test_a_classifier_pre_annotates_its_top_class_and_reads_the_choice_back() -> None:
    served = {
        "predictions": [{"label": "7", "index": 7, "score": 0.93}, {"label": "1", "index": 1, "score": 0.05}]
    }
    result, score = CLS.pre_annotation(served, ImageContext(16, 16, 16, 16))
    assert score == pytest.approx(0.93)
    assert result == [
        {
            "from_name": "label",
            "to_name": "image",
            "type": "choices",
            "value": {"choices": ["7"]},
            "score": 0.93,
        }
    ]
    assert CLS.read_labels(result, ["1", "7"]) == ImageLabels(classes=("7",))
    assert CLS.read_labels([], ["1", "7"]) is None  # nothing chosen: not labelled
    with pytest.raises(DataError, match="several classes"):
        CLS.read_labels([{"type": "choices", "value": {"choices": ["1", "7"]}}], None)
    with pytest.raises(DataError, match="not one of the model's classes"):
        CLS.read_labels(result, ["1", "2"])


def test_a_detector_pre_annotates_in_percent_clipped_and_reads_the_boxes_back() -> None:
    served = {
        "detections": [
            {"label": "car", "index": 0, "score": 0.9, "box": [20.0, 10.0, 120.0, 60.0]},
            {"label": "dog", "index": 1, "score": 0.5, "box": [150.0, 50.0, 260.0, 140.0]},  # past the edge
            {"label": "dog", "index": 1, "score": 0.4, "box": [300.0, 10.0, 320.0, 20.0]},  # outside: dropped
        ]
    }
    result, score = DET.pre_annotation(
        served, ImageContext(width=200, height=100, input_height=64, input_width=64)
    )
    assert score == pytest.approx((0.9 + 0.5) / 2)
    assert [r["value"]["rectanglelabels"] for r in result] == [["car"], ["dog"]]
    v0, v1 = result[0]["value"], result[1]["value"]
    assert (v0["x"], v0["y"], v0["width"], v0["height"]) == (10.0, 10.0, 50.0, 50.0)
    assert (v1["x"], v1["y"], v1["width"], v1["height"]) == (75.0, 50.0, 25.0, 50.0)
    assert all(r["original_width"] == 200 and r["original_height"] == 100 for r in result)
    labels = DET.read_labels(result, ["car", "dog"])
    assert labels == ImageLabels(
        classes=("car", "dog"), boxes=((10.0, 10.0, 50.0, 50.0), (75.0, 50.0, 25.0, 50.0))
    )
    assert DET.read_labels([], ["car"]) == ImageLabels(classes=(), boxes=())  # background image
    rotated = [{**result[0], "value": {**v0, "rotation": 15}}]
    with pytest.raises(DataError, match="rotated"):
        DET.read_labels(rotated, None)
    with pytest.raises(DataError, match="not a number"):
        DET.read_labels([{**result[0], "value": {**v0, "x": "10"}}], None)


def test_classification_labels_become_an_image_folder_the_real_ingest_reads(tmp_path: Path) -> None:
    src = tmp_path / "pool"
    items = [
        LabelledImage(f"sub/{i}.png", _png(src / "sub" / f"{i}.png", seed=i), ImageLabels((c,)), "ann")
        for i, c in enumerate(["cat", "dog", "cat", "dog", "cat", "dog"])
    ]
    out = CLS.write_labelled(items, tmp_path / "labelled")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*.png")) == [
        "cat/sub__0.png", "cat/sub__2.png", "cat/sub__4.png",
        "dog/sub__1.png", "dog/sub__3.png", "dog/sub__5.png",
    ]  # fmt: skip
    ingest(out, tmp_path / "ds", IngestOptions(val_fraction=0.0, seed=0, workers=1))
    manifest = read_manifest(tmp_path / "ds")
    assert manifest.classes == ["cat", "dog"]
    assert sum(s.count for s in manifest.splits.values()) == 6


def test_detection_labels_become_a_label_studio_export_the_real_ingest_reads(tmp_path: Path) -> None:
    src = tmp_path / "pool"
    boxes = ((10.0, 10.0, 50.0, 50.0), (60.0, 20.0, 20.0, 40.0))
    items = [
        LabelledImage("a.png", _png(src / "a.png", 200, 100, 1), ImageLabels(("car", "dog"), boxes)),
        LabelledImage("b/c.png", _png(src / "b" / "c.png", 200, 100, 2), ImageLabels(("car",), boxes[:1])),
        LabelledImage("empty.png", _png(src / "empty.png", 200, 100, 3), ImageLabels((), ())),
    ]
    out = DET.write_labelled(items, tmp_path / "labelled")
    doc = json.loads((out / "export.json").read_text())
    assert [t["data"][ID_KEY] for t in doc] == ["a.png", "b/c.png", "empty.png"]
    report = ingest(out, tmp_path / "ds", IngestOptions(val_fraction=0.0, seed=0, workers=1))
    manifest = read_manifest(tmp_path / "ds")
    assert manifest.task == "detection" and manifest.classes == ["car", "dog"]
    assert sum(s.count for s in manifest.splits.values()) == 3, report
    # The boxes went in at the right place: a.png's car is (20, 10)-(120, 60) in pixels.
    from visionloop.data.manifest import shard_dir_of
    from visionloop.data.shards import ShardReader

    records = []
    for info in manifest.splits.values():
        reader = ShardReader(shard_dir_of(tmp_path / "ds", info))
        records += reader.read_many(list(range(len(reader))))
    per_image = sorted(DET.record_targets(records, image_size=200), key=lambda t: -len(t["labels"]))
    first = per_image[0]
    assert first["labels"].tolist() == [0, 1]
    assert np.allclose(first["boxes"][0].numpy(), [20, 10, 120, 60], atol=0.5)


def _task(
    tid: int, image: str, *anns: dict[str, object], prediction: list[object] | None = None
) -> dict[str, object]:
    task: dict[str, object] = {
        "id": tid,
        "data": {"image": "data:...", ID_KEY: image},
        "annotations": list(anns),
    }
    if prediction is not None:
        task["predictions"] = [{"model_version": "m/1", "score": 0.9, "result": prediction}]
    return task


def _choice(name: str, who: str = "a@x", **kw: object) -> dict[str, object]:
    return {
        "completed_by": {"email": who},
        "result": [{"type": "choices", "value": {"choices": [name]}}],
        **kw,
    }


def test_the_annotation_that_counts_is_ground_truth_else_the_last_not_cancelled() -> None:
    doc = [
        _task(1, "x.png", _choice("cat", "a"), _choice("dog", "b")),
        _task(2, "y.png", _choice("cat", "a", ground_truth=True), _choice("dog", "b")),
        _task(3, "z.png", _choice("cat", "a"), _choice("dog", "b", was_cancelled=True)),
        _task(4, "w.png"),
        {"id": 5, "data": {"image": "/data/upload/1/abc-v.png"}, "annotations": [_choice("cat")]},
    ]
    tasks, left_out = read_tasks(doc, "export.json")
    assert [t.image_id for t in tasks] == ["x.png", "y.png", "z.png", "w.png"]
    chosen = [t.chosen() for t in tasks]
    assert [c.annotator if c else None for c in chosen] == ["b", "a", "a", None]
    assert left_out == [f"task 5: no data.{ID_KEY} (not a task `visionloop label export` made)"]
    with pytest.raises(DataError, match="not a list of tasks"):
        read_tasks({"tasks": []}, "export.json")


@pytest.mark.parametrize("bad", ["../outside.png", "/etc/passwd", "a/../../b.png", "."])
def test_an_image_id_cannot_leave_the_folder(tmp_path: Path, bad: str) -> None:
    with pytest.raises(DataError, match="not a path inside"):
        image_path(tmp_path, bad)
    assert image_path(tmp_path, "ok/x.png") == (tmp_path / "ok" / "x.png").resolve()


def test_fleiss_kappa_per_class_matches_the_textbook_example() -> None:
    """Fleiss' (1971) example as Wikipedia gives it: 10 items, 14 raters, 5 categories,
    overall kappa 0.210, which is the p_j q_j weighted mean of the per-category kappas."""
    table = [
        [0, 0, 0, 0, 14], [0, 2, 6, 4, 2], [0, 0, 3, 5, 6], [0, 3, 9, 2, 0], [2, 2, 8, 1, 1],
        [7, 7, 0, 0, 0], [3, 2, 6, 3, 0], [2, 5, 3, 2, 2], [6, 5, 2, 1, 0], [0, 2, 2, 3, 7],
    ]  # fmt: skip
    names = ["1", "2", "3", "4", "5"]
    per_image = [[ImageLabels((names[j],)) for j, n in enumerate(row) for _ in range(n)] for row in table]
    found = agreement(per_image, names)
    p = np.array([sum(r[j] for r in table) for j in range(5)]) / 140
    kappas = np.array([a.kappa for a in found])
    assert float((p * (1 - p) * kappas).sum() / (p * (1 - p)).sum()) == pytest.approx(0.2099, abs=1e-4)
    assert [a.images for a in found] == [10] * 5 and [a.said for a in found] == [20, 28, 39, 21, 32]


def test_kappa_is_one_when_annotators_agree_and_none_when_a_class_never_appears() -> None:
    per_image = [
        [ImageLabels(("cat",)), ImageLabels(("cat",))],
        [ImageLabels(("dog",))] * 3,
        [ImageLabels(("cat",))],
    ]
    found = {a.label: a for a in agreement(per_image, ["cat", "dog", "bird"])}
    assert found["cat"].kappa == pytest.approx(1.0) and found["dog"].kappa == pytest.approx(1.0)
    assert found["bird"].kappa is None and found["cat"].images == 2  # the single-annotator image is left out
    # Two annotators who always disagree on a binary question: kappa below zero.
    split = [[ImageLabels(("cat",)), ImageLabels(("dog",))] for _ in range(4)]
    assert {a.label: a.kappa for a in agreement(split, ["cat", "dog"])}["cat"] == pytest.approx(-1.0)


def test_contradictions_flag_only_a_confident_model_overruled() -> None:
    pred = [{"type": "choices", "value": {"choices": ["7"]}, "score": 0.97}]
    model = ImageLabels(("7",))
    assert [c.model_label for c in contradictions("x", pred, model, ImageLabels(("1",)), "a")] == ["7"]
    assert contradictions("x", pred, model, ImageLabels(("7",)), "a") == []
    unsure = [{**pred[0], "score": 0.6}]
    assert contradictions("x", unsure, model, ImageLabels(("1",)), "a") == []
    boxes = ((10.0, 10.0, 20.0, 20.0), (50.0, 50.0, 10.0, 10.0))
    det_pred = [{"score": 0.95}, {"score": 0.3}]
    det_model = ImageLabels(("car", "dog"), boxes)
    moved = ImageLabels(("car",), ((40.0, 40.0, 20.0, 20.0),))  # IoU 0 with the model's car
    near = ImageLabels(("car",), ((11.0, 11.0, 20.0, 20.0),))
    found = contradictions("y", det_pred, det_model, moved, "b")
    assert [(c.model_label, c.annotated) for c in found] == [("car", ("car",))]
    assert contradictions("y", det_pred, det_model, near, "b") == []  # the unsure dog is not flagged


def test_a_task_without_labelling_support_says_so() -> None:
    from types import SimpleNamespace

    from visionloop.tasks.base import Task

    stub = SimpleNamespace(labelling_module="", name="segmentation")
    with pytest.raises(DataError, match="segmentation task has no Label Studio support"):
        Task._labelling(stub)  # type: ignore[arg-type]
    assert CLS.labelling_module.endswith("classification.labelling")
