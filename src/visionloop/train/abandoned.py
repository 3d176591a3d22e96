"""Closing the books of a run whose trainer died without a word.

A trainer that is SIGKILLed (the OOM killer, a grace period run out, a node gone) cannot write
its own ending: its run.json keeps saying "running" and its MLflow run stays RUNNING for ever,
so `visionloop runs list` and MLflow's UI show a live run that is long dead. Whoever learns
that the job has ended for good (the control plane) calls `close_abandoned_run`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Literal

from visionloop.core.errors import VisionloopError
from visionloop.core.settings import Settings
from visionloop.train.rundir import RunDir

Ending = Literal["failed", "cancelled", "pruned"]
_MLFLOW_STATUS = {"failed": "FAILED", "cancelled": "KILLED", "pruned": "KILLED"}


def close_abandoned_run(
    run_dir: Path, settings: Settings, ending: Ending, reason: str, *, wait_s: float = 0.0
) -> str | None:
    """Mark the run in `run_dir` as ended (`ending`, with `reason`) in its run.json and, if it
    was tracked, in MLflow, where it is still RUNNING. Returns the MLflow run id it closed, or
    None when there was nothing to close.

    A run a trainer stopped itself after a checkpoint ("preempted": resumable) that will not
    be resumed, because its job ended, is marked too; its MLflow run is already ended (KILLED),
    so only its `visionloop.state` tag changes. So is a tuning trial's run paused at a rung
    ("paused") that its study then pruned ("pruned"). Nothing is touched while a trainer holds the run
    directory's lock (it is alive: it writes its own ending), nor when the run finished or
    failed by itself. `wait_s`: how long to keep asking for the lock, for a caller that knows
    the trainer is dead (its killed children can hold the lock for a moment after it).
    """
    rd = RunDir(run_dir)
    if not rd.meta_file.is_file():
        return None  # never started, or on a node whose disk this machine cannot see
    deadline = time.monotonic() + wait_s
    while True:
        try:
            rd.lock()
            break
        except VisionloopError:
            if time.monotonic() >= deadline:
                return None  # a trainer holds it: alive
            time.sleep(0.5)
    try:
        meta = rd.read_meta() or {}
        status = meta.get("status")
        if status not in ("running", "preempted", "paused"):
            return None
        rd.update_meta(status=ending, error=reason[:2000])
        run_id = meta.get("mlflow_run_id")
        if not isinstance(run_id, str) or not run_id:
            return None
        from visionloop.track import store as track_store

        client = track_store.client(settings)
        mlflow_status = client.get_run(run_id).info.status
        # RUNNING: the trainer died; KILLED after "preempted"/"paused": it stopped itself and ended it.
        stopped_itself = status in ("preempted", "paused") and mlflow_status == "KILLED"
        if mlflow_status != "RUNNING" and not stopped_itself:
            return None
        client.set_tag(run_id, "visionloop.state", ending)
        if mlflow_status == "RUNNING":
            client.set_tag(run_id, "visionloop.error", reason[:500])
            client.set_terminated(run_id, _MLFLOW_STATUS[ending])
        return run_id
    finally:
        rd.unlock()
