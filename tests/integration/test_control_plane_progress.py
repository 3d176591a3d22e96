"""Checkpoints reach the control plane from the job itself, as progress lines in its log, and
not by listing its run directory (which the control plane may not share: a Ray cluster).

The job here is a small Python program that writes progress lines the way the trainer does,
among hostile ones; everything else is the real thing: the store (SQLite and PostgreSQL), the
local executor with real processes, the scheduler's cycle over HTTP."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from _cpkit import CP, TEAMS, cluster_config, control_plane
from _cpkit import train_doc as _train
from _dbkit import BACKENDS, fresh_database
from visionloop.sched.progress import ProgressReader
from visionloop.sched.store import Job

ONE_GPU = [{"node": "local", "type": "fake", "count": 1, "price_class": "owned"}]

# Reports checkpoints 100 and 200 among lines the control plane must ignore, waits for a
# marker file, then reports 300 and exits at once.
REPORTER = r"""
import json, os, sys, time
P = "@@visionloop-progress "
if os.environ.get("VISIONLOOP_PROGRESS") != "1":
    sys.exit("the control plane did not ask for progress lines")
def emit(doc):
    print(P + json.dumps(doc), flush=True)
print("epoch 1 of 1", flush=True)
print(P + '{"event": "checkpoint", "step": 7, "at": 1.0, "pad": "' + "x" * 100_000 + '"}', flush=True)
print(P + "{not json", flush=True)
print(P + "[" * 5000, flush=True)
sys.stdout.buffer.write(P.encode() + b'{"event": "checkpoint", "step": 11, "at": 1.0, "x": "\xff"}\n')
sys.stdout.flush()
emit({"event": "checkpoint", "step": "8", "at": 1.0})
emit({"event": "checkpoint", "step": 2**40, "at": 1.0})
emit({"event": "checkpoint", "step": 9})
emit({"event": "drop_tables", "step": 10, "job": 1})
emit({"event": "eval", "step": 100, "epoch": 1, "metrics": {"accuracy": 0.5}})
emit({"event": "checkpoint", "step": 100, "at": time.time()})
emit({"event": "checkpoint", "step": 100, "at": time.time()})
emit({"event": "checkpoint", "step": 200, "at": 4e9})
while not os.path.exists(sys.argv[1]):
    time.sleep(0.05)
emit({"event": "checkpoint", "step": 300, "at": time.time()})
"""


@pytest.fixture(params=BACKENDS)
def cp(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[CP]:
    cfg = cluster_config(inventory=ONE_GPU, teams=TEAMS)
    with fresh_database(request.param, tmp_path) as url, control_plane(url, cfg) as plane:
        yield plane


def test_checkpoints_are_recorded_from_the_jobs_progress_lines_not_its_run_dir(
    cp: CP, digits_dataset: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    done = tmp_path / "done"

    def command(job: Job) -> list[str]:
        return [sys.executable, "-c", REPORTER, str(done)]

    cp.plane._command = command  # type: ignore[method-assign]
    store = cp.plane.store
    caplog.set_level(logging.WARNING, logger="visionloop.sched.service")
    with cp.client() as c:
        r = c.post("/v1/jobs", json={"spec": _train(digits_dataset), "team": "vision"})
        assert r.status_code == 201, r.text
        job = int(r.json()["id"])
    # A checkpoint file in the run dir that the job never reported: not the control plane's source.
    decoy = Path(store.get_job(job).run_dir) / "checkpoints" / "step-000000555.ckpt"
    decoy.parent.mkdir(parents=True)
    decoy.write_bytes(b"")
    deadline = time.monotonic() + 120
    while [c.step for c in store.checkpoints(job)] != [100, 200]:
        assert time.monotonic() < deadline, store.checkpoints(job)
        time.sleep(0.1)
    # A restarted control plane knows nothing of what it read: it reads each log from the start.
    with cp.plane._lock:
        cp.plane._progress = ProgressReader()
        cp.plane._ckpt_steps = {}
    done.touch()
    show = cp.wait_job(job, lambda j: j["state"] in ("succeeded", "failed"), timeout=120)
    assert show["job"]["state"] == "succeeded", show
    (attempt,) = show["attempts"]
    ckpts = store.checkpoints(job)
    # 300 was written just before the job exited: read from its log as the attempt ended.
    assert [(c.step, c.attempt) for c in ckpts] == [(100, 1), (200, 1), (300, 1)]
    # A time from the future is held to when the control plane read it.
    assert all(attempt["started_at"] <= c.at <= attempt["ended_at"] for c in ckpts)
    assert show["job"]["last_checkpoint_at"] == max(c.at for c in ckpts)
    assert "scheduling cycle failed" not in caplog.text
