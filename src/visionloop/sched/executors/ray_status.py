"""What Ray's word on a job means for an attempt: a JobDetails read as running, exited (with
which exit code) or lost, and the parts of a run across nodes read as one attempt (see
`ray.py`'s docstring, Exit codes and One run across nodes)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from visionloop.sched.executors.base import AttemptStatus
from visionloop.sched.executors.ray_client import reason
from visionloop.train.launch import RESUMABLE_EXITS, combine_exit_codes

EXIT_KILLED = 128 + 9  # SIGKILL, as a shell reports it
EXIT_NOT_STARTED = 126  # the command could not be started (a shell's "cannot execute")
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
# A supervisor that died (with its node, usually): the attempt's fate is unknown, like a
# local process that vanished, so it is lost and requeued rather than failed.
_LOST_ERRORS = {"JOB_SUPERVISOR_ACTOR_DIED", "JOB_SUPERVISOR_ACTOR_UNKNOWN_FAILURE"}


def job_status(info: Any) -> str:
    """A JobDetails' status as a plain string ("RUNNING", ...)."""
    return str(getattr(info.status, "value", info.status))


def attempt_status(info: Any) -> AttemptStatus:
    """One submission's JobDetails as an attempt's status."""
    status = job_status(info)
    message = reason(info.message or "")
    if status in ("PENDING", "RUNNING"):
        detail = f"pending in Ray: {message}" if status == "PENDING" else "running in Ray"
        return AttemptStatus("running", detail=detail)
    code = getattr(info, "driver_exit_code", None)
    if code is None and str(info.error_type or "") == "JOB_ENTRYPOINT_COMMAND_ERROR":
        # Ray versions without driver_exit_code still say it in the message.
        m = re.search(r"exit code (-?\d+)", message)
        code = int(m.group(1)) if m else None
    if status == "SUCCEEDED":
        return AttemptStatus("exited", exit_code=0 if code is None else int(code))
    if status == "STOPPED":
        return AttemptStatus("exited", exit_code=EXIT_KILLED, detail="stopped through Ray (SIGKILL)")
    if code is not None:
        code = int(code)
        detail = message.split(", last available logs")[0]  # the logs themselves: read_log
        return AttemptStatus("exited", exit_code=128 - code if code < 0 else code, detail=detail)
    error_type = str(info.error_type or "")
    if error_type in _LOST_ERRORS:
        return AttemptStatus("lost", detail=f"Ray lost the job: {message}")
    return AttemptStatus("exited", exit_code=EXIT_NOT_STARTED, detail=f"Ray could not start it: {message}")


@dataclass(frozen=True)
class NodesReading:
    """A multi-node attempt read as one (`read_nodes`), with what the executor acts on."""

    status: AttemptStatus
    running: list[str] = field(default_factory=list)  # the parts still running
    first_failed: int | None = None  # while parts run: the first that failed (not resumable)


def read_nodes(sids: Sequence[str], infos: Sequence[Any]) -> NodesReading:
    """The parts of a multi-node attempt (node rank order; an info is None where Ray has no
    such job) as one attempt: lost as soon as any node's part is (its node died: the whole
    job is requeued, and the other nodes, which cannot go on without it, must be stopped);
    exited when every node's part has, with their codes combined as the launcher combines
    its ranks' (all 0 → 0; 0 or 75 → 75; 0 or 76 → 76; else the first failure, a node that
    failed by itself before one that was stopped); running otherwise."""
    statuses = [
        AttemptStatus("lost", detail=f"Ray has no job {sid}") if info is None else attempt_status(info)
        for sid, info in zip(sids, infos, strict=True)
    ]
    running = [sid for sid, st in zip(sids, statuses, strict=True) if st.state == "running"]
    lost = [(rank, st) for rank, st in enumerate(statuses) if st.state == "lost"]
    if lost:
        rank, st = lost[0]
        detail = f"node {rank} of {len(sids)} ({sids[rank]}): {st.detail}"
        return NodesReading(AttemptStatus("lost", detail=detail), running)
    exited = [
        (rank, st, job_status(infos[rank]) == "STOPPED")
        for rank, st in enumerate(statuses)
        if st.state == "exited" and st.exit_code is not None
    ]
    failed = [f for f in exited if f[1].exit_code not in RESUMABLE_EXITS]
    if running:
        detail = f"running in Ray on {len(sids)} nodes ({len(running)} still running)"
        return NodesReading(
            AttemptStatus("running", detail=detail), running, failed[0][0] if failed else None
        )
    if not failed:
        code = combine_exit_codes([st.exit_code or 0 for _, st, _ in exited])
        return NodesReading(AttemptStatus("exited", exit_code=code, detail=f"all {len(sids)} nodes exited"))
    # The node that failed by itself says why; the ones we stopped after it only echo it.
    rank, st, _ = sorted(failed, key=lambda f: f[2])[0]
    detail = f"node {rank} of {len(sids)} ({sids[rank]}): exit {st.exit_code}" + (
        f"; {st.detail}" if st.detail else ""
    )
    return NodesReading(AttemptStatus("exited", exit_code=st.exit_code, detail=detail))
