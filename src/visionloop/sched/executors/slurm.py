"""The Slurm executor: each attempt is a batch job on an existing Slurm cluster.

    SlurmExecutor(partition="gpu")      # Slurm's client commands and a slurm.conf here

The control plane only runs Slurm's client commands (sbatch, squeue, scontrol, scancel,
sinfo; `slurm_cli.py`); it never joins the cluster. visionloop's own scheduler decides what
runs where and when; Slurm is asked to run exactly that. Decisions worth knowing:

- **What runs.** The batch script (`slurm.sh` in the attempt's folder) execs the attempt
  shim (`visionloop.sched.shim`), which runs the job's command and writes `log`, `heartbeat`
  and `exit.json` in the attempt folder, as under the local executor. So the attempt folder
  (under the visionloop home) must be on storage that the control plane and the nodes share,
  and visionloop must be installed at the same path on the nodes (`python`, by default this
  interpreter). Slurm's own output (a node that cannot start the shim) goes to `slurm.out`.
- **Placement.** The scheduler places a GPU job on the GPUs `capacity()` reported, on one
  node; the job is submitted with `--nodelist` that node and `--gres=gpu:N`, so Slurm never
  has to fit more there than the scheduler counted. *Which* GPUs of the node it gets is
  Slurm's choice (it sets CUDA_VISIBLE_DEVICES from the node's gres.conf); the Gpu ids are
  book-keeping, as with Ray. A CPU job goes wherever Slurm puts it, with no GPU visible.
  The scheduler assumes it owns the partition's GPUs: others' jobs there make ours wait in
  Slurm's queue (reported as running, "pending in Slurm"), never fail.
- **One run across nodes** (`LaunchRequest.nodes` > 1, `resources.nodes` in a job spec): one
  sbatch job over the nodes the scheduler placed the GPUs on (`--nodes`, `--nodelist`,
  `--gres=gpu:N` per node; Slurm picks the nodes of a CPU job), whose batch script starts one
  shim per node with `srun --ntasks-per-node=1`: node 0's in the attempt folder, node k's in
  `node-k/`. Each runs the same command with the rendezvous in its environment:
  VISIONLOOP_NNODES, VISIONLOOP_NODE_RANK (Slurm's node index), MASTER_ADDR (node 0's
  NodeAddr) and MASTER_PORT (20000 + the Slurm job id mod 20000); the trainer's launcher
  numbers the ranks (gloo on CPU, NCCL on GPU). CPUs and memory are split evenly between the
  nodes. It reads as one attempt: exited when every node's shim has (codes combined as the
  launcher combines its ranks': all 0 → 0, 0 or 75 → 75, else the first failure); a node that
  failed while the others run gives them `peer_grace_s` (they fail at their next collective)
  before the job is cancelled; a node Slurm loses ends the job as NODE_FAIL, which is *lost*
  (requeued, resumed from the checkpoint).
- **Capacity** is read with sinfo: every node of the partition that takes work (idle, mixed,
  allocated, completing), its `gpu` gres counted as GPUs `{node}/{i}`. GPU type: a node
  feature `gpu_type:<TYPE>` naming a type the price catalog knows (`gpu_type:A100-80GB`),
  else the gres type (`gpu:a100:8` gives "a100"). Price class: a node feature `spot`,
  `on_demand` or `owned`, else owned.
- **Finding an attempt again.** Every submission is named `{prefix}-job-{job}-attempt-{n}`
  and its Slurm id is written to `slurm.json` in the attempt folder as soon as sbatch
  answers. A control plane killed in between finds it by name in the queue; a launch of an
  attempt that Slurm already has adopts it instead of submitting a second copy, and a launch
  cancels any earlier attempt of the same job still in Slurm (never two at once).
- **Stopping.** `terminate` signals the batch script only (`scancel --batch
  --signal=TERM`), i.e. the shim, which forwards SIGTERM to the job's main process: the
  trainer checkpoints and exits 75 within the control plane's grace period. A run across
  nodes has a shim per node in a job step, and Slurm signals a step's every process
  (DataLoader workers too, and the trainer could not checkpoint): there `terminate` writes
  the attempt's `stop` file instead, which every node's shim looks for twice a second
  (`--stop-file`) and answers with SIGTERM to its own job process. `kill` cancels
  the job (`scancel`): Slurm sends SIGTERM to every process of the job and SIGKILL after its
  `KillWait` (30 s by default; Slurm has no quicker way that reaches them all: `--signal=KILL`
  is treated as a cancel, and a SIGKILL to the batch script alone left its orphaned
  grandchildren running). It reaches every process only where Slurm tracks them all
  (`ProctrackType=proctrack/cgroup` or `proctrack/linuxproc`; `proctrack/pgid` misses the
  job's own process group, which the shim gives it). A job still pending is simply removed.
- **Outcomes.** The exit code is the shim's `exit.json` (exact, also 75, 128+N for a signal,
  127 for a command not found). Without one, slurmctld's record (`scontrol show job`, kept
  for `MinJobAge`) decides: NODE_FAIL, BOOT_FAIL or a Slurm-side preemption make the attempt
  *lost* (the control plane requeues the job, which resumes from its checkpoint);
  CANCELLED, TIMEOUT and OUT_OF_MEMORY read as a signal death (128+N, 137 if none is
  recorded). A job Slurm no longer knows that left no exit status is lost. Jobs are
  submitted with `--no-requeue`: Slurm never restarts an attempt behind the control plane's
  back (that would run it twice); the control plane requeues instead.
- **Environment.** sbatch runs with the job's clean environment (`env.py`) and exports it
  (`--export=ALL`), so a job sees what a local one would, plus Slurm's SLURM_* variables;
  nothing of the control plane's own environment (VISIONLOOP_DB_URL, credentials) reaches it.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from visionloop.core.errors import ExecutorError, ExecutorUnavailableError
from visionloop.core.fsutil import atomic_write_json, atomic_write_text
from visionloop.sched import shim
from visionloop.sched.executors.attempt_files import log_tail, mtime, read_log, read_status
from visionloop.sched.executors.base import AttemptStatus, Handle, LaunchRequest
from visionloop.sched.executors.env import job_env
from visionloop.sched.executors.naming import attempt_name, attempt_of, check_prefix
from visionloop.sched.executors.slurm_cli import QUEUE_TTL_S, SlurmCli
from visionloop.sched.executors.slurm_status import (
    SLURM_OUT,
    combined,
    exited,
    failed_node,
    from_record,
    node_dirs,
    not_ours,
)
from visionloop.sched.view import Gpu

SLURM_JSON = "slurm.json"  # {"slurm_job_id", "name", "nodes"}, written once sbatch answers
SCRIPT = "slurm.sh"
STOP = "stop"  # a run across nodes: written by `terminate`, answered by every node's shim
PEER_GRACE_S = 90.0  # as the Ray executor's
# sbatch's answer to a request that no node of the partition could ever satisfy.
_NO_SUCH_NODE = re.compile(
    r"requested node configuration is not available|can not be satisfied", re.IGNORECASE
)
PORT_BASE, PORT_SPAN = 20000, 20000  # MASTER_PORT of a run across nodes, by its Slurm job id


class SlurmExecutor:
    name = "slurm"
    multi_node = True

    def __init__(
        self,
        partition: str | None = None,
        *,
        account: str | None = None,
        prefix: str = "vl",
        slurm_conf: str | None = None,
        command_timeout_s: float = 30.0,
        python: str | None = None,
        heartbeat_s: float = shim.DEFAULT_HEARTBEAT_S,
        peer_grace_s: float = PEER_GRACE_S,
        queue_ttl_s: float = QUEUE_TTL_S,
    ) -> None:
        check_prefix(prefix, "SlurmExecutor")
        self.partition = partition
        self.account = account
        self.prefix = prefix
        self.python = python or sys.executable
        self.heartbeat_s = heartbeat_s
        self.peer_grace_s = peer_grace_s
        self.cli = SlurmCli(slurm_conf, command_timeout_s, queue_ttl_s)

    # -- capacity -------------------------------------------------------------------------

    def capacity(self) -> list[Gpu]:
        return [
            Gpu(f"{node.name}/{i}", node.name, node.gpu_type, node.price_class)
            for node in self.cli.nodes(self.partition)
            if node.usable
            for i in range(node.gpus)
        ]

    # -- launch ---------------------------------------------------------------------------

    def job_name(self, job_id: int, attempt: int) -> str:
        return attempt_name(self.prefix, job_id, attempt)

    def launch(self, request: LaunchRequest) -> Handle:
        if not request.command:
            raise ExecutorError(f"job {request.job_id}: the command is empty; give the trainer command.")
        n = max(1, request.nodes)
        nodes = sorted({g.node for g in request.gpus})
        per_node = {node: sum(1 for g in request.gpus if g.node == node) for node in nodes}
        if request.gpus and (len(nodes) != n or len(set(per_node.values())) != 1):
            raise ExecutorError(
                f"job {request.job_id} asks for {n} node(s), but its GPUs lie on {len(nodes)} "
                f"({', '.join(f'{k}: {v}' for k, v in per_node.items())}); the same number on each of "
                f"{n} nodes is needed. This is a scheduler bug: report it with the job's id."
            )
        attempt_dir = Path(request.attempt_dir).expanduser().resolve()
        name = self.job_name(request.job_id, request.attempt)
        adopted = self.adopt(attempt_dir)
        if adopted is not None:  # launched before: the answer was lost, or we were restarted
            return adopted
        if (attempt_dir / shim.EXIT_JSON).exists() or (attempt_dir / shim.SHIM_JSON).exists():
            raise ExecutorError(
                f"attempt dir {attempt_dir} was already used by an earlier launch; launch each attempt in a "
                "new dir, or take the earlier one over with SlurmExecutor.adopt()."
            )
        self._cancel_earlier_attempts(request.job_id, request.attempt)
        try:
            attempt_dir.mkdir(parents=True, exist_ok=True)
            script = self._script(attempt_dir, request.command, hide_gpus=not request.gpus, nodes=n)
            atomic_write_text(attempt_dir / SCRIPT, script)
            (attempt_dir / SCRIPT).chmod(0o755)
        except OSError as e:
            raise ExecutorError(
                f"cannot prepare the attempt dir {attempt_dir}: {e.strerror or e}; "
                "check the path and its permissions."
            ) from e
        env = job_env(os.environ, request.env)
        env.update(
            VISIONLOOP_JOB_ID=str(request.job_id),
            VISIONLOOP_ATTEMPT=str(request.attempt),
            VISIONLOOP_ATTEMPT_DIR=str(attempt_dir),
            **{shim.TOKEN_ENV: secrets.token_hex(8)},
        )
        argv = [
            "sbatch",
            "--parsable",
            f"--job-name={name}",
            # Relative to --chdir: a "%" in the folder's path would be a pattern to sbatch.
            f"--output={SLURM_OUT}",
            "--open-mode=append",
            f"--chdir={attempt_dir}",
            "--no-requeue",
            "--export=ALL",
            f"--nodes={n}",
            "--ntasks-per-node=1",
            f"--cpus-per-task={max(1, math.ceil(request.cpus / n))}",
        ]
        if request.memory_gb > 0:
            argv.append(f"--mem={math.ceil(request.memory_gb * 1024 / n)}M")
        if self.partition:
            argv.append(f"--partition={self.partition}")
        if self.account:
            argv.append(f"--account={self.account}")
        if request.gpus:
            argv += [f"--nodelist={','.join(nodes)}", f"--gres=gpu:{len(request.gpus) // n}"]
        argv.append(str(attempt_dir / SCRIPT))
        try:
            out = self.cli.run(argv, env=self.cli.env(env))[1].strip()
        except ExecutorUnavailableError:
            raise
        except ExecutorError as e:
            if _NO_SUCH_NODE.search(str(e)):
                asked = [
                    a for a in argv if a.startswith(("--cpus-per-task", "--mem", "--gres", "--nodelist"))
                ]
                raise ExecutorError(
                    f"{e}. The job asks, per node, for {' '.join(asked)}: no node of the partition has "
                    "that much. Lower resources.cpus or memory_gb (they are the job's totals, split over "
                    "its nodes), or see what the nodes have: sinfo -N -o '%N %c %m %G'."
                ) from e
            raise
        job_id = out.split(";", 1)[0].strip()
        if not job_id.isdigit():
            raise ExecutorError(
                f"sbatch answered {out!r}, not a job id; submit {attempt_dir / SCRIPT} by hand to see why."
            )
        atomic_write_json(attempt_dir / SLURM_JSON, {"slurm_job_id": job_id, "name": name, "nodes": n})
        return self._handle(attempt_dir, job_id, name, n)

    def adopt(self, attempt_dir: Path) -> Handle | None:
        """The full handle of an attempt submitted for `attempt_dir`, from its slurm.json, else
        from Slurm's queue by name; None if Slurm was never given it. (As the local executor's:
        every method also takes the bare `{"attempt_dir": ...}` handle.)"""
        attempt_dir = Path(attempt_dir).expanduser().resolve()
        ids = attempt_of(attempt_dir)
        if ids is None:
            return None
        # The name comes from the folder, never from slurm.json: the job can write there, and
        # every signal checks that the Slurm job it names is this attempt's.
        name = self.job_name(*ids)
        info = read_status(attempt_dir / SLURM_JSON)
        if info is not None and str(info.get("slurm_job_id", "")).isdigit():
            nodes = info.get("nodes", 1)
            n = nodes if isinstance(nodes, int) and 1 <= nodes <= 1024 else 1
            return self._handle(attempt_dir, str(info["slurm_job_id"]), name, n)
        job_id = self.cli.find(name)
        if job_id is None:
            return None
        queued = self.cli.queue_state(job_id)
        return self._handle(attempt_dir, job_id, name, queued.nodes if queued else 1)

    # -- poll -----------------------------------------------------------------------------

    def poll(self, handle: Handle) -> AttemptStatus:
        attempt_dir = self._attempt_dir(handle)
        h = self._full(handle)
        dirs = node_dirs(attempt_dir, h["nodes"] if h else 1)
        exits = [exited(d) for d in dirs]
        if all(exits):
            return combined([e for e in exits if e is not None])
        if h is None:
            return AttemptStatus(
                "lost", detail="never submitted to Slurm (no slurm.json, and no job of its name queued)"
            )
        job_id, name = h["slurm_job_id"], h["name"]
        beat = mtime(attempt_dir / shim.HEARTBEAT)
        queued = self.cli.queue_state(job_id)
        if queued is not None:
            if queued.name != name:
                return AttemptStatus("lost", detail=not_ours(job_id, queued.name, name))
            if queued.state == "PENDING":
                return AttemptStatus(
                    "running", detail=f"pending in Slurm ({queued.reason})", heartbeat_at=beat
                )
            return self._running(job_id, exits, beat)
        exits = [exited(d) for d in dirs]  # a shim writes exit.json just before its step ends
        if all(exits):
            return combined([e for e in exits if e is not None])
        record = self.cli.record(job_id)
        if record is None:
            return AttemptStatus(
                "lost",
                detail=f"Slurm job {job_id} has ended and Slurm no longer knows it, and "
                f"{sum(e is None for e in exits)} of its {len(exits)} node(s) left no exit status; "
                f"its Slurm output: {log_tail(attempt_dir / SLURM_OUT, 500)}",
                heartbeat_at=beat,
            )
        if record.name and record.name != name:
            return AttemptStatus("lost", detail=not_ours(job_id, record.name, name))
        rest = from_record(job_id, record, attempt_dir, beat)
        if rest.state == "lost":
            return rest
        return combined([e if e is not None else rest for e in exits])

    def _running(self, job_id: str, exits: list[AttemptStatus | None], beat: float | None) -> AttemptStatus:
        """A job Slurm runs. A node that failed while the others run gives them `peer_grace_s`
        to notice (at their next collective) before the job is cancelled; when it ended is in
        its exit status, so a restarted control plane keeps the count."""
        if len(exits) == 1:
            return AttemptStatus("running", heartbeat_at=beat)
        left = sum(e is None for e in exits)
        detail = f"running in Slurm on {len(exits)} nodes ({left} still running)"
        first = failed_node(exits)
        if first is not None:
            k, e = first
            waited = time.time() - (e.heartbeat_at or 0.0)
            detail += f"; node {k} failed (exit {e.exit_code}) {waited:.0f} s ago"
            if waited > self.peer_grace_s:
                self.cli.cancel(job_id)
                detail += ": the others are stopped"
        return AttemptStatus("running", detail=detail, heartbeat_at=beat)

    # -- signals --------------------------------------------------------------------------

    def terminate(self, handle: Handle) -> None:
        """Ask the job's main process to checkpoint and exit: SIGTERM to the shim (one node),
        or the stop file every node's shim looks for (several). A job still pending in Slurm
        is cancelled. No-op once the attempt has ended."""
        attempt_dir = self._attempt_dir(handle)
        h = self._full(handle)
        if h is None or all(exited(d) for d in node_dirs(attempt_dir, h["nodes"])):
            return
        job_id = h["slurm_job_id"]
        queued = self.cli.queue_state(job_id, fresh=True)
        if queued is None or queued.name != h["name"]:  # gone, or not ours to stop
            return
        if queued.state == "PENDING":
            self.cli.cancel(job_id)
        elif h["nodes"] > 1:
            with contextlib.suppress(FileExistsError):
                atomic_write_text(attempt_dir / STOP, f"stop requested at {time.time():.3f}\n")
        else:
            self.cli.signal_batch(job_id, "TERM")

    def kill(self, handle: Handle) -> None:
        """The job cancelled in Slurm: every process of it ends within Slurm's KillWait (see
        the module docstring). Safe on a finished or lost attempt."""
        h = self._full(handle)
        if h is None:
            return
        queued = self.cli.queue_state(h["slurm_job_id"], fresh=True)
        if queued is not None and queued.name == h["name"]:
            self.cli.cancel(h["slurm_job_id"])

    # -- logs -----------------------------------------------------------------------------

    def log_path(self, handle: Handle) -> Path | None:
        return self._attempt_dir(handle) / shim.LOG

    def read_log(self, handle: Handle, offset: int = 0) -> Iterator[bytes]:
        """Node 0's log from byte `offset` to its current end, in chunks; nothing if there is
        none yet (node k's is in `node-k/log` of the attempt folder)."""
        return read_log(self._attempt_dir(handle) / shim.LOG, offset)

    # -- internals ------------------------------------------------------------------------

    def _script(self, attempt_dir: Path, command: Sequence[str], *, hide_gpus: bool, nodes: int) -> str:
        shim_cmd = shlex.join([self.python, "-m", "visionloop.sched.shim"])
        options = ["--heartbeat-s", str(self.heartbeat_s)]
        lines = ["#!/bin/sh", "# Written by visionloop's Slurm executor: the attempt's shim runs the job."]
        # A CPU job sees no GPU: '' hides them all, where unset (what Slurm leaves for a job
        # without gres) would show every GPU of the node.
        hide = "export CUDA_VISIBLE_DEVICES=; " if hide_gpus else ""
        if nodes == 1:
            if hide_gpus:
                lines.append(hide.rstrip("; "))
            # exec: the shim *is* the batch script's process, so `scancel --batch` signals it alone.
            lines.append(
                f"exec {shim_cmd} {shlex.quote(str(attempt_dir))} {shlex.join([*options, '--', *command])}"
            )
            return "\n".join(lines) + "\n"
        options += ["--stop-file", str(attempt_dir / STOP)]
        per_node = (
            f'd={shlex.quote(str(attempt_dir))}; [ "$SLURM_NODEID" = 0 ] || d="$d/node-$SLURM_NODEID"; '
            f'export VISIONLOOP_NODE_RANK="$SLURM_NODEID"; {hide}'
            f'exec {shim_cmd} "$d" {shlex.join([*options, "--", *command])}'
        )
        lines += [
            "# One shim per node (node 0's in this folder, node k's in node-k/), with the rendezvous.",
            'first=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            "MASTER_ADDR=$(scontrol show node \"$first\" | tr ' ' '\\n' | sed -n 's/^NodeAddr=//p' "
            "| head -n 1)",
            '[ -n "$MASTER_ADDR" ] || MASTER_ADDR="$first"',
            f"MASTER_PORT=$(({PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN}))",
            f"VISIONLOOP_NNODES={nodes}",
            "export MASTER_ADDR MASTER_PORT VISIONLOOP_NNODES",
            f"exec srun --nodes={nodes} --ntasks-per-node=1 --kill-on-bad-exit=0 --export=ALL sh -c "
            + shlex.quote(per_node),
        ]
        return "\n".join(lines) + "\n"

    def _handle(self, attempt_dir: Path, job_id: str, name: str, nodes: int) -> Handle:
        return {
            "executor": self.name,
            "attempt_dir": str(attempt_dir),
            "slurm_job_id": job_id,
            "name": name,
            "nodes": nodes,
        }

    def _attempt_dir(self, handle: Handle) -> Path:
        if handle.get("executor", self.name) != self.name or "attempt_dir" not in handle:
            raise ExecutorError(f"not a Slurm executor handle: {handle!r}; pass it to its own executor.")
        return Path(handle["attempt_dir"])

    def _full(self, handle: Handle) -> Handle | None:
        """The handle with its Slurm job id, name and node count: as stored at launch, else
        (a bare `{"attempt_dir": ...}` handle) rebuilt once by `adopt`; None if Slurm was never
        given the attempt."""
        if all(k in handle for k in ("slurm_job_id", "name", "nodes")):
            return handle
        attempt_dir = self._attempt_dir(handle)
        job_id = handle.get("slurm_job_id")
        if not (isinstance(job_id, str) and job_id.isdigit()):
            return self.adopt(attempt_dir)
        # The id stored at launch, with fields missing: the rest from the folder and slurm.json.
        ids = attempt_of(attempt_dir)
        name = handle.get("name") or (self.job_name(*ids) if ids else "")
        nodes = handle.get("nodes")
        if not isinstance(nodes, int):
            adopted = self.adopt(attempt_dir)
            nodes = adopted["nodes"] if adopted else 1
        return self._handle(attempt_dir, job_id, str(name), nodes)

    def _cancel_earlier_attempts(self, job_id: int, attempt: int) -> None:
        """An earlier attempt of the same job that Slurm still runs (its launch was counted as
        failed after a timeout) is stopped: never two attempts of one job at once."""
        stem = f"{self.prefix}-job-{job_id}-attempt-"
        for slurm_id, name in self.cli.named_like(stem):
            if name != self.job_name(job_id, attempt) and name.removeprefix(stem).isdigit():
                with contextlib.suppress(ExecutorError):
                    self.cli.cancel(slurm_id)
