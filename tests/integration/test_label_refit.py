"""`visionloop label issues --refit`: the registered version's own recipe trained once per fold
with that fold held out (`data.holdout`), each image predicted by the fold that never trained
on it, and the task's judge (cleanlab) over those predictions.

A classifier: the labels flipped on purpose in a copy of the session's digits dataset are
found (precision and recall against the flips). A detector (the native detector on rendered
digits, real ingest, real training): every image is predicted once by the right fold, the
report maps findings back to the records, a second run trains nothing again, and the CLI shows
each suspicious box with both labels."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from _mlflowkit import copy_migrated_store
from _modelkit import ModelKit, flip_labels, registered_model  # noqa: F401  (the session's model)
from _trainkit import cli
from visionloop.core.errors import DataError
from visionloop.core.settings import Settings
from visionloop.data.ingest import IngestOptions, ingest
from visionloop.data.manifest import read_manifest
from visionloop.data.sampler import holdout_positions
from visionloop.data.shards import ShardReader
from visionloop.label.issues import IssuesReport
from visionloop.label.refit import FoldRun, refit_issues
from visionloop.tasks.detection.synthetic import generate_detection_dataset

FLIPS = 24
Refitted = tuple[Path, IssuesReport, list[FoldRun]]
DET_IMAGES, DET_SIZE = 80, 32


# ---------------------------------------------------------------- classification


@pytest.fixture(scope="module")
def noisy(
    registered_model: ModelKit,  # noqa: F811  (the fixture imported above)
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[ModelKit, Path, dict[int, str]]:
    """The session model's dataset with FLIPS train labels changed (seeded), and each flipped
    record's true label, by record index."""
    kit = registered_model.copy_home(tmp_path_factory.mktemp("refit") / "home")
    dataset, truth = flip_labels(kit, tmp_path_factory.mktemp("refit-noisy"), FLIPS, seed=11)
    return kit, dataset, truth


def test_refit_finds_the_flipped_labels_of_a_classifier(
    noisy: tuple[ModelKit, Path, dict[int, str]], tmp_path: Path
) -> None:
    kit, dataset, truth = noisy
    report, runs = refit_issues(
        kit.ref, kit.settings, work_dir=tmp_path / "folds", folds=3, dataset=dataset, overrides=["epochs=8"]
    )
    n = read_manifest(dataset).splits["train"].count
    assert report.method == "refit" and report.images == n and report.folds == 3
    assert [r.held_out for r in runs] == [len(holdout_positions(n, 3, k, 0)) for k in range(3)]
    assert all(r.trained_images == n - r.held_out for r in runs)
    assert report.oof_metrics is not None and report.oof_accuracy == report.oof_metrics["accuracy"] > 0.5
    found = {i.index for i in report.issues}
    hits = found & set(truth)
    precision, recall = len(hits) / max(len(found), 1), len(hits) / len(truth)
    print(f"{len(found)} flagged, {len(hits)} of {len(truth)} flips: P {precision:.2f}, R {recall:.2f}")
    assert precision >= 0.8 and recall >= 0.6, (precision, recall, report.oof_metrics)
    names = read_manifest(dataset).classes
    given = {
        int(r["index"]): names[int(r["label"])]
        for r in map(ShardReader(dataset / "shards" / "train").__getitem__, range(n))
    }
    for i in report.issues:
        assert i.given == given[i.index] and i.suggested != i.given
        assert i.findings[0].kind == "wrong class" and i.findings[0].given == i.given
    assert sum(truth[i.index] == i.suggested for i in report.issues if i.index in truth) >= 0.8 * len(hits)


# ---------------------------------------------------------------- detection


@pytest.fixture(scope="module")
def detector(tmp_path_factory: pytest.TempPathFactory) -> tuple[Settings, str, Path]:
    """A registered native detector on rendered digits (two classes, one digit an image)."""
    from visionloop.registry import register
    from visionloop.specs import load_train_spec
    from visionloop.train.api import train

    root = tmp_path_factory.mktemp("refit-det")
    generate_detection_dataset(
        root / "source",
        DET_IMAGES,
        image_size=DET_SIZE,
        seed=0,
        classes=(1, 7),
        max_objects=1,
        digit_size=(16, 28),
        background_fraction=0.0,
    )
    ingest(root / "source", root / "ds", IngestOptions(val_fraction=0.2, seed=0, workers=1))
    home = root / "home"
    copy_migrated_store(tmp_path_factory, home)
    settings = Settings(home=home, tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    doc: dict[str, Any] = {
        "task": "detection",
        "data": {
            "dataset": str(root / "ds"),
            "batch_size": 4,
            "workers": 0,
            "image_size": DET_SIZE,
            "augment": {"hflip": 0.0, "random_resized_crop": False},
        },
        "model": {"arch": "native_detector", "kwargs": {"widths": [8, 16, 16, 24], "neck": 16}},
        "optimizer": {"name": "adamw", "lr": 0.01},
        "schedule": {"name": "cosine", "warmup_steps": 1},
        "epochs": 2,
        "seed": 0,
        "deterministic": True,
        "checkpoint": {"every_steps": 1000, "keep_last": 1},
        "tracking": {"enabled": False},
    }
    (root / "det.yaml").write_text(yaml.safe_dump(doc))
    spec, resolved = load_train_spec(root / "det.yaml")
    result = train(spec, root / "run", resolved=resolved, settings=settings, track=False)
    assert result.exit_code == 0
    info = register(root / "run", name="digit-det", settings=settings)
    return settings, info.ref, root / "ds"


@pytest.fixture(scope="module")
def refitted(detector: tuple[Settings, str, Path], tmp_path_factory: pytest.TempPathFactory) -> Refitted:
    """The detector's two folds, trained once for the module (the CLI finds them finished)."""
    settings, ref, _ = detector
    work = tmp_path_factory.mktemp("refit-folds")
    report, runs = refit_issues(ref, settings, work_dir=work, folds=2, overrides=["epochs=6"])
    return work, report, runs


def test_every_image_of_a_detector_is_predicted_by_the_fold_that_left_it_out(
    detector: tuple[Settings, str, Path], refitted: Refitted
) -> None:
    settings, ref, dataset = detector
    work, report, runs = refitted
    reader = ShardReader(dataset / "shards" / "train")
    n = len(reader)
    assert report.images == n and report.method == "refit" and report.dataset == str(dataset)
    for k, run in enumerate(runs):
        held = holdout_positions(n, 2, k, 0)
        assert run.held_out == len(held) and run.trained_images == n - len(held)
        meta = yaml.safe_load((Path(run.run_dir) / "spec.resolved.yaml").read_text())
        assert meta["data"]["holdout"] == {"folds": 2, "fold": k, "seed": 0} and meta["epochs"] == 6
    # The judge's own figures over the out-of-fold boxes, and each finding tied to its record.
    assert report.oof_metrics is not None and set(report.oof_metrics) >= {"mAP", "mAP50"}
    assert report.oof_accuracy is None
    qualities = [i.given_probability for i in report.issues]
    assert qualities == sorted(qualities)
    for issue in report.issues:
        record = reader[issue.position]
        assert int(record["index"]) == issue.index and issue.suggested_probability is None
        assert issue.findings and {f.kind for f in issue.findings} <= {
            "overlooked",
            "swapped",
            "badly located",
        }
        for f in issue.findings:
            assert (f.given_box is None) == (f.kind == "overlooked")

    # Again: the finished folds are not trained again, and the answer is the same.
    weights = [Path(r.run_dir) / "final.safetensors" for r in runs]
    stamps = [w.stat().st_mtime_ns for w in weights]
    again, _ = refit_issues(ref, settings, work_dir=work, folds=2, overrides=["epochs=6"])
    assert [w.stat().st_mtime_ns for w in weights] == stamps
    assert again.issues == report.issues and again.oof_metrics == report.oof_metrics


def test_the_cli_shows_suspicious_boxes_and_writes_a_review(
    detector: tuple[Settings, str, Path], refitted: Refitted, tmp_path: Path
) -> None:
    settings, ref, _ = detector
    work, report, _ = refitted
    env = {"VISIONLOOP_HOME": str(settings.home), "VISIONLOOP_TRACKING_URI": settings.tracking_uri}
    args = ["label", "issues", ref, "--folds", "2", "--set", "epochs=6", "--work-dir", str(work)]
    r = cli(*args, "--json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)  # nothing but the report on stdout (cleanlab's chatter kept off it)
    assert doc["method"] == "refit" and [f["fold"] for f in doc["fold_runs"]] == [0, 1]
    assert [i["index"] for i in doc["issues"]] == [i.index for i in report.issues]
    r = cli(*args, env=env)
    assert r.returncode == 0, r.stderr
    assert f"{len(doc['issues'])} likely label errors in {doc['images']} train images" in r.stdout
    assert "2 trainings of digit-det/1's recipe, out-of-fold mAP" in r.stdout
    # The table (its columns for boxes) is there exactly when something was flagged.
    assert ("quality" in r.stdout and "why" in r.stdout) == bool(doc["issues"])

    # A review budget: the 5 least likely images, flagged or not, each with where to look.
    r = cli(*args, "--top", "5", "--out", str(tmp_path / "review"), env=env)
    assert r.returncode == 0, r.stderr
    assert f"5 least likely labels (--top 5) in {doc['images']} train images" in r.stdout
    assert "quality" in r.stdout and "why" in r.stdout
    review = json.loads((tmp_path / "review" / "issues.json").read_text())
    selection = json.loads((tmp_path / "review" / "selection.json").read_text())
    assert len(review["issues"]) == len(selection["chosen"]) == 5
    qualities = [i["given_probability"] for i in review["issues"]]
    assert qualities == sorted(qualities)
    for issue, chosen in zip(review["issues"], selection["chosen"], strict=True):
        assert chosen["reason"].startswith(f"labelled {issue['given']}, out-of-fold {issue['suggested']}")
        assert issue["findings"] and all(f["kind"] in r.stdout for f in issue["findings"])
        data = Path(issue["image"]).read_bytes()  # the stored image, for Label Studio
        assert data.startswith((b"\x89PNG", b"\xff\xd8"))


def test_refit_refuses_what_it_cannot_do(detector: tuple[Settings, str, Path], tmp_path: Path) -> None:
    settings, ref, _ = detector
    with pytest.raises(DataError, match="--folds must be 2 to 20"):
        refit_issues(ref, settings, work_dir=tmp_path, folds=1)
    env = {"VISIONLOOP_HOME": str(settings.home), "VISIONLOOP_TRACKING_URI": settings.tracking_uri}
    r = cli("label", "issues", ref, "--split", "val", env=env)
    assert r.returncode != 0 and "judges the whole train split" in r.stderr and "Traceback" not in r.stderr
    r = cli(
        "label",
        "issues",
        ref,
        "--folds",
        "2",
        "--set",
        "epochs=0",
        "--work-dir",
        str(tmp_path / "x"),
        env=env,
    )
    assert r.returncode != 0 and "epochs" in r.stderr and "Traceback" not in r.stderr
    assert not list(tmp_path.glob("x/fold-*/final.safetensors"))
