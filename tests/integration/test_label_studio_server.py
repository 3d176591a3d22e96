"""The Label Studio round trip against a real Label Studio server on loopback (the
`label-studio` package, in its own virtual environment: it pins its own Django stack; `.ci/run`
installs it and names its executable in VISIONLOOP_TEST_LABEL_STUDIO).

A scripted annotator does what people do in the browser, through Label Studio's own API: labels
every task, a second annotator labels some of them again (one disagreement), one annotation is
marked ground truth and one deliberately contradicts a confident model. Classification goes
through the CLI as a user runs it (`label select` → `label export --to` → annotate →
`label import --from` → `data ingest`); detection through the library with the detector's own
config and pre-annotations (no detection model is trained for this test)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from _lskit import Server, annotate, choice, label_studio, project_tasks, user
from _modelkit import ModelKit, onnx_model
from _trainkit import cli
from visionloop.data.ingest import IngestOptions, ingest
from visionloop.data.manifest import read_manifest, shard_dir_of
from visionloop.data.shards import ShardReader
from visionloop.label.importer import import_annotations
from visionloop.label.studio import ID_KEY
from visionloop.label.studio_client import LabelStudio
from visionloop.tasks import get_task
from visionloop.tasks.serving import ImageContext

__all__ = ["label_studio", "onnx_model"]


def test_classification_round_trip_from_the_cli(
    label_studio: Server, onnx_model: ModelKit, tmp_path: Path
) -> None:
    kit = onnx_model.copy_home(tmp_path / "home")
    manifest = read_manifest(kit.dataset)
    reader = ShardReader(shard_dir_of(kit.dataset, manifest.splits["val"]))
    src = tmp_path / "unlabelled"
    truth: dict[str, str] = {}
    for i, record in enumerate(reader.read_many(list(range(40)))):
        name = f"cam{i % 2}/img-{i:02d}.png"
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(bytes(record["image"]))
        truth[name] = manifest.classes[int(record["label"])]
    env = {**kit.env(), "LABEL_STUDIO_API_KEY": label_studio.token}

    sel = tmp_path / "selection.json"
    r = cli("label", "select", kit.name, "--from", str(src), "--budget", "12", "--out", str(sel), env=env)
    assert r.returncode == 0, r.stderr
    chosen = [c["id"] for c in json.loads(sel.read_text())["chosen"]]
    assert len(chosen) == 12

    r = cli("label", "export", str(sel), "--to", label_studio.url, "--title", "digits round 1", env=env)
    assert r.returncode == 0, r.stderr
    said = " ".join(r.stdout.split())
    project = int(re.search(r"project (\d+): 12 tasks imported", said).group(1))  # type: ignore[union-attr]
    assert f"pre-annotated by {kit.ref}" in said and f"/projects/{project}" in said

    with label_studio.http() as http:
        config = http.get(f"/api/projects/{project}/").json()["label_config"]
        assert all(f'<Choice value="{c}"/>' in config for c in manifest.classes)
        tasks = project_tasks(http, project)
        assert sorted(t["data"][ID_KEY] for t in tasks) == sorted(chosen)
        # Every task carries the model's top class as its pre-annotation, with its probability.
        preds = {}
        for t in tasks:
            full = http.get(f"/api/tasks/{t['id']}/").json()
            (pred,) = full["predictions"]
            assert pred["model_version"] == kit.ref and 0 < pred["score"] <= 1
            preds[t["data"][ID_KEY]] = (pred["result"][0]["value"]["choices"][0], pred["score"])
        first, second = user(http, "ann1@example.com"), user(http, "ann2@example.com")
        by_id = {t["data"][ID_KEY]: t["id"] for t in tasks}
        # A confident prediction the first annotator overrules (wrongly): a contradiction.
        confident = sorted((i for i in chosen if preds[i][1] >= 0.9), key=lambda i: -preds[i][1])
        wrong = confident[0] if confident else None
        other = {
            c: manifest.classes[(manifest.classes.index(c) + 1) % len(manifest.classes)]
            for c in manifest.classes
        }
        for image_id in chosen[:-1]:  # the last task stays unlabelled
            label = other[truth[image_id]] if image_id == wrong else truth[image_id]
            annotate(http, by_id[image_id], choice(label), first)
        # The second annotator labels 4 images again: agrees on 3; on the 4th says another class
        # and is marked ground truth, so theirs is the label that counts.
        double = [i for i in chosen[:-1] if i != wrong][:4]
        for image_id in double[:3]:
            annotate(http, by_id[image_id], choice(truth[image_id]), second)
        annotate(http, by_id[double[3]], choice(other[truth[double[3]]]), second, ground_truth=True)
        # A cancelled (skipped) annotation is not a label.
        annotate(http, by_id[chosen[-1]], [], second, was_cancelled=True)

    out = tmp_path / "labelled"
    r = cli(
        "label", "import", "--from", label_studio.url, "--project", str(project),
        "--images", str(src), "--out", str(out), "--json", env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    expected = {i: truth[i] for i in chosen[:-1]}
    if wrong is not None:
        expected[wrong] = other[truth[wrong]]
    expected[double[3]] = other[truth[double[3]]]
    assert {img["id"]: img["classes"] for img in report["images"]} == {k: [v] for k, v in expected.items()}
    assert report["unlabelled"] == [chosen[-1]] and report["left_out"] == []
    assert report["annotators"] == ["ann1@example.com", "ann2@example.com"]  # ids turned into emails
    rated = {a["label"]: a for a in report["agreement"]}
    assert all(a["images"] == 4 for a in rated.values())
    disputed = {truth[double[3]], other[truth[double[3]]]}
    assert all(rated[c]["kappa"] is not None and rated[c]["kappa"] < 1 for c in disputed)
    flagged = {c["image_id"] for c in report["contradictions"]}
    if wrong is not None:
        assert wrong in flagged
    # What ends up on disk: an ImageFolder with the labels that count.
    files = {p.relative_to(out).as_posix() for p in out.rglob("*.png")}
    assert files == {f"{v}/{k.replace('/', '__')}" for k, v in expected.items()}
    assert (tmp_path / "labelled.visionloop-labels.json").is_file()

    # The same annotations from an export file (Export → JSON) give the same folder.
    with LabelStudio(label_studio.url, label_studio.token) as ls:
        (tmp_path / "export.json").write_text(json.dumps(ls.export(project)))
    again = tmp_path / "again"
    r = cli(
        "label", "import", str(tmp_path / "export.json"), "--images", str(src), "--out", str(again), env=env
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert {p.relative_to(again).as_posix() for p in again.rglob("*.png")} == files
    said = " ".join(r.stdout.split())
    assert (
        f"{len(expected)} images labelled by 2 annotator(s)" in said and "1 images not labelled yet" in said
    )
    if wrong is not None:
        assert "contradict a confident model" in said

    # And it is a dataset.
    r = cli("data", "ingest", str(out), "--out", str(tmp_path / "ds"), env=env)
    assert r.returncode == 0, r.stderr
    assert sum(s.count for s in read_manifest(tmp_path / "ds").splits.values()) == len(expected)

    # A refused token is named, and nothing is written.
    bad = {**env, "LABEL_STUDIO_API_KEY": "f" * 40}
    r = cli(
        "label", "import", "--from", label_studio.url, "--project", str(project),
        "--images", str(src), "--out", str(tmp_path / "never"), env=bad,
    )  # fmt: skip
    assert r.returncode != 0 and "refused the token" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "never").exists()


def test_detection_round_trip_through_the_server(label_studio: Server, tmp_path: Path) -> None:
    det = get_task("detection")
    classes = ["car", "person"]
    src = tmp_path / "frames"
    rng = np.random.default_rng(0)
    served: dict[str, dict[str, Any]] = {}
    tasks = []
    for i in range(5):
        name = f"frame-{i}.png"
        src.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)).save(src / name)
        served[name] = {
            "detections": [
                {"label": "car", "index": 0, "score": 0.95, "box": [10.0 + i, 20.0, 70.0 + i, 80.0]},
                {"label": "person", "index": 1, "score": 0.4, "box": [100.0, 10.0, 140.0, 100.0]},
            ]
        }
        pre, score = det.pre_annotation(served[name], ImageContext(160, 120, 64, 64))
        tasks.append(
            {
                "data": {"image": f"/data/local-files/?d={name}", ID_KEY: name},
                "predictions": [{"model_version": "det/1", "score": score, "result": pre}],
            }
        )
    with LabelStudio(label_studio.url, label_studio.token) as ls:
        project = ls.create_project("frames round 1", det.labelling_config(classes))
        assert ls.import_tasks(project, tasks) == 5
        with label_studio.http() as http:
            for t in project_tasks(http, project):
                name = t["data"][ID_KEY]
                full = http.get(f"/api/tasks/{t['id']}/").json()
                boxes = [dict(r) for r in full["predictions"][0]["result"]]
                if name == "frame-0.png":
                    boxes = []  # nothing there: a background image
                elif name == "frame-1.png":
                    boxes[0]["value"] = {**boxes[0]["value"], "x": 60.0}  # the confident car moved away
                for b in boxes:
                    b.pop("score", None)
                annotate(http, t["id"], boxes, 1)
        doc = ls.export(project)
    result = import_annotations(
        doc, f"project {project}", task=det, classes=classes, images=src, out_dir=tmp_path / "labelled"
    )
    assert len(result.labelled) == 5 and result.unlabelled == [] and result.left_out == []
    by_id = {i.id: i.labels for i in result.labelled}
    assert by_id["frame-0.png"].classes == () and by_id["frame-2.png"].classes == ("car", "person")
    # The boxes came back where the model put them: frame-2's car at (12, 20)-(72, 80) of 160x120.
    x, y, w, h = by_id["frame-2.png"].boxes[0]  # type: ignore[index]
    assert (x * 1.6, y * 1.2, (x + w) * 1.6, (y + h) * 1.2) == pytest.approx((12, 20, 72, 80), abs=0.01)
    # frame-0 (no car drawn) and frame-1 (car moved) contradict the confident car; the unsure
    # person is not flagged.
    assert sorted((c.image_id, c.model_label) for c in result.contradictions) == [
        ("frame-0.png", "car"), ("frame-1.png", "car")
    ]  # fmt: skip
    ingest(tmp_path / "labelled", tmp_path / "ds", IngestOptions(val_fraction=0.0, seed=0, workers=1))
    manifest = read_manifest(tmp_path / "ds")
    assert manifest.task == "detection" and manifest.classes == classes
    assert sum(s.count for s in manifest.splits.values()) == 5


def test_export_and_import_name_what_is_wrong(tmp_path: Path) -> None:
    sel = tmp_path / "selection.json"
    sel.write_text(json.dumps({"model": "digits/1", "source": str(tmp_path), "chosen": [{"id": "a.png"}]}))
    (tmp_path / "garbage.json").write_text("{not json")
    (tmp_path / "dict.json").write_text(json.dumps({"tasks": []}))
    env = {"LABEL_STUDIO_API_KEY": ""}
    cases = [
        (["export", str(sel)], "give --out DIR"),
        (["export", str(tmp_path / "missing.json"), "--out", str(tmp_path / "o1")],
         "cannot read the selection"),
        (["export", str(tmp_path / "dict.json"), "--out", str(tmp_path / "o2")], "is not a selection"),
        (["export", str(sel), "--to", "http://127.0.0.1:9"], "LABEL_STUDIO_API_KEY"),
        (["export", str(sel), "--out", str(tmp_path / "o3"), "--image-url", "s3://b/x"], "needs {path}"),
        (["import", "--images", str(tmp_path), "--out", str(tmp_path / "o4")], "give an export file"),
        (["import", str(tmp_path / "garbage.json"), "--images", str(tmp_path), "--out", str(tmp_path / "o5")],
         "is not a JSON file"),
        (["import", str(tmp_path / "dict.json"), "--images", str(tmp_path), "--out", str(tmp_path / "o6")],
         "not a list of tasks"),
        (["import", "--from", "http://127.0.0.1:9", "--images", str(tmp_path), "--out", str(tmp_path / "o7")],
         "--from needs --project"),
    ]  # fmt: skip
    for args, expected in cases:
        r = cli("label", *args, env=env)
        assert r.returncode != 0 and "Traceback" not in r.stderr, (args, r.stderr)
        assert expected in " ".join(r.stderr.split()), (args, r.stderr)
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 8))
