"""`visionloop tune show` and `tune best` as a user runs them, on a study in a temporary SQLite
database whose trials were made with Optuna's ask/tell (no training), with no control plane
listening: the table, the best trial, the importances and the plots, and cost left out in
one line that says why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna

from _cpkit import free_port
from _trainkit import cli
from visionloop.tune.space import suggest
from visionloop.tune.spec import validate_tune_spec
from visionloop.tune.study import create_or_load
from visionloop.tune.tuner import JOB_ATTR

TUNE: dict[str, Any] = {
    "name": "cli-study",
    "train": {
        "data": {"dataset": "/ds", "batch_size": 32, "image_size": 16},
        "model": {"arch": "small_cnn"},
        "epochs": 3,
    },
    "space": {
        "optimizer.lr": {"loguniform": [1e-4, 1e-1]},
        "optimizer.weight_decay": {"uniform": [0.0, 0.1]},
    },
    "sampler": {"name": "random", "seed": 0},
    "pruner": {"name": "asha", "min_epochs": 1, "reduction_factor": 3},
    "trials": 3,
}
CURVES = {0: [0.3, 0.5, 0.6], 1: [0.4, 0.7, 0.9], 2: [0.2, 0.3, 0.35]}


def make_study(url: str) -> optuna.Study:
    spec = validate_tune_spec(TUNE, "tune.yaml", Path("/"))
    study = create_or_load(spec, url)
    for number, curve in CURVES.items():
        trial = study.ask()
        suggest(trial, spec.space)
        trial.set_user_attr(JOB_ATTR, 100 + number)
        for epoch, value in enumerate(curve, start=1):
            trial.report(value, epoch)
        study.tell(trial, curve[-1])
    return study


def test_show_prints_trials_best_importances_and_plots_and_says_why_cost_is_missing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    study = make_study(url)
    # A control plane address where nothing listens: the table still comes, without cost.
    env = {"VISIONLOOP_API_URL": f"http://127.0.0.1:{free_port()}", "VISIONLOOP_TOKEN": "t"}
    plots = tmp_path / "plots"
    r = cli("tune", "show", "cli-study", "--db", url, "--plots", str(plots), env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
        for line in lines
        if "│" in line
    }
    assert set(rows) == {"0", "1 *", "2"}  # the best is starred
    state, params, by_epoch, rungs, final, job = rows["1 *"]
    lr = study.trials[1].params["optimizer.lr"]
    assert state == "complete" and f"optimizer.lr={lr:.4g}" in params
    assert by_epoch == "1:0.4 2:0.7 3:0.9" and rungs == "1:0.4" and final == "0.9" and job == "101"
    assert "GPU-h" not in r.stdout  # no cost column without a control plane
    assert "best: trial 1 (val/accuracy 0.9), job 101: optimizer.lr=" in r.stdout
    assert "parameter importances: optimizer." in r.stdout
    note = [line for line in r.stderr.splitlines() if line.startswith("no cost shown:")]
    assert len(note) == 1 and "cannot reach the control plane" in note[0], r.stderr
    assert note[0].endswith("Start it with `visionloop up --detach`."), r.stderr  # one line, whole
    for name in ("optimization_history", "parallel_coordinate", "intermediate_values"):
        png = plots / f"cli-study-{name}.png"
        assert png.read_bytes()[:4] == b"\x89PNG", name
        assert f"plot {name}: {png}" in r.stdout
    assert "ExperimentalWarning" not in r.stderr

    j = cli("tune", "show", "cli-study", "--db", url, "--json", env=env, timeout=300)
    assert j.returncode == 0, j.stderr
    doc = json.loads(j.stdout)
    assert doc["best"]["number"] == 1 and doc["best"]["value"] == 0.9
    assert [t["intermediate"] for t in doc["trials"]] == [
        {str(e): v for e, v in enumerate(c, start=1)} for c in CURVES.values()
    ]
    assert [t["job_id"] for t in doc["trials"]] == [100, 101, 102]
    assert doc["counts"] == {"complete": 3} and doc["gpu_hours"] is None
    assert "cannot reach the control plane" in doc["cost_note"]
    assert set(doc["importances"]) == {"optimizer.lr", "optimizer.weight_decay"}


def test_best_prints_the_trial_and_refuses_what_it_cannot_register(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'state.db'}"
    env = {"VISIONLOOP_API_URL": f"http://127.0.0.1:{free_port()}", "VISIONLOOP_TOKEN": "t"}
    spec = validate_tune_spec(TUNE, "tune.yaml", Path("/"))
    create_or_load(spec, url)
    r = cli("tune", "best", "cli-study", "--db", url, env=env, timeout=300)
    assert r.returncode == 1 and "has no complete trial yet (no trials)" in " ".join(r.stderr.split())

    study = make_study(url)
    r = cli("tune", "best", "cli-study", "--db", url, "--json", env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    best = json.loads(r.stdout)
    assert (best["number"], best["value"], best["job_id"]) == (1, 0.9, 101)
    assert best["params"] == study.trials[1].params and best["run_dir"] is None

    bad = cli("tune", "best", "cli-study", "--db", url, "--register", "no spaces", env=env, timeout=300)
    assert bad.returncode == 2 and "model name 'no spaces' is not usable" in bad.stderr
    r = cli("tune", "best", "cli-study", "--db", url, "--register", "digits-best", env=env, timeout=300)
    message = " ".join(r.stderr.split())
    assert (
        r.returncode == 1
        and "cannot find the run directory of trial 1 of study 'cli-study' (job 101)" in message
    )
    assert "cannot reach the control plane" in message
