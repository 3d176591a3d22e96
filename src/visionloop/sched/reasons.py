"""The words of the queue: why a job waits or can never run, as shown to its owner. Each
reason is specific (numbers, names) and, where it can, says what would let the job start."""

from __future__ import annotations

import time
from collections.abc import Mapping

from visionloop.sched.view import PendingJob, SpotPolicy


def impossible_reason(
    job: PendingJob, caps: Mapping[SpotPolicy, tuple[int, int]], same_node: bool
) -> str | None:
    total, biggest = caps[job.spot]
    kind = "non-spot " if job.spot == "never" else ""
    if job.gpus > total:
        return (
            f"can never run: needs {n_gpus(job.gpus)} but the cluster has {total} {kind}GPUs; "
            "cancel it and resubmit with fewer GPUs"
        )
    if job.nodes > 1:
        return None  # placed by pick_nodes: it says how many nodes it needs, in the waiting reason
    if same_node and job.gpus > biggest:
        return (
            f"can never run: needs {n_gpus(job.gpus)} on one node but the largest node has "
            f"{biggest} {kind}GPUs; resubmit with at most {biggest}"
        )
    return None


def backoff_reason(job: PendingJob, now: float) -> str:
    return f"retry back-off until {clock(job.not_before)} (in {job.not_before - now:.0f} s)"


def clock(t: float) -> str:
    # Epoch seconds in the control plane, small numbers in the simulator.
    if t >= 1e8:
        return time.strftime("%H:%M:%S UTC", time.gmtime(t))
    return f"t={t:.0f} s"


def n_gpus(n: int) -> str:
    return f"{n} GPU{plural(n)}"


def plural(n: int) -> str:
    return "" if n == 1 else "s"
