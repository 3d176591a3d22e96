"""How the Ray executor names its submissions after attempts, and finds them again from a
handle: `{prefix}-job-{job_id}-attempt-{attempt}` for an attempt (its node 0's part),
`{id}-node-{k}` for node k's part of a run across nodes (see `ray.py`'s docstring)."""

from __future__ import annotations

from collections.abc import Callable

from visionloop.core.errors import ExecutorError
from visionloop.sched.executors.base import Handle
from visionloop.sched.executors.naming import attempt_name, attempt_of
from visionloop.sched.executors.naming import check_prefix as _check_prefix


def check_prefix(prefix: str) -> str:
    """`prefix`, if it can start a submission id; ExecutorError otherwise."""
    return _check_prefix(prefix, "RayExecutor")


def submission_id(prefix: str, job_id: int, attempt: int) -> str:
    return attempt_name(prefix, job_id, attempt)


def node_submission_id(sid: str, rank: int) -> str:
    """Node `rank`'s submission of a multi-node attempt: node 0's is the attempt's own id
    (its log is the attempt's log), the others' `{sid}-node-{rank}`."""
    return sid if rank == 0 else f"{sid}-node-{rank}"


def handle_sid(prefix: str, handle: Handle) -> str | None:
    """The attempt's submission id (node 0's): the handle's, else rebuilt from the folder
    names of a bare pre-launch handle's attempt_dir; None if the handle names none."""
    sid = handle.get("submission_id")
    if isinstance(sid, str) and sid:
        return sid
    ids = attempt_of(str(handle.get("attempt_dir", "")))
    return submission_id(prefix, *ids) if ids else None


def handle_sids(prefix: str, handle: Handle, exists: Callable[[str], bool]) -> list[str] | None:
    """Every submission of the attempt, node 0's first; None if the handle names none.
    A bare pre-launch handle has no node list: the other nodes' are looked up in Ray
    (`exists`)."""
    nodes = handle.get("nodes")
    if isinstance(nodes, list) and nodes:
        return [str(n["submission_id"]) for n in nodes]
    sid = handle_sid(prefix, handle)
    if sid is None:
        return None
    sids = [sid]
    if not handle.get("submission_id"):
        while exists(node_submission_id(sid, len(sids))):
            sids.append(node_submission_id(sid, len(sids)))
    return sids


def require_sid(prefix: str, handle: Handle) -> str:
    """As `handle_sid`, and ExecutorError if the handle names no submission."""
    sid = handle_sid(prefix, handle)
    if sid is None:
        raise ExecutorError(
            f"the handle {handle} names no Ray submission (no submission_id, and its attempt_dir is not "
            ".../job-N/attempt-M); `ray job list` shows the cluster's jobs."
        )
    return sid
