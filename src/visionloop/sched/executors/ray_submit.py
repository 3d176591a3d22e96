"""Submitting one node's part of an attempt to Ray: its entrypoint, resources and pinning,
and the adoption of a submission Ray already has of that very part (a re-launch after a
lost answer or a control-plane restart); also the stopping of earlier attempts' orphans
(see `ray.py`'s docstring, One submission per attempt)."""

from __future__ import annotations

import logging
import shlex
from typing import Any

from visionloop.core.errors import ExecutorError
from visionloop.sched.executors.base import LaunchRequest
from visionloop.sched.executors.ray_client import RayJobs, reason
from visionloop.sched.executors.ray_ids import node_submission_id, submission_id
from visionloop.sched.executors.ray_nodes import RayNode
from visionloop.sched.executors.ray_signal import SUBMISSION_ENV
from visionloop.sched.executors.ray_status import TERMINAL, job_status

log = logging.getLogger(__name__)


def submit(
    jobs: RayJobs,
    request: LaunchRequest,
    sid: str,
    node: RayNode | None,
    n_gpus: int,
    env: dict[str, str],
    n_nodes: int,
) -> None:
    """Submit one node's part of the attempt (the whole of it on one node), or adopt it
    if Ray already has it."""
    # Ray sets CUDA_VISIBLE_DEVICES only for entrypoints that request GPUs; a CPU job left
    # without it would see every GPU of its node, other jobs' included.
    no_gpus = "" if n_gpus else "CUDA_VISIBLE_DEVICES= "
    entrypoint = f"exec env {no_gpus}{SUBMISSION_ENV}={sid} {shlex.join(request.command)}"
    kwargs: dict[str, Any] = {
        "entrypoint": entrypoint,
        "submission_id": sid,
        "runtime_env": {"env_vars": env},
        "metadata": {"visionloop_job": str(request.job_id), "attempt": str(request.attempt)},
        "entrypoint_num_cpus": request.cpus / n_nodes,
        "entrypoint_num_gpus": n_gpus,
    }
    if request.memory_gb > 0:
        kwargs["entrypoint_memory"] = int(request.memory_gb / n_nodes * 1024**3)
    if node is not None:
        kwargs.update(jobs.pin(node.node_id, node.ip))
    client = jobs.client()
    try:
        client.submit_job(**kwargs)
    except RuntimeError as e:
        if "already exists" not in str(e):
            raise ExecutorError(f"Ray refused job {sid}: {reason(e)}") from e
        check_adoptable(jobs, sid, entrypoint, request)
    except (OSError, ValueError) as e:
        # The request may have reached Ray: look before giving up, so a job that did start
        # is adopted rather than left running unaccounted for.
        if jobs.info_quietly(sid) is None:
            raise jobs.unreachable(e) from e
        check_adoptable(jobs, sid, entrypoint, request)


def check_adoptable(jobs: RayJobs, sid: str, entrypoint: str, request: LaunchRequest) -> None:
    """A submission with this id exists: adopt it if it is this very attempt."""
    info = jobs.info(sid)
    if info is None:
        raise ExecutorError(f"Ray said job {sid} exists, then that it does not; launch it again.")
    meta = dict(info.metadata or {})
    if (
        info.entrypoint == entrypoint
        and meta.get("visionloop_job") == str(request.job_id)
        and meta.get("attempt") == str(request.attempt)
    ):
        log.info("job %s: Ray already runs %s; adopting it", request.job_id, sid)
        return
    raise ExecutorError(
        f"Ray already has a job {sid} with another command: another visionloop installation (or an "
        "earlier state database) uses this cluster with the same prefix. Give each installation its "
        f"own RayExecutor(prefix=...), or remove the old job with `ray job delete {sid}` once it ended."
    )


def stop_orphans(jobs: RayJobs, prefix: str, request: LaunchRequest) -> None:
    """Stop earlier attempts of this job that Ray still runs. The control plane launches
    attempt N only after attempt N-1 ended in its books, so a live one is an orphan: a
    launch whose answer was lost (timeout) and then counted as failed. Never two at once."""
    for n in range(max(1, request.attempt - 3), request.attempt):
        attempt_sid = submission_id(prefix, request.job_id, n)
        for rank in range(max(request.nodes, 1)):
            sid = node_submission_id(attempt_sid, rank)
            info = jobs.info_quietly(sid)
            if info is not None and job_status(info) not in TERMINAL:
                log.warning("job %s: earlier attempt %s still runs in Ray; stopping it", request.job_id, sid)
                jobs.stop(sid)
