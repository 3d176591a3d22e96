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
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import shlex
import threading
import time
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from visionloop.core.errors import ExecutorError, ExecutorUnavailableError
from visionloop.sched.executors.base import AttemptStatus, Executor, Handle, LaunchRequest
from visionloop.sched.executors.ray_nodes import (
    NODE_ID_LABEL,
    RayNode,
    ip_of,
    node_gpu_type,
    node_price_class,
)
from visionloop.sched.executors.ray_signal import SUBMISSION_ENV, signal_entrypoint
from visionloop.sched.view import Gpu
from visionloop.train.launch import NNODES_ENV, NODE_RANK_ENV, RESUMABLE_EXITS, combine_exit_codes

log = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT_S = 30.0
EXIT_KILLED = 128 + 9  # SIGKILL, as a shell reports it
EXIT_NOT_STARTED = 126  # the command could not be started (a shell's "cannot execute")
READ_CHUNK = 64 * 1024
# Multi-node attempts: where node 0's rank 0 listens (torchrun's default port starts the range),
# and how long the other nodes may go on after one failed before they are stopped: they notice
# a dead peer at their next collective, and Ray needs a while to declare a node dead (a lost
# node requeues the job, a failure counts against its restarts, so Ray gets the time to say).
DEFAULT_RENDEZVOUS_PORTS = (29500, 30499)
PEER_GRACE_S = 90.0
_SHORT = 8  # hex digits of a node id in Gpu ids
_TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
# A supervisor that died (with its node, usually): the attempt's fate is unknown, like a
# local process that vanished, so it is lost and requeued rather than failed.
_LOST_ERRORS = {"JOB_SUPERVISOR_ACTOR_DIED", "JOB_SUPERVISOR_ACTOR_UNKNOWN_FAILURE"}
_ATTEMPT_DIR = re.compile(r"job-(\d+)[/\\]attempt-(\d+)[/\\]?$")
_PREFIX = re.compile(r"[a-z0-9][a-z0-9-]*")


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
        low, high = rendezvous_ports
        if not 1024 <= low <= high <= 65535:
            raise ExecutorError(
                f"RayExecutor rendezvous_ports {rendezvous_ports} is not a port range; give (low, high) "
                "with 1024 <= low <= high <= 65535, e.g. (29500, 30499)."
            )
        self.rendezvous_ports = (low, high)
        self.peer_grace_s = peer_grace_s
        if not _PREFIX.fullmatch(prefix):
            raise ExecutorError(
                f"RayExecutor prefix {prefix!r} is invalid; use lower-case letters, digits and '-', "
                "e.g. 'vl'."
            )
        self.address = address.rstrip("/")
        self.prefix = prefix
        self.request_timeout_s = request_timeout_s
        self._lock = threading.Lock()
        self._client_obj: Any = None
        self._label_selectors: bool | None = None
        self._nodes: dict[str, RayNode] = {}  # short id -> node, from the last capacity()
        self._signal_jobs: dict[str, list[str]] = {}  # attempt's submission id -> signal jobs
        self._peer_failed: dict[str, float] = {}  # multi-node attempt -> when a node first failed

    # -- the Ray client ---------------------------------------------------------------------

    def _client(self) -> Any:
        """The JobSubmissionClient, made on first use (its constructor already calls the
        dashboard), with a timeout on every request: Ray's SDK sets none, and a hung
        dashboard must not hang the control plane's scheduling cycle."""
        with self._lock:
            if self._client_obj is not None:
                return self._client_obj
            for var in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS"):
                value = os.environ.get(var)
                if value and value.rstrip("/") != self.address:
                    raise ExecutorError(
                        f"{var}={value} is set in the control plane's environment; Ray's SDK would use it "
                        f"instead of the address given to RayExecutor ({self.address}). Unset {var}, or "
                        "set it to the same dashboard URL."
                    )
            try:
                from ray.job_submission import JobSubmissionClient
            except ImportError as e:
                raise ExecutorError(
                    "the Ray executor needs Ray's job SDK: `pip install 'visionloop[ray]'` "
                    f"(ray[default]) on the control plane's machine ({e})."
                ) from e
            timeout = self.request_timeout_s

            class _Client(JobSubmissionClient):
                def _do_request(self, method: str, endpoint: str, **kwargs: Any) -> Any:
                    kwargs.setdefault("timeout", timeout)
                    return super()._do_request(method, endpoint, **kwargs)

            try:
                client = _Client(self.address)
            except (OSError, RuntimeError, ValueError) as e:
                raise self._unreachable(e) from e
            params = inspect.signature(JobSubmissionClient.submit_job).parameters
            self._label_selectors = "entrypoint_label_selector" in params
            self._client_obj = client
            return client

    def _unreachable(self, e: BaseException) -> ExecutorError:
        return ExecutorUnavailableError(
            f"cannot reach the Ray dashboard at {self.address}: {_reason(e)}. Is the cluster running? "
            "Check with `ray status` on the head node; the address is the dashboard URL "
            "(http://HEAD:8265), and the head must be started with --dashboard-host reachable from here."
        )

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """One SDK call; None when Ray answers 404 (no such job), ExecutorError otherwise."""
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            if "status code 404" in str(e):
                return None
            raise ExecutorError(f"Ray refused to {what}: {_reason(e)}") from e
        except (OSError, ValueError) as e:
            raise self._unreachable(e) from e

    def _info(self, sid: str) -> Any:
        """The job's JobDetails, or None if Ray has no such submission."""
        return self._call(f"describe job {sid}", self._client().get_job_info, sid)

    # -- ids --------------------------------------------------------------------------------

    def submission_id(self, job_id: int, attempt: int) -> str:
        return f"{self.prefix}-job-{job_id}-attempt-{attempt}"

    @staticmethod
    def node_submission_id(sid: str, rank: int) -> str:
        """Node `rank`'s submission of a multi-node attempt: node 0's is the attempt's own id
        (its log is the attempt's log), the others' `{sid}-node-{rank}`."""
        return sid if rank == 0 else f"{sid}-node-{rank}"

    def _sids(self, handle: Handle) -> list[str] | None:
        """Every submission of the attempt, node 0's first; None if the handle names none.
        A bare pre-launch handle has no node list: the other nodes' are looked up in Ray."""
        nodes = handle.get("nodes")
        if isinstance(nodes, list) and nodes:
            return [str(n["submission_id"]) for n in nodes]
        sid = self._sid(handle)
        if sid is None:
            return None
        sids = [sid]
        if not handle.get("submission_id"):
            while self._info_quietly(self.node_submission_id(sid, len(sids))) is not None:
                sids.append(self.node_submission_id(sid, len(sids)))
        return sids

    def _sid(self, handle: Handle) -> str | None:
        sid = handle.get("submission_id")
        if isinstance(sid, str) and sid:
            return sid
        m = _ATTEMPT_DIR.search(str(handle.get("attempt_dir", "")))
        return self.submission_id(int(m.group(1)), int(m.group(2))) if m else None

    def _require_sid(self, handle: Handle) -> str:
        sid = self._sid(handle)
        if sid is None:
            raise ExecutorError(
                f"the handle {handle} names no Ray submission (no submission_id, and its attempt_dir is not "
                ".../job-N/attempt-M); `ray job list` shows the cluster's jobs."
            )
        return sid

    # -- capacity ---------------------------------------------------------------------------

    def capacity(self) -> list[Gpu]:
        try:
            from ray.util.state import list_nodes
            from ray.util.state.exception import RayStateApiException
        except ImportError as e:
            raise ExecutorError(f"the Ray executor needs `pip install 'visionloop[ray]'` ({e}).") from e
        try:
            nodes = list_nodes(
                address=self.address,
                limit=10_000,
                timeout=max(1, round(self.request_timeout_s)),
                raise_on_missing_output=False,
            )
        except (RayStateApiException, OSError, RuntimeError, ValueError) as e:
            raise self._unreachable(e) from e
        gpus: list[Gpu] = []
        known: dict[str, RayNode] = {}
        alive = [n for n in nodes if str(n.state) == "ALIVE"]
        shorts = [str(n.node_id)[:_SHORT] for n in alive]
        for n, short in zip(alive, shorts, strict=True):
            node_id = str(n.node_id)
            if shorts.count(short) > 1:  # astronomically rare; never give two nodes one name
                short = node_id
            resources: Mapping[str, float] = n.resources_total or {}
            labels: Mapping[str, str] = n.labels or {}
            node = RayNode(
                node_id=node_id,
                ip=str(n.node_ip),
                name=f"{n.node_name or n.node_ip}-{short}",
                cpus=float(resources.get("CPU", 0)),
            )
            known[short] = node
            gpu_type = node_gpu_type(resources, labels)
            price = node_price_class(resources, labels, node.name)
            count = int(resources.get("GPU", 0))
            gpus += [Gpu(f"{short}/{i}", node.name, gpu_type, price) for i in range(count)]
        with self._lock:
            self._nodes = known
        return sorted(gpus, key=lambda g: (g.node, int(g.id.rsplit("/", 1)[1])))

    def _nodes_of(self, request: LaunchRequest) -> list[tuple[RayNode | None, int]]:
        """Where each node's part of the request runs, node rank order, with its GPU count:
        the nodes the scheduler placed the GPUs on (in the order it listed them), or for a CPU
        job, one unpinned entry (Ray's choice) or, across nodes, the nodes picked here."""
        if request.nodes < 1:
            raise ExecutorError(f"job {request.job_id}: nodes is {request.nodes}; it must be at least 1.")
        if not request.gpus:
            if request.nodes == 1:
                return [(None, 0)]
            return [(node, 0) for node in self._cpu_nodes(request)]
        by_node: dict[str, int] = {}
        for g in request.gpus:
            short = g.id.split("/", 1)[0]
            by_node[short] = by_node.get(short, 0) + 1
        if len(by_node) != request.nodes or len(set(by_node.values())) != 1:
            layout = ", ".join(f"{n} on {short}" for short, n in by_node.items())
            raise ExecutorError(
                f"job {request.job_id} spans {request.nodes} node(s), but its GPUs "
                f"{[g.id for g in request.gpus]} lie {layout}: allocate the same number of GPUs on each "
                f"of exactly {request.nodes} node(s) "
                "(visionloop.sched.placement.pick_nodes)."
            )
        with self._lock:
            known = dict(self._nodes)
        if any(short not in known for short in by_node):
            ids = {g.id for g in self.capacity()}
            with self._lock:
                known = dict(self._nodes)
            missing = [g.id for g in request.gpus if g.id not in ids]
            if missing or any(short not in known for short in by_node):
                raise ExecutorError(
                    f"job {request.job_id}: GPUs {missing or [g.id for g in request.gpus]} are not in the "
                    f"Ray cluster any more (it has {sorted(ids)}); a node left or restarted. Restart the "
                    "control plane so it reads the cluster's GPUs again."
                )
        return [(known[short], n) for short, n in by_node.items()]

    def _cpu_nodes(self, request: LaunchRequest) -> list[RayNode]:
        """`request.nodes` distinct alive nodes for a CPU job across nodes: the scheduler
        places no CPU job, so the executor does. Nodes with the most CPUs first (then by name:
        the same choice every time); each must have the job's per-node share of CPUs."""
        self.capacity()  # refreshes self._nodes: the alive nodes
        need = request.cpus / request.nodes
        with self._lock:
            nodes = sorted(self._nodes.values(), key=lambda n: (-n.cpus, n.name))
        fit = [n for n in nodes if n.cpus >= need]
        if len(fit) < request.nodes:
            has = ", ".join(f"{n.name}: {n.cpus:g}" for n in nodes) or "no alive node"
            raise ExecutorError(
                f"job {request.job_id} needs {request.nodes} Ray nodes with {need:g} CPUs each, and the "
                f"cluster has {len(fit)} ({has}); "
                "add nodes, or lower resources.nodes or resources.cpus."
            )
        return fit[: request.nodes]

    def _pin(self, node_id: str, ip: str | None) -> dict[str, Any]:
        """Scheduling kwargs that put an entrypoint on one node."""
        self._client()  # sets _label_selectors
        if self._label_selectors or not ip:
            return {"entrypoint_label_selector": {NODE_ID_LABEL: node_id}}
        # Older Ray: the node's IP resource. Nodes sharing an IP share a host (and its /proc).
        return {"entrypoint_resources": {f"node:{ip}": 0.001}}

    # -- launch -----------------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> Handle:
        if not request.command:
            raise ExecutorError(f"job {request.job_id}: the command is empty; give the trainer command.")
        sid = self.submission_id(request.job_id, request.attempt)
        placed = self._nodes_of(request)
        self._stop_orphans(request)
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
            rendezvous = f"{first.ip}:{self._rendezvous_port(sid)}"
        try:
            for rank, (node, n_gpus) in enumerate(placed):
                node_sid = self.node_submission_id(sid, rank)
                env = dict(base_env)
                if rendezvous is not None:
                    addr, port = rendezvous.rsplit(":", 1)
                    env.update(
                        {
                            NNODES_ENV: str(len(placed)),
                            NODE_RANK_ENV: str(rank),
                            "MASTER_ADDR": addr,
                            "MASTER_PORT": port,
                        }
                    )
                self._submit(request, node_sid, node, n_gpus, env, len(placed))
                nodes.append({"submission_id": node_sid, "node_id": node.node_id if node else None})
        except ExecutorError:
            # All nodes or none: a part-started run would wait for its missing peers forever.
            for started in nodes:
                with contextlib.suppress(ExecutorError):
                    self._call(
                        f"stop job {started['submission_id']}",
                        self._client().stop_job,
                        started["submission_id"],
                    )
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

    def _submit(
        self,
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
            kwargs.update(self._pin(node.node_id, node.ip))
        client = self._client()
        try:
            client.submit_job(**kwargs)
        except RuntimeError as e:
            if "already exists" not in str(e):
                raise ExecutorError(f"Ray refused job {sid}: {_reason(e)}") from e
            self._check_adoptable(sid, entrypoint, request)
        except (OSError, ValueError) as e:
            # The request may have reached Ray: look before giving up, so a job that did start
            # is adopted rather than left running unaccounted for.
            if self._info_quietly(sid) is None:
                raise self._unreachable(e) from e
            self._check_adoptable(sid, entrypoint, request)

    def _rendezvous_port(self, sid: str) -> int:
        """MASTER_PORT of a multi-node attempt: drawn from the range by the submission id, so
        a re-launch (adoption) gets the same one and the next attempt most likely another
        (the control plane cannot see which ports are free on a Ray node; a taken one fails
        the attempt, and its retry draws again)."""
        low, high = self.rendezvous_ports
        return low + zlib.crc32(sid.encode()) % (high - low + 1)

    def _check_adoptable(self, sid: str, entrypoint: str, request: LaunchRequest) -> None:
        """A submission with this id exists: adopt it if it is this very attempt."""
        info = self._info(sid)
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

    def _stop_orphans(self, request: LaunchRequest) -> None:
        """Stop earlier attempts of this job that Ray still runs. The control plane launches
        attempt N only after attempt N-1 ended in its books, so a live one is an orphan: a
        launch whose answer was lost (timeout) and then counted as failed. Never two at once."""
        for n in range(max(1, request.attempt - 3), request.attempt):
            attempt_sid = self.submission_id(request.job_id, n)
            for rank in range(max(request.nodes, 1)):
                sid = self.node_submission_id(attempt_sid, rank)
                info = self._info_quietly(sid)
                if info is not None and _status(info) not in _TERMINAL:
                    log.warning(
                        "job %s: earlier attempt %s still runs in Ray; stopping it", request.job_id, sid
                    )
                    self._call(f"stop job {sid}", self._client().stop_job, sid)

    def _info_quietly(self, sid: str) -> Any:
        try:
            return self._info(sid)
        except ExecutorError:
            return None

    def adopt(self, attempt_dir: Path) -> Handle | None:
        """The handle of the attempt whose (pre-launch) folder is `attempt_dir`, if Ray has its
        submission; None otherwise. For a control plane that died between `launch` and storing
        the handle. (An addition to the Executor protocol, as on LocalExecutor; every method
        also accepts the bare `{"attempt_dir": ...}` handle.)"""
        sid = self._sid({"attempt_dir": str(attempt_dir)})
        info = None if sid is None else self._info(sid)
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
        sids = self._sids({"attempt_dir": str(attempt_dir)}) or [sid]
        if len(sids) > 1:
            infos = [info] + [self._info(s) for s in sids[1:]]
            handle["nodes"] = [
                {"submission_id": s, "node_id": getattr(i, "driver_node_id", None) if i else None}
                for s, i in zip(sids, infos, strict=True)
            ]
        return handle

    # -- poll -------------------------------------------------------------------------------

    def poll(self, handle: Handle) -> AttemptStatus:
        sids = self._sids(handle)
        if sids is None:
            return AttemptStatus("lost", detail=f"the handle {handle} names no Ray submission")
        if len(sids) > 1:
            return self._poll_nodes(sids)
        sid = sids[0]
        info = self._info(sid)
        if info is None:
            return AttemptStatus(
                "lost",
                detail=f"Ray has no job {sid}: never submitted, deleted, or the cluster restarted",
            )
        status = _attempt_status(info)
        if status.state != "running":
            self._forget_signal_jobs(sid)
        return status

    def _poll_nodes(self, sids: list[str]) -> AttemptStatus:
        """A multi-node attempt as one: lost as soon as any node's part is (its node died:
        the whole job is requeued, and the other nodes, which cannot go on without it, are
        stopped); exited when every node's part has, with their codes combined as the
        launcher combines its ranks' (all 0 → 0; 0 or 75 → 75; 0 or 76 → 76; else the first failure, a
        node that failed by itself before one that was stopped); running otherwise. A node
        that failed while others still run gives them `peer_grace_s` to notice (they fail
        at their next collective) before they are stopped."""
        infos = [self._info(sid) for sid in sids]
        statuses = [
            AttemptStatus("lost", detail=f"Ray has no job {sid}") if info is None else _attempt_status(info)
            for sid, info in zip(sids, infos, strict=True)
        ]
        running = [sid for sid, st in zip(sids, statuses, strict=True) if st.state == "running"]
        lost = [(rank, st) for rank, st in enumerate(statuses) if st.state == "lost"]
        if lost:
            self._stop_all(running, "lost a node")
            self._end_nodes(sids)
            rank, st = lost[0]
            return AttemptStatus("lost", detail=f"node {rank} of {len(sids)} ({sids[rank]}): {st.detail}")
        exited = [
            (rank, st, _status(infos[rank]) == "STOPPED")
            for rank, st in enumerate(statuses)
            if st.state == "exited" and st.exit_code is not None
        ]
        failed = [f for f in exited if f[1].exit_code not in RESUMABLE_EXITS]
        if running:
            if failed:
                now = time.monotonic()
                with self._lock:
                    since = self._peer_failed.setdefault(sids[0], now)
                if now - since > self.peer_grace_s:
                    self._stop_all(running, f"node {failed[0][0]} failed {now - since:.0f} s ago")
            return AttemptStatus(
                "running", detail=f"running in Ray on {len(sids)} nodes ({len(running)} still running)"
            )
        self._end_nodes(sids)
        if not failed:
            code = combine_exit_codes([st.exit_code or 0 for _, st, _ in exited])
            return AttemptStatus("exited", exit_code=code, detail=f"all {len(sids)} nodes exited")
        # The node that failed by itself says why; the ones we stopped after it only echo it.
        rank, st, _ = sorted(failed, key=lambda f: f[2])[0]
        detail = f"node {rank} of {len(sids)} ({sids[rank]}): exit {st.exit_code}" + (
            f"; {st.detail}" if st.detail else ""
        )
        return AttemptStatus("exited", exit_code=st.exit_code, detail=detail)

    def _stop_all(self, sids: list[str], why: str) -> None:
        for sid in sids:
            log.warning("stopping %s: its multi-node attempt %s", sid, why)
            with contextlib.suppress(ExecutorError):
                self._call(f"stop job {sid}", self._client().stop_job, sid)

    def _end_nodes(self, sids: list[str]) -> None:
        with self._lock:
            self._peer_failed.pop(sids[0], None)
        for sid in sids:
            self._forget_signal_jobs(sid)

    # -- signals ----------------------------------------------------------------------------

    def terminate(self, handle: Handle) -> None:
        """SIGTERM to the attempt's main process on each of its nodes, through a signal job on
        that node (see the module docstring); a part that has not started yet is stopped."""
        for sid in self._require_sids(handle):
            self._terminate_one(sid)

    def _terminate_one(self, sid: str) -> None:
        info = self._info(sid)
        if info is None or _status(info) in _TERMINAL:
            return
        node_id = getattr(info, "driver_node_id", None)
        if _status(info) == "PENDING" or not node_id:
            # Nothing to checkpoint yet: stop it (its command may be starting this instant).
            self._call(f"stop job {sid}", self._client().stop_job, sid)
            return
        signal_sid = f"{sid}-sigterm-{time.time_ns() // 1_000_000}"
        self._call(
            f"submit the signal job {signal_sid}",
            self._client().submit_job,
            entrypoint=signal_entrypoint(sid, "TERM"),
            submission_id=signal_sid,
            metadata={"visionloop_signal_for": sid},
            entrypoint_num_cpus=0,
            **self._pin(node_id, ip_of(getattr(info, "driver_agent_http_address", None))),
        )
        with self._lock:
            self._signal_jobs.setdefault(sid, []).append(signal_sid)

    def kill(self, handle: Handle) -> None:
        """Ray's stop_job on each node's part: with RAY_JOB_STOP_WAIT_TIME_S=0 in the attempt's
        runtime env, SIGKILL of its whole process tree right away. A no-op on a finished or
        unknown job."""
        for sid in self._require_sids(handle):
            info = self._info(sid)
            if info is None or _status(info) in _TERMINAL:
                continue
            self._call(f"stop job {sid}", self._client().stop_job, sid)

    def _require_sids(self, handle: Handle) -> list[str]:
        sids = self._sids(handle)
        return sids if sids is not None else [self._require_sid(handle)]

    def _forget_signal_jobs(self, sid: str) -> None:
        """Delete the finished signal jobs of an attempt that ended, so `ray job list` does not
        fill up with them; failed ones stay for inspection."""
        with self._lock:
            pending = self._signal_jobs.pop(sid, [])
        for signal_sid in pending:
            try:
                info = self._info(signal_sid)
                if info is not None and _status(info) == "SUCCEEDED":
                    self._client().delete_job(signal_sid)
            except (ExecutorError, RuntimeError, OSError) as e:
                log.debug("could not delete signal job %s: %s", signal_sid, e)

    # -- logs -------------------------------------------------------------------------------

    def log_path(self, handle: Handle) -> Path | None:
        return None  # on the driver's node; read_log fetches it

    def read_log(self, handle: Handle, offset: int = 0) -> Iterator[bytes]:
        sid = self._require_sid(handle)
        text = self._call(f"read the log of job {sid}", self._client().get_job_logs, sid)
        data = (text or "").encode("utf-8", "replace")
        for start in range(max(0, offset), len(data), READ_CHUNK):
            yield data[start : start + READ_CHUNK]


def _status(info: Any) -> str:
    """A JobDetails' status as a plain string ("RUNNING", ...)."""
    return str(getattr(info.status, "value", info.status))


def _attempt_status(info: Any) -> AttemptStatus:
    status = _status(info)
    message = _reason(info.message or "")
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


def _reason(e: BaseException | str) -> str:
    """The line of a Ray error that says what went wrong: Ray's SDK wraps server-side
    exceptions as "Request failed with status code 500: Traceback ...", reason last."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip().strip(".")]
    if not lines:
        return type(e).__name__ if isinstance(e, BaseException) else ""
    return lines[-1] if len(lines) > 1 and "Traceback" in lines[0] else lines[0]


if TYPE_CHECKING:

    def _implements_the_protocol(executor: RayExecutor) -> Executor:  # checked by mypy only
        return executor


__all__ = ["RayExecutor", "RayNode"]
