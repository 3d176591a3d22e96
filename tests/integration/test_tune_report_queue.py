"""`visionloop tune show` and `tune best --register` against the real control plane (SQLite,
the local executor with fake GPUs, the real trainer on digits): a trial's GPU-hours and cost
come from its job's ledger, its run directory from the job, and the best trial's model is
registered like a run; a best trial whose job stopped before its final model is refused."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest

import _warmcli
from _cpkit import CP, TEAMS, cluster_config, control_plane
from _cpkit import train_doc as _train
from _dbkit import fresh_database
from visionloop.api.client import Client
from visionloop.registry import get_version, parse_ref
from visionloop.sched.prices import load_catalog
from visionloop.tune.space import apply, suggest
from visionloop.tune.spec import TuneSpec, validate_tune_spec
from visionloop.tune.study import create_or_load
from visionloop.tune.tuner import JOB_ATTR, job_name

TWO_GPUS = [{"node": "local", "type": "fake", "count": 2, "price_class": "owned"}]


@pytest.fixture
def cp_url(tmp_path: Path) -> Iterator[tuple[CP, str]]:
    cfg = cluster_config(inventory=TWO_GPUS, teams=TEAMS)
    with fresh_database("sqlite", tmp_path) as url, control_plane(url, cfg) as plane:
        yield plane, url


def tune_spec(dataset: Path, name: str, epochs: int) -> TuneSpec:
    doc: dict[str, Any] = {
        "name": name,
        "train": _train(dataset, epochs=epochs, tracked=True),
        "space": {"optimizer.lr": {"loguniform": [1e-3, 1e-2]}},
        "sampler": {"name": "random", "seed": 0},
        "pruner": {"name": "none"},
        "trials": 1,
        "job": {"team": "vision"},
    }
    return validate_tune_spec(doc, "tune.yaml")


def start_trial(spec: TuneSpec, url: str, client: Client) -> tuple[optuna.Study, int, int]:
    """What the tuner does for one trial: ask, suggest, submit the trial's job, record it."""
    study = create_or_load(spec, url)
    trial = study.ask()
    job = spec.trial_job(apply(spec.train_doc(), suggest(trial, spec.space)), job_name(study, trial.number))
    job_id = int(client.submit(job.model_dump(mode="json", exclude_none=True))["id"])
    trial.set_user_attr(JOB_ATTR, job_id)
    return study, trial.number, job_id


def run_cli(cp: CP, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "VISIONLOOP_API_URL": cp.url,
        "VISIONLOOP_TOKEN": cp.admin_token,
        "VISIONLOOP_DB_URL": url,
    }
    return _warmcli.run(["tune", *args], env=env, timeout=300)


def test_show_has_each_trials_cost_and_best_registers_its_model(
    cp_url: tuple[CP, str], digits_dataset: Path
) -> None:
    cp, url = cp_url
    with Client(cp.url, cp.admin_token) as client:
        # A trial whose job is cancelled after its first checkpoint: no final model.
        stopped_spec = tune_spec(digits_dataset, "stopped", epochs=20)
        stopped, s_number, s_job = start_trial(stopped_spec, url, client)
        done_spec = tune_spec(digits_dataset, "done", epochs=1)
        done, d_number, d_job = start_trial(done_spec, url, client)
        deadline = time.monotonic() + 180
        while not client.job(s_job)["checkpoints"]:
            assert time.monotonic() < deadline, "the job wrote no checkpoint within 180 s"
            time.sleep(0.2)
        client.cancel(s_job)
        cp.wait_job(s_job, lambda j: j["state"] == "cancelled")
        stopped.tell(s_number, 0.5)  # as if it had completed: its job has no final model
        finished = cp.wait_job(d_job, lambda j: j["state"] in ("succeeded", "failed"), timeout=300)
        assert finished["job"]["state"] == "succeeded", finished
        run_dir = Path(finished["job"]["run_dir"])
        meta = json.loads((run_dir / "run.json").read_text())
        value = meta["final_metrics"]["accuracy"]
        done.tell(d_number, value)
        ledger = client.job(d_job)["cost"]["total"]

    r = run_cli(cp, url, "show", "done", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    (row,) = doc["trials"]
    assert (row["number"], row["job_id"], row["job_state"], row["state"]) == (
        0,
        d_job,
        "succeeded",
        "complete",
    )
    assert row["run_dir"] == str(run_dir) and row["value"] == value
    assert doc["cost_note"] is None and doc["currency"] == "USD" and doc["unpriced"] == []
    # The ledger's figures for the job, and the catalog's price of the GPU it ran on.
    assert row["gpu_hours"] == pytest.approx(ledger["gpu_hours"]) and row["gpu_hours"] > 0
    price = load_catalog().per_gpu_hour("fake", "owned")
    assert row["cost"] == pytest.approx(row["gpu_hours"] * price, rel=1e-6)
    assert doc["gpu_hours"] == pytest.approx(row["gpu_hours"]) and doc["cost"] == pytest.approx(row["cost"])
    table = run_cli(cp, url, "show", "done")
    assert table.returncode == 0 and "GPU-h" in table.stdout and "no cost shown" not in table.stderr

    r = run_cli(cp, url, "best", "done", "--register", "digits-best", "--json")
    assert r.returncode == 0, r.stderr
    best = json.loads(r.stdout)
    assert (best["number"], best["job_id"], best["run_dir"]) == (0, d_job, str(run_dir))
    assert best["registered"]["name"] == "digits-best" and best["registered"]["version"] == 1
    version = get_version(parse_ref("digits-best/1"))
    assert version.lineage()["run_dir"] == str(run_dir)
    assert version.run_id == meta["mlflow_run_id"]
    assert version.weights.read_bytes() == (run_dir / "final.safetensors").read_bytes()

    r = run_cli(cp, url, "best", "stopped", "--register", "digits-stopped")
    message = " ".join(r.stderr.split())
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"cannot register trial 0 of study 'stopped' (job {s_job})" in message
    assert "has no final model (final.safetensors" in message
