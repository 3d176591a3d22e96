"""`visionloop eval` on a really trained and registered model: clean metrics, stress,
calibration and the stored temperature, through the library and as a user runs it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from _modelkit import ModelKit, registered_model  # noqa: F401  (session fixture)
from _trainkit import cli
from visionloop.core.errors import DataError, SpecError
from visionloop.eval.api import evaluate_model
from visionloop.eval.options import EvalOptions
from visionloop.registry.evals import CALIBRATION_FILE, list_evals, read_temperature


@pytest.fixture(scope="module")
def kit(registered_model: ModelKit, tmp_path_factory: pytest.TempPathFactory) -> ModelKit:  # noqa: F811
    return registered_model.copy_home(tmp_path_factory.mktemp("eval") / "home")


def test_clean_eval_matches_training_and_stores_a_temperature(kit: ModelKit) -> None:
    info = kit.info()
    report = evaluate_model(kit.ref, EvalOptions(), settings=kit.settings)
    # The same images (the model's own val split) through the served preprocessing: the
    # accuracy training measured at its last evaluation.
    assert report.split == "val" and report.same_data_as_training
    assert report.images == 359
    assert report.metric == "accuracy"
    trained = info.card().metrics
    assert trained is not None
    assert report.clean == pytest.approx(trained["accuracy"], abs=1 / 359 + 1e-9)
    assert report.clean_metrics["accuracy"] == report.clean and report.clean_metrics["loss"] > 0
    c = report.calibration
    assert c is not None
    assert 0 <= c["ece"] <= 1 and 0 <= c["brier"] <= 2 and c["mce"] >= c["ece"]
    assert sum(b["count"] for b in c["bins"]) == 359
    assert c["temperature"] > 0 and c["stored"] is True and 0 <= c["ece_after"] <= 1
    # Stored with the version, where the server reads it.
    assert read_temperature(info.dir) == pytest.approx(c["temperature"])
    stored = json.loads((info.dir / CALIBRATION_FILE).read_text())
    assert stored["fitted_on"] == {"dataset_version": report.dataset_version, "split": "val", "images": 359}
    # The report and its plots, listed with the version.
    written = json.loads(Path(report.path).read_text())
    assert written["clean"] == report.clean and written["stress"] == []
    names = {Path(p).name for p in report.files}
    assert {"reliability.png", "confusion_matrix.png"} <= names
    assert all(Path(p).stat().st_size > 1000 for p in report.files)
    assert [e["path"] for e in list_evals(info.dir)][-1] == report.path


def test_stress_is_seeded_and_severity_hurts(kit: ModelKit) -> None:
    opts = EvalOptions(
        stress=True, corruptions=("gaussian_noise", "pixelate"), severities=(1, 5), max_images=120, seed=3
    )
    a = evaluate_model(kit.ref, opts, settings=kit.settings)
    b = evaluate_model(kit.ref, opts, settings=kit.settings)
    assert a.images == 120
    grid = {(c.corruption, c.severity): c.value for c in a.stress}
    assert set(grid) == {("gaussian_noise", 1), ("gaussian_noise", 5), ("pixelate", 1), ("pixelate", 5)}
    # Reproducible: the same seed corrupts the same images the same way.
    assert [c.value for c in a.stress] == [c.value for c in b.stress]
    assert [c.ece for c in a.stress] == [c.ece for c in b.stress]
    for name in ("gaussian_noise", "pixelate"):
        assert grid[(name, 5)] < a.clean - 0.05, (name, grid, a.clean)  # the worst case hurts
        assert grid[(name, 5)] <= grid[(name, 1)]
    by_name = {s.corruption: s for s in a.corruptions}
    noise = by_name["gaussian_noise"]
    assert noise.severities == (1, 5)
    assert noise.mean == pytest.approx((grid[("gaussian_noise", 1)] + grid[("gaussian_noise", 5)]) / 2)
    assert noise.drop_points == pytest.approx((a.clean - noise.mean) * 100)
    if a.clean < 1.0:
        clean_error = 1 - a.clean
        assert noise.relative_error == pytest.approx((1 - noise.mean) / clean_error)
    assert a.stress_mean == pytest.approx(float(np.mean(list(grid.values()))))
    assert Path(a.path).parent.joinpath("stress.png").stat().st_size > 1000
    # Another seed draws other noise: another result on at least one cell.
    c = evaluate_model(kit.ref, EvalOptions(**{**opts.__dict__, "seed": 4}), settings=kit.settings)
    assert [x.metrics["loss"] for x in c.stress] != [x.metrics["loss"] for x in a.stress]


def test_other_splits_and_datasets(kit: ModelKit, tmp_path: Path) -> None:
    info = kit.info()
    before = (info.dir / CALIBRATION_FILE).read_bytes() if (info.dir / CALIBRATION_FILE).exists() else None
    train = evaluate_model(kit.ref, EvalOptions(split="train", max_images=200), settings=kit.settings)
    assert train.split == "train" and train.images == 200
    assert train.calibration is not None and train.calibration["stored"] is False
    assert "not stored" in (train.calibration_note or "")
    after = (info.dir / CALIBRATION_FILE).read_bytes() if (info.dir / CALIBRATION_FILE).exists() else None
    assert after == before  # a train-split eval leaves the served temperature alone

    # A copy of the dataset elsewhere: any dataset with the model's classes is accepted.
    moved = tmp_path / "moved"
    shutil.copytree(kit.dataset, moved)
    report = evaluate_model(kit.ref, EvalOptions(dataset=moved, max_images=50), settings=kit.settings)
    assert report.dataset == str(moved) and report.images == 50

    # One with other classes is refused, naming both.
    manifest = json.loads((moved / "dataset.json").read_text())
    manifest["classes"] = [f"c{i}" for i in range(len(manifest["classes"]))]
    (moved / "dataset.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="has classes"):
        evaluate_model(kit.ref, EvalOptions(dataset=moved), settings=kit.settings)
    with pytest.raises(SpecError, match="unknown corruption 'rain'"):
        evaluate_model(kit.ref, EvalOptions(stress=True, corruptions=("rain",)), settings=kit.settings)
    with pytest.raises(SpecError, match="severities are 1 to 5"):
        evaluate_model(kit.ref, EvalOptions(stress=True, severities=(6,)), settings=kit.settings)


def test_cli_as_a_user_runs_it(kit: ModelKit) -> None:
    env = kit.env()
    r = cli(
        "eval", "digits", "--stress", "--corruptions", "night,occlusion", "--severities", "2,4",
        "--max-images", "60", env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "digits/1 on" in out and "[val], 60 images" in out
    assert "calibration: ECE" in out and "temperature" in out
    assert "night" in out and "occlusion" in out and "sev 2" in out and "sev 4" in out
    assert "stress mean" in out and "eval.json" in out

    r = cli("eval", "digits", "--max-images", "60", "--json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["model"] == "digits/1" and doc["images"] == 60 and doc["stress"] == []

    # `models show` lists the evaluations with their headline figures.
    r = cli("models", "show", "digits", env=env)
    assert r.returncode == 0, r.stderr
    report_dir = Path(doc["path"]).parent
    assert "evaluations" in r.stdout and report_dir.name in r.stdout and "(stored)" in r.stdout
    assert f"{report_dir.parent}/<report>/eval.json" in r.stdout
    r = cli("models", "show", "digits", "--json", env=env)
    shown = json.loads(r.stdout)["evals"]
    assert shown[-1]["path"] == doc["path"] and shown[-1]["clean"] == doc["clean"]
    assert shown[-1]["temperature"] == doc["calibration"]["temperature"] and shown[-1]["stored"] is True

    r = cli("eval", "digits", "--stress", "--corruptions", "rain", env=env)
    assert r.returncode == 2 and "unknown corruption 'rain'" in r.stderr and "night" in r.stderr
    r = cli("eval", "digits", "--severities", "one", env=env)
    assert r.returncode == 2 and "--severities" in r.stderr
    r = cli("eval", "nosuch", env=env)
    assert r.returncode != 0 and "nosuch" in r.stderr and "Traceback" not in r.stderr


def test_the_evaluation_is_an_mlflow_run_linked_to_the_version(kit: ModelKit) -> None:
    from visionloop.eval.tracking import EXPERIMENT, VERSION_TAG
    from visionloop.track import store as track_store

    opts = EvalOptions(stress=True, corruptions=("night",), severities=(3,), max_images=80)
    report = evaluate_model(kit.ref, opts, settings=kit.settings)
    assert report.mlflow_run_id is not None
    assert json.loads(Path(report.path).read_text())["mlflow_run_id"] == report.mlflow_run_id
    client = track_store.client(kit.settings)
    run = client.get_run(report.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == EXPERIMENT
    tags = run.data.tags
    assert (tags["visionloop.model"], tags["visionloop.model_version"]) == ("digits", "1")
    assert tags["visionloop.dataset_version"] == report.dataset_version and tags["visionloop.split"] == "val"
    metrics = run.data.metrics
    assert metrics["clean/accuracy"] == pytest.approx(report.clean)
    assert metrics["stress/accuracy_mean"] == pytest.approx(report.stress_mean)
    assert metrics["stress/night/accuracy_mean"] == pytest.approx(report.stress[0].value)
    assert report.calibration is not None
    assert metrics["calibration/ece"] == pytest.approx(report.calibration["ece"])
    names = {a.path for a in client.list_artifacts(report.mlflow_run_id)}
    assert {"eval.json", "stress.png", "reliability.png"} <= names
    version = client.get_model_version("digits", "1")
    assert version.tags[VERSION_TAG] == report.mlflow_run_id
    # --no-track: the report only.
    quiet = evaluate_model(kit.ref, EvalOptions(max_images=60, track=False), settings=kit.settings)
    assert quiet.mlflow_run_id is None
    assert client.get_model_version("digits", "1").tags[VERSION_TAG] == report.mlflow_run_id
