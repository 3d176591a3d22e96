"""Closing the books of a run whose trainer died without a word.

A trainer that is SIGKILLed (the OOM killer, a grace period run out, a node gone) cannot write
its own ending: its run.json keeps saying "running" and its MLflow run stays RUNNING for ever,
so `visionloop runs list` and MLflow's UI show a live run that is long dead. Whoever learns
that the job has ended for good (the control plane) calls `close_abandoned_run`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from visionloop.core.errors import VisionloopError
from visionloop.core.settings import Settings
from visionloop.train.rundir import RunDir

log = logging.getLogger(__name__)

Ending = Literal["failed", "cancelled"]
_MLFLOW_STATUS = {"failed": "FAILED", "cancelled": "KILLED"}


def close_abandoned_run(run_dir: Path, settings: Settings, ending: Ending, reason: str) -> str | None:
    """Mark the run in `run_dir` as ended (`ending`, with `reason`) in its run.json and, if it
    was tracked, in MLflow, where it is still RUNNING. Returns the MLflow run id it closed, or
    None when there was nothing to close.

    Nothing is touched while a trainer holds the run directory's lock (it is alive: it writes
    its own ending), nor when run.json does not say "running" (the trainer ended it itself).
    """
    rd = RunDir(run_dir)
    if not rd.meta_file.is_file():
        return None  # never started, or on a node whose disk this machine cannot see
    try:
        rd.lock()
    except VisionloopError:
        return None  # a trainer holds it: alive
    try:
        meta = rd.read_meta() or {}
        if meta.get("status") != "running":
            return None
        rd.update_meta(status=ending, error=reason[:2000])
        run_id = meta.get("mlflow_run_id")
        if not isinstance(run_id, str) or not run_id:
            return None
        from visionloop.track import store as track_store

        client = track_store.client(settings)
        if client.get_run(run_id).info.status != "RUNNING":
            return None
        client.set_tag(run_id, "visionloop.state", ending)
        client.set_tag(run_id, "visionloop.error", reason[:500])
        client.set_terminated(run_id, _MLFLOW_STATUS[ending])
        return run_id
    finally:
        rd.unlock()
