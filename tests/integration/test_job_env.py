"""Jobs start with a clean environment: the control plane's secrets (the job store's URL with
its password, cloud credentials) never reach a job; only the base a process needs, what the
control plane decided the job needs, and the names an admin allow-listed in cluster.toml
(`[jobs] env_allow`). Real jobs that print their environment: under the local executor, through
the whole control plane, and on a real Ray cluster."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from _cpkit import CP, cluster_config, control_plane, job_roots
from _cpkit import train_doc as _train
from _dbkit import fresh_database
from _execkit import log_text, wait_exited
from _raykit import RayCluster
from visionloop.sched.executors.base import LaunchRequest
from visionloop.sched.executors.local import LocalExecutor
from visionloop.sched.store import Job
from visionloop.sched.view import Gpu

pytest_plugins = ["_raysession"]  # the session's Ray cluster, for the Ray test only

# Prints the environment as one JSON line between markers (Ray adds lines of its own).
PRINT_ENV = "import json, os; print('ENV=' + json.dumps(dict(os.environ)), flush=True)"
SECRETS = {
    "VISIONLOOP_DB_URL": "postgresql://vl:s3cret-db-pass@db.internal/vl",
    "AWS_SECRET_ACCESS_KEY": "s3cret-aws-key",
    "VISIONLOOP_TOKEN": "s3cret-token",
}
ONE_GPU = [{"node": "local", "type": "fake", "count": 1, "price_class": "owned"}]


def _env_of(log: str) -> dict[str, str]:
    line = next(x for x in log.splitlines() if x.startswith("ENV="))
    return dict(json.loads(line.removeprefix("ENV=")))


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Secrets in the control plane's (this process's) environment, and variables an admin
    may or may not allow-list."""
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HF_HOME", "/data/hf")
    monkeypatch.setenv("NOT_ALLOWED", "nope")
    monkeypatch.setenv("LC_TIME", "C.UTF-8")
    # Where jobs copy their checkpoints: passed on (not the credentials, in SECRETS above).
    monkeypatch.setenv("VISIONLOOP_CHECKPOINT_STORE", "s3://vl-ckpt/team-a")
    monkeypatch.setenv("VISIONLOOP_S3_ENDPOINT_URL", "http://minio.internal:9000")
    yield


def _assert_clean(env: dict[str, str], raw_log: str) -> None:
    for name, value in SECRETS.items():
        assert name not in env
        assert value not in raw_log  # not under another name either
    assert "NOT_ALLOWED" not in env
    assert env["PATH"]


def test_a_local_job_sees_the_clean_base_and_its_requests_env_only(planted: None, tmp_path: Path) -> None:
    ex = LocalExecutor([Gpu("local/0", "local", "fake")], heartbeat_s=0.2)
    request = LaunchRequest(
        job_id=3,
        attempt=1,
        command=[sys.executable, "-c", PRINT_ENV],
        gpus=(),
        attempt_dir=tmp_path / "a",
        env={"VISIONLOOP_HOME": "/home/vl", "TEAM_VAR": "x"},
    )
    handle = ex.launch(request)
    assert wait_exited(ex, handle).exit_code == 0
    text = log_text(ex, handle)
    env = _env_of(text)
    _assert_clean(env, text)
    assert env["LC_TIME"] == "C.UTF-8"  # the locale is part of the base
    assert "HF_HOME" not in env  # not allow-listed here: the executor passes only the request's
    assert env["VISIONLOOP_HOME"] == "/home/vl" and env["TEAM_VAR"] == "x"
    assert env["PYTHONUNBUFFERED"] == "1" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["VISIONLOOP_JOB_ID"] == "3" and env["VISIONLOOP_ATTEMPT"] == "1"


@pytest.fixture
def cp(tmp_path: Path, planted: None) -> Iterator[CP]:
    jobs = {"env_allow": ["HF_HOME", "UNSET_BUT_ALLOWED"], "allowed_roots": job_roots()}
    cfg = cluster_config(inventory=ONE_GPU, jobs=jobs)
    with fresh_database("sqlite", tmp_path) as url, control_plane(url, cfg) as plane:
        yield plane


def test_a_queue_job_gets_the_allow_listed_variables_and_no_secret(
    cp: CP, digits_dataset: Path, vl_home: Path
) -> None:
    def command(job: Job) -> list[str]:  # the real trainer does not print its environment
        return [sys.executable, "-c", PRINT_ENV]

    cp.plane._command = command  # type: ignore[method-assign]
    with cp.client() as c:
        r = c.post("/v1/jobs", json={"spec": _train(digits_dataset), "gpus": 0})
        assert r.status_code == 201, r.text
        job_id = r.json()["id"]
    show = cp.wait_job(job_id, lambda j: j["state"] in ("succeeded", "failed"))
    assert show["job"]["state"] == "succeeded", show
    text = log_text(cp.plane.executor, show["attempts"][0]["handle"])
    env = _env_of(text)
    _assert_clean(env, text)
    assert env["LC_TIME"] == "C.UTF-8"  # the locale is part of the base
    assert env["HF_HOME"] == "/data/hf"  # allow-listed, and set in the control plane's environment
    assert "UNSET_BUT_ALLOWED" not in env
    assert env["VISIONLOOP_HOME"] == str(vl_home)
    assert env["VISIONLOOP_TRACKING_URI"] == cp.plane.settings.tracking_uri
    assert env["VISIONLOOP_PROGRESS"] == "1"  # the job reports its checkpoints in its log
    assert env["VISIONLOOP_CHECKPOINT_STORE"] == "s3://vl-ckpt/team-a"
    assert env["VISIONLOOP_S3_ENDPOINT_URL"] == "http://minio.internal:9000"


def test_a_ray_job_gets_only_the_requests_env_from_the_control_plane(
    ray_cluster: RayCluster, planted: None, tmp_path: Path
) -> None:
    """Ray's job driver inherits the Ray node's environment (here: this process's when the
    session's cluster started, before the secrets were planted) and the runtime env's
    env_vars, which the executor fills from the request alone."""
    from visionloop.sched.executors.ray import RayExecutor

    ex = RayExecutor(ray_cluster.address, prefix="vlenv")
    launch = LaunchRequest(
        job_id=1,
        attempt=1,
        command=[sys.executable, "-c", PRINT_ENV],
        gpus=(),
        attempt_dir=tmp_path / "job-1" / "attempt-1",
        env={"HF_HOME": "/data/hf", "VISIONLOOP_HOME": "/home/vl"},
        cpus=0.05,
        memory_gb=0.0,
    )
    handle = ex.launch(launch)
    assert wait_exited(ex, handle).exit_code == 0
    text = log_text(ex, handle)
    env = _env_of(text)
    _assert_clean(env, text)
    assert env["HF_HOME"] == "/data/hf" and env["VISIONLOOP_HOME"] == "/home/vl"
    assert env["VISIONLOOP_JOB_ID"] == "1" and env["VISIONLOOP_ATTEMPT"] == "1"
