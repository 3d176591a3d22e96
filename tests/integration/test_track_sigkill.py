"""Exactly-once metric steps across a real SIGKILL.

A first process opens a run and logs steps continuously (with system metrics) until it is
SIGKILLed mid-way. A second process reopens the run by its uid and, like a trainer resuming
from an older checkpoint, logs again from a step it had already logged. Every key's history
must then hold every step exactly once, in one MLflow run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from _mlflowkit import copy_migrated_store
from visionloop.core.settings import load_settings

TRAINER = r"""
import sys, time
from pathlib import Path
from visionloop.core.settings import Settings, load_settings
from visionloop.track import store as track_store
from visionloop.track import open_run

uid, first, last, run_dir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
tracker = open_run(load_settings(), uid=uid, experiment="sigkill", run_name="sigkill", run_dir=run_dir,
                   environment=False, flush_interval_s=0.1)
print(f"opened {tracker.run_id} {tracker.resumed}", flush=True)
step = first
tracker.start_system_metrics(step_fn=lambda: step, every_s=0.05)
for step in range(first, last + 1):
    tracker.log_metrics({"train/loss": 1.0 / (step + 1), "train/lr": 0.1 * step}, step=step)
    if step % 10 == 0:
        tracker.flush()
        print(f"flushed {step}", flush=True)
    time.sleep(0.002)
tracker.close("FINISHED")
print("closed", flush=True)
"""


def start_trainer(uid: str, first: int, last: int, run_dir: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", TRAINER, uid, str(first), str(last), str(run_dir)],
        stdout=subprocess.PIPE,
        text=True,
    )


def steps_of(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


@pytest.mark.timeout(180)
def test_sigkill_then_resume_logs_every_step_exactly_once(
    vl_home: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    copy_migrated_store(tmp_path_factory, vl_home)
    run_dir = vl_home / "runs" / "r1"
    first = start_trainer("uid-sigkill", 0, 1_000_000, run_dir)
    assert first.stdout is not None
    opened = first.stdout.readline().split()
    assert opened[0] == "opened" and opened[2] == "False", opened
    run_id = opened[1]
    flushed = -1
    for line in first.stdout:  # keep the pipe drained until the kill
        if line.startswith("flushed"):
            flushed = int(line.split()[1])
            if flushed >= 150:
                break
    os.kill(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    assert first.returncode == -signal.SIGKILL
    assert flushed >= 150

    client = MlflowClient(load_settings().tracking_uri)
    stored = steps_of(client, run_id, "train/loss")
    last_logged = stored[-1]
    assert last_logged >= flushed  # everything flushed is there...
    assert stored == list(range(last_logged + 1))  # ...as a gap-free prefix, once each
    sys_before = steps_of(client, run_id, "system/cpu_percent")
    assert sys_before, "the sampler logged nothing before the kill"

    # Resume from "checkpoint" step 100: steps 100..last_logged are replayed and must be dropped.
    final = last_logged + 60
    second = start_trainer("uid-sigkill", 100, final, run_dir)
    out, _ = second.communicate(timeout=120)
    assert second.returncode == 0, out
    assert out.splitlines()[0] == f"opened {run_id} True"

    for key in ("train/loss", "train/lr"):
        assert steps_of(client, run_id, key) == list(range(final + 1)), key
    values = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert values[final] == 1.0 / (final + 1)
    for key in ("system/cpu_percent", "system/process_rss_mib"):
        steps = steps_of(client, run_id, key)
        assert len(steps) == len(set(steps)), f"{key} has duplicated steps"
        assert steps[-1] > sys_before[-1]  # the second process sampled too
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["visionloop.attempts"] == "2"
    assert len(client.search_runs([run.info.experiment_id])) == 1  # one training run, one MLflow run
