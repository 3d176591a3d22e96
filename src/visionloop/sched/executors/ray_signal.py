"""The Ray executor's signal job (see `ray.py`'s docstring): Ray's job API can stop a job (a
SIGTERM to its whole process tree, then SIGKILL) but not signal its main process alone, so
`terminate` submits a tiny job pinned to the attempt's node that sends the signal itself.
Here: the signal script, and `SignalJobs`, which submits signal jobs and deletes them once
their attempt ended."""

from __future__ import annotations

import logging
import shlex
import threading
import time

from visionloop.core.errors import ExecutorError
from visionloop.sched.executors.ray_client import RayJobs
from visionloop.sched.executors.ray_nodes import ip_of
from visionloop.sched.executors.ray_status import TERMINAL, job_status

log = logging.getLogger(__name__)

# Every attempt's process carries its submission id in this variable (the entrypoint sets
# it): what the signal script finds it by.
SUBMISSION_ENV = "VISIONLOOP_RAY_SUBMISSION_ID"

# The signal job's entrypoint (`signal_entrypoint`): `sh -c SCRIPT vl-signal SUBMISSION_ID
# SIGNAL`. It signals the roots of the attempt's process tree (marked processes whose parent
# is not marked): the entrypoint's main process, which Ray's supervisor started. It retries
# for ~10 s, because a job reads RUNNING a moment before its command is exec'd. Only
# processes of its own cluster: Ray's supervisor gives every job's driver the cluster's GCS
# address as RAY_ADDRESS, and two clusters on one machine (two test workers; two installs)
# may both run a job with the same submission id (a CI run saw another cluster's attempt
# SIGTERMed at its start).
SIGNAL_SCRIPT = (
    f'want="{SUBMISSION_ENV}=$1"\n'
    + r"""here="RAY_ADDRESS=${RAY_ADDRESS:-}"
n=0
while :; do
  marked=" "
  for f in $(grep -lsxzF -e "$want" /proc/[0-9]*/environ); do
    if [ -n "${RAY_ADDRESS:-}" ] && ! grep -qsxzF -e "$here" "$f"; then continue; fi
    p=${f#/proc/}; marked="$marked${p%/environ} "
  done
  sent=""
  for p in $marked; do
    pp=$(sed -n 's/^PPid:[[:space:]]*//p' "/proc/$p/status" 2>/dev/null)
    case "$marked" in *" $pp "*) ;; *) kill -s "$2" "$p" 2>/dev/null && sent="$sent $p" ;; esac
  done
  if [ -n "$sent" ]; then echo "visionloop: sent SIG$2 to$sent ($1)"; exit 0; fi
  n=$((n + 1))
  if [ "$n" -ge 40 ]; then echo "visionloop: no process of $1 on this node"; exit 1; fi
  sleep 0.25
done"""
)


def signal_entrypoint(submission_id: str, signal: str) -> str:
    """The signal job's command: send SIG`signal` (TERM, ...) to the attempt `submission_id`'s
    main process on the node the job is pinned to."""
    return f"sh -c {shlex.quote(SIGNAL_SCRIPT)} vl-signal {shlex.quote(submission_id)} {signal}"


class SignalJobs:
    """The signal jobs submitted through `jobs`, per attempt's submission, until it ends."""

    def __init__(self, jobs: RayJobs) -> None:
        self._jobs = jobs
        self._lock = threading.Lock()
        self._sent: dict[str, list[str]] = {}  # attempt's submission id -> signal jobs

    def terminate(self, sid: str) -> None:
        """SIGTERM to the main process of submission `sid` through a signal job pinned to its
        node; a submission that has not started yet is stopped, a finished one left alone."""
        info = self._jobs.info(sid)
        if info is None or job_status(info) in TERMINAL:
            return
        node_id = getattr(info, "driver_node_id", None)
        if job_status(info) == "PENDING" or not node_id:
            # Nothing to checkpoint yet: stop it (its command may be starting this instant).
            self._jobs.stop(sid)
            return
        signal_sid = f"{sid}-sigterm-{time.time_ns() // 1_000_000}"
        self._jobs.call(
            f"submit the signal job {signal_sid}",
            self._jobs.client().submit_job,
            entrypoint=signal_entrypoint(sid, "TERM"),
            submission_id=signal_sid,
            metadata={"visionloop_signal_for": sid},
            entrypoint_num_cpus=0,
            **self._jobs.pin(node_id, ip_of(getattr(info, "driver_agent_http_address", None))),
        )
        with self._lock:
            self._sent.setdefault(sid, []).append(signal_sid)

    def forget(self, sid: str) -> None:
        """Delete the finished signal jobs of an attempt that ended, so `ray job list` does not
        fill up with them; failed ones stay for inspection."""
        with self._lock:
            pending = self._sent.pop(sid, [])
        for signal_sid in pending:
            try:
                info = self._jobs.info(signal_sid)
                if info is not None and job_status(info) == "SUCCEEDED":
                    self._jobs.client().delete_job(signal_sid)
            except (ExecutorError, RuntimeError, OSError) as e:
                log.debug("could not delete signal job %s: %s", signal_sid, e)
