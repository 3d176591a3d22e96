"""A study over a detection train spec, through the real control plane (SQLite, the local
executor with fake GPUs, the real trainer running the native detector on rendered digits):
the objective defaults to the detection task's primary metric (val/mAP), both trials pause at
asha's rung after epoch 1 and report mAP there, the better one is promoted and completes from
its checkpoint, the other is pruned (job state "pruned"), and `visionloop tune show --json`
lists them with their jobs."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from optuna.trial import TrialState

import _warmcli
from _cpkit import CP, TEAMS, cluster_config, control_plane
from _dbkit import fresh_database
from visionloop.api.client import Client
from visionloop.data.ingest import IngestOptions, ingest
from visionloop.tasks.detection.synthetic import generate_detection_dataset
from visionloop.tune.spec import validate_tune_spec
from visionloop.tune.study import create_or_load, load
from visionloop.tune.tuner import JOB_ATTR, Tuner

TWO_GPUS = [{"node": "local", "type": "fake", "count": 2, "price_class": "owned"}]
# One class, one large digit per 32x32 image: with 72 training images in batches of 4 (18
# steps an epoch) a good learning rate already has a non-zero mAP after the first epoch,
# so asha's rung has something to judge; fewer steps leave every trial at exactly 0.
IMAGES, SIZE, BATCH = 96, 32, 4
GOOD_LR, BAD_LR = 0.01, 1e-5  # the bad one is the space's low end: no box found in 2 epochs


@pytest.fixture(scope="module")
def detection_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rendered digits (COCO json + PNGs) through the real detection ingest."""
    root = tmp_path_factory.mktemp("tune-det")
    generate_detection_dataset(
        root / "source",
        IMAGES,
        image_size=SIZE,
        seed=0,
        classes=(1,),
        max_objects=1,
        digit_size=(16, 28),
        background_fraction=0.0,
    )
    out = root / "ds"
    ingest(root / "source", out, IngestOptions(val_fraction=0.25, seed=0, workers=1))
    return out


@pytest.fixture
def cp_url(tmp_path: Path) -> Iterator[tuple[CP, str]]:
    cfg = cluster_config(inventory=TWO_GPUS, teams=TEAMS)
    with fresh_database("sqlite", tmp_path) as url, control_plane(url, cfg) as plane:
        yield plane, url


def tune_doc(dataset: Path) -> dict[str, Any]:
    train: dict[str, Any] = {
        "task": "detection",
        "data": {
            "dataset": str(dataset),
            "batch_size": BATCH,
            "workers": 0,
            "image_size": SIZE,
            "augment": {"hflip": 0.0},
        },
        # The native detector at its smallest useful width; a low score threshold so that an
        # early, unsure detector still has boxes for mAP to rank.
        "model": {
            "arch": "native_detector",
            "kwargs": {"widths": [8, 16, 16, 24], "neck": 16, "score_thresh": 0.001},
        },
        "optimizer": {"name": "adamw", "lr": GOOD_LR},
        "schedule": {"name": "cosine", "warmup_steps": 1},
        "epochs": 2,
        "seed": 0,
        "deterministic": True,
        "checkpoint": {"every_steps": 100, "keep_last": 1},
        "tracking": {"enabled": False},  # the study is checked through the queue, not MLflow
    }
    return {
        "name": "det-lr",
        "train": train,
        "space": {"optimizer.lr": {"loguniform": [BAD_LR, 0.1]}},
        "sampler": {"name": "random", "seed": 0},
        "pruner": {"name": "asha", "min_epochs": 1, "reduction_factor": 2},
        "trials": 2,
        "concurrency": 1,
        "job": {"team": "vision"},
    }


def _show(cp: CP, job_id: int) -> dict[str, Any]:
    with cp.client() as c:
        return dict(c.get(f"/v1/jobs/{job_id}").json())


def test_a_detection_study_promotes_the_better_map_and_prunes_the_other(
    cp_url: tuple[CP, str], detection_dataset: Path
) -> None:
    cp, url = cp_url
    spec = validate_tune_spec(tune_doc(detection_dataset), "tune.yaml")
    assert (spec.objective.metric, spec.objective.direction) == ("val/mAP", "max")  # the task's default
    study = create_or_load(spec, url)
    # The bad learning rate first: asha's quota at the rung (1 of 2) goes to the better mAP,
    # not to the lower trial number, which is what breaks a tie.
    study.enqueue_trial({"optimizer.lr": BAD_LR})
    study.enqueue_trial({"optimizer.lr": GOOD_LR})
    deadline = time.monotonic() + 400
    with Client(cp.url, cp.admin_token) as client:
        progress = Tuner(spec, study, client).run(poll_s=0.2, should_stop=lambda: time.monotonic() > deadline)
    assert progress.done and (progress.finished, progress.running, progress.paused) == (2, 0, 0)

    bad, good = load(spec.name, url).get_trials()
    assert (bad.params["optimizer.lr"], good.params["optimizer.lr"]) == (BAD_LR, GOOD_LR)
    # Both reported mAP at the rung; the good one also at the end, and that is its value.
    assert good.state == TrialState.COMPLETE, good.user_attrs
    assert sorted(good.intermediate_values) == [1, 2]
    assert good.value == good.intermediate_values[2] and 0.0 < good.value <= 1.0
    assert bad.state == TrialState.PRUNED, bad.user_attrs
    assert sorted(bad.intermediate_values) == [1]
    assert 0.0 <= bad.intermediate_values[1] < good.intermediate_values[1] <= 1.0
    assert "paused at epoch 1" in bad.user_attrs["end"]

    # Each trial is one queue job: the good one paused at the rung and went on from its
    # checkpoint; the bad one ended at the rung as pruned, neither failed nor cancelled.
    good_job = _show(cp, good.user_attrs[JOB_ATTR])
    assert good_job["job"]["state"] == "succeeded"
    assert [(a["outcome"], a["exit_code"]) for a in good_job["attempts"]] == [
        ("paused", 76),
        ("succeeded", 0),
    ]
    bad_job = _show(cp, bad.user_attrs[JOB_ATTR])
    assert bad_job["job"]["state"] == "pruned"
    assert [(a["outcome"], a["exit_code"]) for a in bad_job["attempts"]] == [("pruned", 76)]
    # The trainer's own record agrees with what the tuner reported: val/mAP at epoch 2.
    final = json.loads((Path(good_job["job"]["run_dir"]) / "model_card.json").read_text())["metrics"]
    assert final["mAP"] == pytest.approx(good.value)

    env = {**os.environ, "VISIONLOOP_API_URL": cp.url, "VISIONLOOP_TOKEN": cp.admin_token}
    shown = _warmcli.run(["tune", "show", spec.name, "--db", url, "--json"], env=env, timeout=120)
    assert shown.returncode == 0, shown.stderr[-3000:]
    out = json.loads(shown.stdout)
    assert (out["metric"], out["direction"]) == ("val/mAP", "maximize")
    rows = {t["number"]: t for t in out["trials"]}
    assert [(rows[n]["state"], rows[n]["job_state"], rows[n]["job_id"]) for n in (0, 1)] == [
        ("pruned", "pruned", bad.user_attrs[JOB_ATTR]),
        ("complete", "succeeded", good.user_attrs[JOB_ATTR]),
    ]
    assert rows[1]["value"] == pytest.approx(good.value)
    assert rows[0]["intermediate"] == {"1": pytest.approx(bad.intermediate_values[1])}
    assert rows[1]["intermediate"] == {str(k): pytest.approx(v) for k, v in good.intermediate_values.items()}
    assert out["best"]["number"] == 1
