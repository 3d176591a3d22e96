"""The Ray executor: each attempt is a job on an existing Ray cluster, through Ray's job
submission API (the dashboard's REST API, e.g. http://HEAD:8265).

    RayExecutor("http://head:8265")                   # needs `pip install 'visionloop[ray]'`

Nothing here connects a Ray driver (`ray.init`): the control plane only speaks HTTP to the
dashboard (`JobSubmissionClient` for jobs, the state API's `list_nodes` for capacity), so it
can run outside the cluster and never joins it. `ray` is imported lazily, on first use.

Decisions worth knowing:

- **One submission per attempt (per node of it), named by it.** The submission id is
  `{prefix}-job-{job_id}-attempt-{attempt}` (`vl-job-12-attempt-3`): a control plane killed
  between submitting and storing the handle finds the job again from the attempt alone, and
  Ray refuses a second submission of the same id, so a re-launch *adopts* the job already
  there (same command, same metadata) instead of starting a second copy. Two visionloop
  installations sharing one cluster need different prefixes (their ids would collide).
  `launch` also stops earlier attempts of the same job that Ray still runs (a launch whose
  answer was lost to a timeout, then counted as failed): never two attempts at once.
- **Capacity is read from the cluster**: every ALIVE node's `GPU` resource, as Gpu ids
  `{node_id[:8]}/{i}` on node `{node_name}-{node_id[:8]}` (node names default to the IP, which
  several nodes on one host share). GPU type: node label `visionloop.io/gpu-type`, else a
  custom resource `gpu_type:<TYPE>`, else Ray's own `ray.io/accelerator-type` label or
  `accelerator_type:<TYPE>` resource, else "unknown". Price class: node label
  `visionloop.io/price-class` (owned | on_demand | spot), else a custom resource `spot` > 0,
  else Ray's `ray.io/market-type` label (spot | on-demand), else "owned".
- **One run across nodes** (`LaunchRequest.nodes` > 1, `resources.nodes` in a job spec):
  one submission per node, each pinned to its node: node 0's has the attempt's id, node k's
  `{id}-node-{k}`. Each runs the same command with the rendezvous in its runtime env:
  VISIONLOOP_NNODES, VISIONLOOP_NODE_RANK, MASTER_ADDR (node 0's IP as Ray knows it) and
  MASTER_PORT (drawn from `rendezvous_ports` by the submission id); the trainer's launcher
  (visionloop.train.launch) numbers the global ranks from them (gloo on CPU, NCCL on GPU).
  The nodes are the ones the scheduler placed the GPUs on (the same count on each), or for a
  CPU job (one process per node), alive nodes chosen here, most CPUs first. CPUs and memory
  are split evenly between the nodes. The attempt reads as one: *lost* as soon as any node's
  part is (its node died; the survivors, who cannot go on without it, are stopped and the
  control plane requeues the job, which resumes from its checkpoint), *exited* when every
  part has (codes combined as the launcher combines its ranks': all 0 → 0, 0 or 75 → 75,
  else the failure of a part that was not stopped by us), *running* otherwise; a part that
  failed while others run gives them `peer_grace_s` (they fail at their next collective, or
  Ray declares their node dead) before they are stopped. terminate and kill go to every part;
  the log is node 0's (the others: `ray job logs {id}-node-{k}`). Launch is all or nothing:
  a part Ray refuses stops the parts already submitted. Across real machines, gloo and NCCL
  pick a network interface themselves: pass GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME through
  `[jobs] env_allow` where they guess wrong.
- **How the scheduler's picture and Ray's stay consistent.** The scheduler places jobs only
  on the GPUs `capacity()` reported, one node per job (or per node of a multi-node job), and
  `launch` pins the job to that node
  (label selector `ray.io/node-id`; on Ray versions without entrypoint label selectors, the
  node's `node:<ip>` resource) with `entrypoint_num_gpus` = the number of GPUs allocated. So
  per node, Ray never has to fit more than the scheduler counted, and a job that must not
  run on spot capacity never lands on a spot node. *Which* GPUs of that node a job gets is
  Ray's choice: Ray sets `CUDA_VISIBLE_DEVICES` for the entrypoint itself, and the Gpu ids the
  scheduler allocated are advisory (book-keeping for quotas and cost). The scheduler assumes
  it owns the cluster's GPUs: work submitted to Ray by others makes our jobs wait in Ray's
  queue (reported as running, with "pending in Ray" as detail) rather than fail.
- **Termination.** Ray's `stop_job` is no use for a graceful stop: it SIGTERMs the entrypoint
  *and every descendant* (DataLoader workers die, so the trainer cannot checkpoint), SIGKILLs
  all of them after `RAY_JOB_STOP_WAIT_TIME_S` (read by the job's supervisor actor, default
  3 s in Ray 2.60), and then records the job as STOPPED *without* its exit code, so exit 75
  could not be read back. Instead `terminate` submits a tiny *signal job* pinned to the node
  running the attempt, which sends SIGTERM to the attempt's main process only (found in
  /proc by `VISIONLOOP_RAY_SUBMISSION_ID`, set in the entrypoint's own environment, not in the
  supervisor's, and by the cluster's `RAY_ADDRESS`, so that another cluster's attempt of
  the same id on that machine is left alone; the script is in `ray_signal.py`). The trainer
  (or its DDP launcher, which forwards to its ranks) checkpoints and exits 75 in its own
  time, and Ray records exit 75 as the driver's exit code. The grace period is the control
  plane's (`grace_s`): after it, it calls `kill`.
- **Kill.** Every attempt is submitted with `RAY_JOB_STOP_WAIT_TIME_S=0` in its runtime env,
  so `kill` = Ray's `stop_job` = SIGTERM immediately followed by SIGKILL of the whole process
  tree. Ray records STOPPED without an exit code; `poll` reports 137 (128 + SIGKILL), as the
  local executor does. (A `ray job stop` by hand does the same.)
- **Jobs waiting in Ray's queue** (PENDING: their supervisor actor is not scheduled yet,
  e.g. someone else's Ray work holds the GPUs) cannot be signalled: Ray delivers a stop to
  the supervisor, which does not exist yet. `terminate` and `kill` both request the stop
  and it takes effect the moment Ray would start the job (its command is killed as it
  starts; exit 137). Until then the attempt reads as running, holding its GPUs in the
  scheduler's books. Ray fails a job that never gets scheduled after
  RAY_JOB_START_TIMEOUT_SECONDS (15 min by default): exit 126.
- **Exit codes** come from Ray's `driver_exit_code` (a job killed by a signal N reads as
  128 + N, as in a shell). A job whose command never ran (runtime env setup failed, the
  supervisor could not be scheduled or started) reads as 126 with Ray's message as detail;
  a job whose supervisor died with its node reads as `lost` (requeued); a submission Ray
  does not know (never submitted, deleted, or the cluster restarted without GCS fault
  tolerance) is `lost`.
- **Logs** live on the driver's node: `log_path` is None and `read_log` fetches them through
  the dashboard (the whole log per call; Ray has no ranged read). Ray prefixes a line or two
  of its own ("Running entrypoint for job ..."). Because each read costs the whole log, the
  control plane reads a running attempt's progress lines from it at most every
  `visionloop.sched.progress.REMOTE_EVERY_S` (and once more when the attempt ends).
- **Timeouts.** Every HTTP request has a timeout (`request_timeout_s`), so an unresponsive
  dashboard raises ExecutorError instead of hanging the control plane's cycle. RAY_ADDRESS
  or RAY_API_SERVER_ADDRESS in the control plane's environment would silently override
  `address` inside Ray's SDK, so a differing one is refused.
- **Also set for the job** (runtime env): the request's env, VISIONLOOP_JOB_ID,
  VISIONLOOP_ATTEMPT. Paths in the command and env (spec, run dir, VISIONLOOP_HOME) must be
  valid on the Ray nodes: use shared storage.
- **Environment.** Nothing of the control plane's environment reaches a job: Ray's job
  driver inherits the environment of the Ray node that runs it (the raylet's, as `ray start`
  was run there), plus the runtime env's `env_vars`, which are exactly the request's env (what
  the control plane gives a job, and the names in cluster.toml's `[jobs] env_allow`) and the
  variables above. So start the Ray nodes with a clean environment (no credentials the jobs
  must not see), as the user jobs should run as.
- Linux nodes only (the signal job reads /proc).

Handle (JSON, stored by the control plane with the attempt):

    {"executor": "ray", "submission_id": "vl-job-12-attempt-3", "address": DASHBOARD URL,
     "node_id": RAY NODE ID | null, "attempt_dir": ABS PATH}

and, for a run across nodes, `"nodes": [{"submission_id": ..., "node_id": ...}, ...]` (node
rank order) and `"rendezvous": "IP:PORT"`.

Only `submission_id` is indispensable; the bare pre-launch handle `{"attempt_dir":
".../job-12/attempt-3"}` also works (the id is rebuilt from the folder names; see `adopt`).

This module is the executor; it composes parts with one job each:

- `ray_client`: the dashboard's job SDK and state API, every request with a timeout, Ray's
  errors as ExecutorError;
- `ray_ids`: submission ids, from an attempt and from a handle;
- `ray_nodes`: what a node's labels and resources say (GPU type, price class): the capacity;
- `ray_placement`: which node each part of an attempt runs on;
- `ray_rendezvous`: MASTER_ADDR, MASTER_PORT and node rank of a run across nodes;
- `ray_submit`: submitting one node's part, adopting one Ray already has, stopping orphans;
- `ray_status`: Ray's job details as an attempt's status, for one node's part or all of them;
- `ray_signal`: the signal job (`terminate`) and the deletion of finished ones.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from visionloop.core.errors import ExecutorError
from visionloop.sched.executors.base import AttemptStatus, Executor, Handle, LaunchRequest
from visionloop.sched.executors.ray_client import DEFAULT_REQUEST_TIMEOUT_S, RayJobs
from visionloop.sched.executors.ray_ids import (
    check_prefix,
    handle_sid,
    handle_sids,
    node_submission_id,
    require_sid,
    submission_id,
)
from visionloop.sched.executors.ray_nodes import RayNode, read_capacity
from visionloop.sched.executors.ray_placement import place
from visionloop.sched.executors.ray_rendezvous import (
    DEFAULT_RENDEZVOUS_PORTS,
    check_ports,
    rendezvous_address,
    rendezvous_env,
)
from visionloop.sched.executors.ray_signal import SUBMISSION_ENV, SignalJobs
from visionloop.sched.executors.ray_status import (
    EXIT_KILLED,
    EXIT_NOT_STARTED,
    TERMINAL,
    attempt_status,
    job_status,
    read_nodes,
)
from visionloop.sched.executors.ray_submit import stop_orphans, submit
from visionloop.sched.view import Gpu

log = logging.getLogger(__name__)

READ_CHUNK = 64 * 1024
# Multi-node attempts: how long the other nodes may go on after one failed before they are
# stopped: they notice a dead peer at their next collective, and Ray needs a while to declare
# a node dead (a lost node requeues the job, a failure counts against its restarts, so Ray
# gets the time to say).
PEER_GRACE_S = 90.0


class RayExecutor:
    name = "ray"
    multi_node = True  # LaunchRequest.nodes > 1: one submission per node (see the module docstring)

    def __init__(
        self,
        address: str,
        *,
        prefix: str = "vl",
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        rendezvous_ports: tuple[int, int] = DEFAULT_RENDEZVOUS_PORTS,
        peer_grace_s: float = PEER_GRACE_S,
    ) -> None:
        """`address`: the Ray dashboard URL (http://HEAD:8265). `prefix` starts every
        submission id: give each visionloop installation sharing a cluster its own.
        `rendezvous_ports`: the range (inclusive) a multi-node job's MASTER_PORT is drawn from
        on its first node; keep it free of other services there. `peer_grace_s`: how long
        the other nodes of a multi-node attempt may run on after one node's process failed,
        before they are stopped."""
        self.rendezvous_ports = check_ports(rendezvous_ports)
        self.peer_grace_s = peer_grace_s
        self.prefix = check_prefix(prefix)
        self.jobs = RayJobs(address, request_timeout_s)
        self.address = self.jobs.address
        self.request_timeout_s = request_timeout_s
        self.signals = SignalJobs(self.jobs)
        self._lock = threading.Lock()
        self._nodes: dict[str, RayNode] = {}  # short id -> node, from the last capacity()
        self._peer_failed: dict[str, float] = {}  # multi-node attempt -> when a node first failed

    # -- ids --------------------------------------------------------------------------------

    def submission_id(self, job_id: int, attempt: int) -> str:
        return submission_id(self.prefix, job_id, attempt)

    node_submission_id = staticmethod(node_submission_id)

    def _sids(self, handle: Handle, seen: dict[str, Any] | None = None) -> list[str] | None:
        """The attempt's submission ids (`handle_sids`). For a bare handle the other nodes'
        are found by asking Ray about each; what it answered goes into `seen`, so that the
        caller does not ask again."""

        def exists(sid: str) -> bool:
            info = self.jobs.info_quietly(sid)
            if seen is not None and info is not None:
                seen[sid] = info
            return info is not None

        return handle_sids(self.prefix, handle, exists)

    def _require_sids(self, handle: Handle) -> list[str]:
        sids = self._sids(handle)
        return sids if sids is not None else [require_sid(self.prefix, handle)]

    # -- capacity ---------------------------------------------------------------------------

    def capacity(self) -> list[Gpu]:
        return self._read_cluster()[0]

    def _read_cluster(self) -> tuple[list[Gpu], Mapping[str, RayNode]]:
        """The cluster's GPUs and alive nodes, read now; the nodes are kept for `launch`."""
        gpus, known = read_capacity(self.jobs.list_nodes())
        with self._lock:
            self._nodes = known
        return gpus, known

    # -- launch -----------------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> Handle:
        if not request.command:
            raise ExecutorError(f"job {request.job_id}: the command is empty; give the trainer command.")
        sid = self.submission_id(request.job_id, request.attempt)
        with self._lock:
            known = dict(self._nodes)
        placed = place(request, known, self._read_cluster)
        stop_orphans(self.jobs, self.prefix, request)
        base_env = {
            **request.env,
            "VISIONLOOP_JOB_ID": str(request.job_id),
            "VISIONLOOP_ATTEMPT": str(request.attempt),
            # Read by the job's supervisor actor: `stop_job` (our kill) SIGKILLs at once.
            "RAY_JOB_STOP_WAIT_TIME_S": "0",
        }
        nodes: list[dict[str, Any]] = []
        rendezvous = None
        if len(placed) > 1:
            first = placed[0][0]
            assert first is not None  # several nodes are always chosen ones
            rendezvous = rendezvous_address(first, sid, self.rendezvous_ports)
        try:
            for rank, (node, n_gpus) in enumerate(placed):
                node_sid = self.node_submission_id(sid, rank)
                env = dict(base_env)
                if rendezvous is not None:
                    env.update(rendezvous_env(rendezvous, len(placed), rank))
                submit(self.jobs, request, node_sid, node, n_gpus, env, len(placed))
                nodes.append({"submission_id": node_sid, "node_id": node.node_id if node else None})
        except ExecutorError:
            # All nodes or none: a part-started run would wait for its missing peers forever.
            for started in nodes:
                with contextlib.suppress(ExecutorError):
                    self.jobs.stop(started["submission_id"])
            raise
        handle: Handle = {
            "executor": self.name,
            "submission_id": sid,
            "address": self.address,
            "node_id": nodes[0]["node_id"],
            "attempt_dir": str(request.attempt_dir),
        }
        if rendezvous is not None:
            handle.update(nodes=nodes, rendezvous=rendezvous)
        return handle

    def adopt(self, attempt_dir: Path) -> Handle | None:
        """The handle of the attempt whose (pre-launch) folder is `attempt_dir`, if Ray has its
        submission; None otherwise. For a control plane that died between `launch` and storing
        the handle. (An addition to the Executor protocol, as on LocalExecutor; every method
        also accepts the bare `{"attempt_dir": ...}` handle.)"""
        sid = handle_sid(self.prefix, {"attempt_dir": str(attempt_dir)})
        info = None if sid is None else self.jobs.info(sid)
        if sid is None or info is None:
            return None
        node_id = getattr(info, "driver_node_id", None)
        handle: Handle = {
            "executor": self.name,
            "submission_id": sid,
            "address": self.address,
            "node_id": node_id,
            "attempt_dir": str(attempt_dir),
        }
        seen: dict[str, Any] = {sid: info}
        sids = self._sids({"attempt_dir": str(attempt_dir)}, seen) or [sid]
        if len(sids) > 1:
            infos = [seen[s] if s in seen else self.jobs.info(s) for s in sids]
            handle["nodes"] = [
                {"submission_id": s, "node_id": getattr(i, "driver_node_id", None) if i else None}
                for s, i in zip(sids, infos, strict=True)
            ]
        return handle

    # -- poll -------------------------------------------------------------------------------

    def poll(self, handle: Handle) -> AttemptStatus:
        seen: dict[str, Any] = {}
        sids = self._sids(handle, seen)
        if sids is None:
            return AttemptStatus("lost", detail=f"the handle {handle} names no Ray submission")
        if len(sids) > 1:
            return self._poll_nodes(sids, seen)
        sid = sids[0]
        info = self.jobs.info(sid)
        if info is None:
            return AttemptStatus(
                "lost",
                detail=f"Ray has no job {sid}: never submitted, deleted, or the cluster restarted",
            )
        status = attempt_status(info)
        if status.state != "running":
            self.signals.forget(sid)
        return status

    def _poll_nodes(self, sids: list[str], seen: Mapping[str, Any] | None = None) -> AttemptStatus:
        """A multi-node attempt as one (`ray_status.read_nodes`). When it is lost, the nodes
        still running are stopped (they cannot go on without the lost one). A node that
        failed while others still run gives them `peer_grace_s` to notice (they fail at their
        next collective) before they are stopped."""
        seen = seen or {}
        reading = read_nodes(sids, [seen[sid] if sid in seen else self.jobs.info(sid) for sid in sids])
        if reading.status.state == "lost":
            self._stop_all(reading.running, "lost a node")
            self._end_nodes(sids)
        elif reading.status.state == "running":
            if reading.first_failed is not None:
                now = time.monotonic()
                with self._lock:
                    since = self._peer_failed.setdefault(sids[0], now)
                if now - since > self.peer_grace_s:
                    self._stop_all(
                        reading.running, f"node {reading.first_failed} failed {now - since:.0f} s ago"
                    )
        else:
            self._end_nodes(sids)
        return reading.status

    def _stop_all(self, sids: list[str], why: str) -> None:
        for sid in sids:
            log.warning("stopping %s: its multi-node attempt %s", sid, why)
            with contextlib.suppress(ExecutorError):
                self.jobs.stop(sid)

    def _end_nodes(self, sids: list[str]) -> None:
        with self._lock:
            self._peer_failed.pop(sids[0], None)
        for sid in sids:
            self.signals.forget(sid)

    # -- signals ----------------------------------------------------------------------------

    def terminate(self, handle: Handle) -> None:
        """SIGTERM to the attempt's main process on each of its nodes, through a signal job on
        that node (see the module docstring); a part that has not started yet is stopped."""
        for sid in self._require_sids(handle):
            self.signals.terminate(sid)

    def kill(self, handle: Handle) -> None:
        """Ray's stop_job on each node's part: with RAY_JOB_STOP_WAIT_TIME_S=0 in the attempt's
        runtime env, SIGKILL of its whole process tree right away. A no-op on a finished or
        unknown job."""
        for sid in self._require_sids(handle):
            info = self.jobs.info(sid)
            if info is None or job_status(info) in TERMINAL:
                continue
            self.jobs.stop(sid)

    # -- logs -------------------------------------------------------------------------------

    def log_path(self, handle: Handle) -> Path | None:
        return None  # on the driver's node; read_log fetches it

    def read_log(self, handle: Handle, offset: int = 0) -> Iterator[bytes]:
        sid = require_sid(self.prefix, handle)
        text = self.jobs.call(f"read the log of job {sid}", self.jobs.client().get_job_logs, sid)
        data = (text or "").encode("utf-8", "replace")
        for start in range(max(0, offset), len(data), READ_CHUNK):
            yield data[start : start + READ_CHUNK]


if TYPE_CHECKING:

    def _implements_the_protocol(executor: RayExecutor) -> Executor:  # checked by mypy only
        return executor


__all__ = [
    "DEFAULT_RENDEZVOUS_PORTS",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "EXIT_KILLED",
    "EXIT_NOT_STARTED",
    "PEER_GRACE_S",
    "SUBMISSION_ENV",
    "RayExecutor",
    "RayNode",
]
