"""`visionloop train`, `tune run`, `size train` and `submit` handed what no spec is: a FIFO,
/dev/zero, an alias bomb. Each answers at once with one line that names the file and what
to do (exit 2 for a spec, 1 for a catalog), and leaves no run directory behind.

Run as plain `python -m visionloop` processes (not the warm fork of tests/_warmcli.py), each
under a 2 GiB data limit and a timeout: before the fixes these hung forever (a FIFO, with
SIGTERM caught by the trainer) or ate all memory (/dev/zero, an alias bomb), and a
regression must fail the test, not the machine. These commands import torch lazily, so a
cold start costs well under a second."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from _cpkit import cluster_config, control_plane
from _cpkit import train_doc as queue_train_doc
from _dbkit import fresh_database

ALIAS_BOMB = "".join(
    f"{name}: &{name} [{', '.join([f'*{prev}'] * 9) if prev else ', '.join(['x'] * 9)}]\n"
    for prev, name in zip([None, *"abcdefgh"], "abcdefghi", strict=True)
)
TRAIN = {"data": {"dataset": "ds"}, "model": {"arch": "small_cnn"}, "epochs": 1}


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_DATA, (2 * 2**30, 2 * 2**30))


def run(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "visionloop", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        preexec_fn=_limit_memory,
        timeout=30,
    )


def assert_refused(r: subprocess.CompletedProcess[str], code: int, *says: str) -> None:
    assert r.returncode == code, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.startswith("error: "), r.stderr[-2000:]
    for text in says:
        assert text in r.stderr, r.stderr[-2000:]


def no_run_dirs() -> bool:
    runs = Path(os.environ["VISIONLOOP_HOME"]) / "runs"
    return not runs.exists() or not any(runs.iterdir())


@pytest.mark.timeout(120)
def test_train_refuses_a_fifo_at_once(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "spec.yaml")
    r = run("train", "spec.yaml", cwd=tmp_path)
    assert_refused(r, 2, "spec.yaml is a FIFO", "give the path of a YAML file")
    assert no_run_dirs()


@pytest.mark.timeout(120)
def test_train_refuses_dev_zero_without_reading_it(tmp_path: Path) -> None:
    r = run("train", "/dev/zero", cwd=tmp_path)
    assert_refused(r, 2, "/dev/zero is a device")
    assert no_run_dirs()


@pytest.mark.timeout(120)
def test_train_refuses_an_alias_bomb_without_expanding_it(tmp_path: Path) -> None:
    (tmp_path / "spec.yaml").write_text(
        ALIAS_BOMB + "data: {dataset: ds}\nmodel: {arch: small_cnn}\nepochs: *i\n"
    )
    r = run("train", "spec.yaml", cwd=tmp_path)
    assert_refused(r, 2, "spec.yaml is not valid YAML", "alias", "write the values out in full")
    assert no_run_dirs()


@pytest.mark.timeout(120)
def test_tune_run_refuses_a_train_spec_that_is_a_fifo(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "train.yaml")
    tune = {"name": "fifo", "train": "train.yaml", "space": {"optimizer.lr": {"loguniform": [1e-4, 0.1]}}}
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump({**tune, "trials": 2}))
    r = run("tune", "run", "tune.yaml", cwd=tmp_path)
    assert_refused(r, 2, "tune.yaml: train: train spec file", "is a FIFO")


@pytest.mark.timeout(120)
def test_size_train_refuses_a_device_catalog_that_is_a_fifo(tmp_path: Path) -> None:
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(TRAIN))
    os.mkfifo(tmp_path / "devices.toml")
    r = run("size", "train", "spec.yaml", "--catalog", "devices.toml", cwd=tmp_path)
    assert_refused(r, 1, "device catalog devices.toml is a FIFO", "leave --catalog out")


@pytest.mark.timeout(120)
def test_submit_refuses_a_fifo_before_calling_the_control_plane(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "job.yaml")
    r = run("submit", "job.yaml", cwd=tmp_path, env={"VISIONLOOP_API_URL": "http://127.0.0.1:9"})
    assert_refused(r, 2, "job.yaml is a FIFO")


@pytest.mark.timeout(300)
def test_submit_sends_a_relative_backbone_path_resolved_from_the_specs_folder(
    tmp_path: Path, digits_dataset: Path
) -> None:
    """`model.pretrained_backbone` is a path like `data.dataset`: relative to the spec's
    folder. Before, submit left it relative and the control plane refused the job."""
    folder = tmp_path / "specs"
    folder.mkdir()
    (folder / "backbone.safetensors").write_bytes(b"weights")
    train = queue_train_doc(digits_dataset)
    train["model"]["pretrained_backbone"] = "backbone.safetensors"
    (folder / "job.yaml").write_text(yaml.safe_dump({"train": train, "team": "vision"}))
    inventory = [{"node": "local", "type": "fake", "count": 1, "price_class": "owned"}]
    config = cluster_config(inventory=inventory, teams=[{"name": "vision", "nominal_gpus": 1}])
    with (
        fresh_database("sqlite", tmp_path) as url,
        control_plane(url, config, run_scheduler=False) as cp,
    ):
        env = {"VISIONLOOP_API_URL": cp.url, "VISIONLOOP_TOKEN": cp.admin_token}
        r = run("submit", str(folder / "job.yaml"), cwd=tmp_path, env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        job = cp.plane.store.get_job(int(r.stdout.strip()))
        assert job.train_spec.model.pretrained_backbone == folder / "backbone.safetensors"
