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
  Slurm's queue (reported as running, "pending in Slurm"), never fail. Runs across nodes
  (`LaunchRequest.nodes` > 1) are not supported yet: use the Ray executor for those.
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
  trainer checkpoints and exits 75 within the control plane's grace period. `kill` cancels
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
from collections.abc import Iterator, Sequence
from pathlib import Path

from visionloop.core.errors import ExecutorError
from visionloop.core.fsutil import atomic_write_json, atomic_write_text
from visionloop.sched import shim
from visionloop.sched.executors.attempt_files import log_tail, mtime, read_log, read_status
from visionloop.sched.executors.base import AttemptStatus, Handle, LaunchRequest
from visionloop.sched.executors.env import job_env
from visionloop.sched.executors.ray_ids import PREFIX_PATTERN
from visionloop.sched.executors.slurm_cli import JobRecord, SlurmCli
from visionloop.sched.view import Gpu

SLURM_JSON = "slurm.json"  # {"slurm_job_id": ..., "name": ...}, written once sbatch answers
SCRIPT = "slurm.sh"
SLURM_OUT = "slurm.out"  # Slurm's own stdout/stderr of the batch script (before the shim runs)
_ATTEMPT_DIR = re.compile(r"job-(\d+)[/\\]attempt-(\d+)[/\\]?$")
# slurmctld's end states that mean the attempt's machine, not its program, failed.
LOST_STATES = frozenset({"NODE_FAIL", "BOOT_FAIL", "PREEMPTED", "DEADLINE", "REVOKED"})


class SlurmExecutor:
    name = "slurm"
    multi_node = False  # one run across nodes: not yet (see the module docstring)

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
    ) -> None:
        if not PREFIX_PATTERN.fullmatch(prefix):
            raise ExecutorError(
                f"SlurmExecutor prefix {prefix!r} is invalid; use lower-case letters, digits and '-', "
                "e.g. 'vl'."
            )
        self.partition = partition
        self.account = account
        self.prefix = prefix
        self.python = python or sys.executable
        self.heartbeat_s = heartbeat_s
        self.cli = SlurmCli(slurm_conf, command_timeout_s)

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
        return f"{self.prefix}-job-{job_id}-attempt-{attempt}"

    def launch(self, request: LaunchRequest) -> Handle:
        if not request.command:
            raise ExecutorError(f"job {request.job_id}: the command is empty; give the trainer command.")
        if request.nodes > 1:
            raise ExecutorError(
                f"job {request.job_id} spans {request.nodes} nodes; the Slurm executor runs a job on one "
                "node for now. Run it with the Ray executor, or resubmit it with resources.nodes: 1."
            )
        nodes = sorted({g.node for g in request.gpus})
        if len(nodes) > 1:
            raise ExecutorError(
                f"job {request.job_id}: its GPUs lie on {len(nodes)} nodes ({', '.join(nodes)}); a job runs "
                "on one node here. This is a scheduler bug: report it with the job's id."
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
            script = self._script(attempt_dir, request.command, hide_gpus=not request.gpus)
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
            "--nodes=1",
            "--ntasks=1",
            f"--cpus-per-task={max(1, math.ceil(request.cpus))}",
        ]
        if request.memory_gb > 0:
            argv.append(f"--mem={math.ceil(request.memory_gb * 1024)}M")
        if self.partition:
            argv.append(f"--partition={self.partition}")
        if self.account:
            argv.append(f"--account={self.account}")
        if request.gpus:
            argv += [f"--nodelist={nodes[0]}", f"--gres=gpu:{len(request.gpus)}"]
        argv.append(str(attempt_dir / SCRIPT))
        out = self.cli.run(argv, env=self.cli.env(env))[1].strip()
        job_id = out.split(";", 1)[0].strip()
        if not job_id.isdigit():
            raise ExecutorError(
                f"sbatch answered {out!r}, not a job id; submit {attempt_dir / SCRIPT} by hand to see why."
            )
        atomic_write_json(attempt_dir / SLURM_JSON, {"slurm_job_id": job_id, "name": name})
        return self._handle(attempt_dir, job_id, name)

    def adopt(self, attempt_dir: Path) -> Handle | None:
        """The full handle of an attempt submitted for `attempt_dir`, from its slurm.json, else
        from Slurm's queue by name; None if Slurm was never given it. (As the local executor's:
        every method also takes the bare `{"attempt_dir": ...}` handle.)"""
        attempt_dir = Path(attempt_dir).expanduser().resolve()
        m = _ATTEMPT_DIR.search(str(attempt_dir))
        if m is None:
            return None
        # The name comes from the folder, never from slurm.json: the job can write there, and
        # every signal checks that the Slurm job it names is this attempt's.
        name = self.job_name(int(m.group(1)), int(m.group(2)))
        info = read_status(attempt_dir / SLURM_JSON)
        if info is not None and str(info.get("slurm_job_id", "")).isdigit():
            return self._handle(attempt_dir, str(info["slurm_job_id"]), name)
        job_id = self.cli.find(name)
        return None if job_id is None else self._handle(attempt_dir, job_id, name)

    # -- poll -----------------------------------------------------------------------------

    def poll(self, handle: Handle) -> AttemptStatus:
        attempt_dir = self._attempt_dir(handle)
        ended = _exited(attempt_dir)
        if ended is not None:
            return ended
        job_id = self._job_id(handle)
        if job_id is None:
            return AttemptStatus(
                "lost", detail="never submitted to Slurm (no slurm.json, and no job of its name queued)"
            )
        beat = mtime(attempt_dir / shim.HEARTBEAT)
        name = self._name(handle)
        queued = self.cli.queue_state(job_id)
        if queued is not None:
            if queued.name != name:
                return AttemptStatus("lost", detail=_not_ours(job_id, queued.name, name))
            detail = f"pending in Slurm ({queued.reason})" if queued.state == "PENDING" else ""
            return AttemptStatus("running", detail=detail, heartbeat_at=beat)
        ended = _exited(attempt_dir)  # the shim writes exit.json just before the job leaves the queue
        if ended is not None:
            return ended
        record = self.cli.record(job_id)
        if record is None:
            return AttemptStatus(
                "lost",
                detail=f"Slurm job {job_id} has ended and Slurm no longer knows it, and it left no exit "
                f"status; its Slurm output: {log_tail(attempt_dir / SLURM_OUT, 500)}",
                heartbeat_at=beat,
            )
        if record.name and record.name != name:
            return AttemptStatus("lost", detail=_not_ours(job_id, record.name, name))
        return _from_record(job_id, record, attempt_dir, beat)

    # -- signals --------------------------------------------------------------------------

    def terminate(self, handle: Handle) -> None:
        """SIGTERM to the shim only (it forwards it to the job's main process); a job still
        pending in Slurm is cancelled. No-op once the attempt has ended."""
        attempt_dir = self._attempt_dir(handle)
        job_id = self._job_id(handle)
        if job_id is None or _exited(attempt_dir) is not None:
            return
        queued = self.cli.queue_state(job_id)
        if queued is None or queued.name != self._name(handle):  # gone, or not ours to stop
            return
        if queued.state == "PENDING":
            self.cli.cancel(job_id)
        else:
            self.cli.signal_batch(job_id, "TERM")

    def kill(self, handle: Handle) -> None:
        """The job cancelled in Slurm: every process of it ends within Slurm's KillWait (see
        the module docstring). Safe on a finished or lost attempt."""
        attempt_dir = self._attempt_dir(handle)
        job_id = self._job_id(handle)
        if job_id is None or _exited(attempt_dir) is not None:
            return
        queued = self.cli.queue_state(job_id)
        if queued is not None and queued.name == self._name(handle):
            self.cli.cancel(job_id)

    # -- logs -----------------------------------------------------------------------------

    def log_path(self, handle: Handle) -> Path | None:
        return self._attempt_dir(handle) / shim.LOG

    def read_log(self, handle: Handle, offset: int = 0) -> Iterator[bytes]:
        """The log from byte `offset` to its current end, in chunks; nothing if there is none yet."""
        return read_log(self._attempt_dir(handle) / shim.LOG, offset)

    # -- internals ------------------------------------------------------------------------

    def _script(self, attempt_dir: Path, command: Sequence[str], *, hide_gpus: bool) -> str:
        argv = [self.python, "-m", "visionloop.sched.shim", str(attempt_dir)]
        argv += ["--heartbeat-s", str(self.heartbeat_s), "--", *command]
        lines = ["#!/bin/sh", "# Written by visionloop's Slurm executor: the attempt's shim runs the job."]
        if hide_gpus:
            # A CPU job sees no GPU: '' hides them all, where unset (what Slurm leaves for a job
            # without gres) would show every GPU of the node.
            lines.append("export CUDA_VISIBLE_DEVICES=")
        # exec: the shim *is* the batch script's process, so `scancel --batch` signals it alone.
        lines.append("exec " + shlex.join(argv))
        return "\n".join(lines) + "\n"

    def _handle(self, attempt_dir: Path, job_id: str, name: str) -> Handle:
        return {"executor": self.name, "attempt_dir": str(attempt_dir), "slurm_job_id": job_id, "name": name}

    def _attempt_dir(self, handle: Handle) -> Path:
        if handle.get("executor", self.name) != self.name or "attempt_dir" not in handle:
            raise ExecutorError(f"not a Slurm executor handle: {handle!r}; pass it to its own executor.")
        return Path(handle["attempt_dir"])

    def _name(self, handle: Handle) -> str:
        """The Slurm job name of the attempt: the handle's (written at launch or by `adopt`),
        else the one its folder gives."""
        name = handle.get("name")
        if isinstance(name, str) and name:
            return name
        adopted = self.adopt(self._attempt_dir(handle))
        return "" if adopted is None else str(adopted["name"])

    def _job_id(self, handle: Handle) -> str | None:
        job_id = handle.get("slurm_job_id")
        if isinstance(job_id, str) and job_id.isdigit():
            return job_id
        adopted = self.adopt(self._attempt_dir(handle))
        return None if adopted is None else str(adopted["slurm_job_id"])

    def _cancel_earlier_attempts(self, job_id: int, attempt: int) -> None:
        """An earlier attempt of the same job that Slurm still runs (its launch was counted as
        failed after a timeout) is stopped: never two attempts of one job at once."""
        stem = f"{self.prefix}-job-{job_id}-attempt-"
        for slurm_id, name in self.cli.named_like(stem):
            if name != self.job_name(job_id, attempt) and name.removeprefix(stem).isdigit():
                with contextlib.suppress(ExecutorError):
                    self.cli.cancel(slurm_id)


def _not_ours(job_id: str, found: str, expected: str) -> str:
    return (
        f"Slurm job {job_id} is named {found!r}, not {expected!r}: the attempt's slurm.json was changed "
        "(the job can write in its folder); that job is left alone, and this attempt counts as lost"
    )


def _exited(attempt_dir: Path) -> AttemptStatus | None:
    ended = read_status(attempt_dir / shim.EXIT_JSON)
    if ended is None:
        return None
    return AttemptStatus("exited", exit_code=int(ended["exit_code"]), heartbeat_at=ended.get("ended_at"))


def _from_record(job_id: str, record: JobRecord, attempt_dir: Path, beat: float | None) -> AttemptStatus:
    """An attempt that left Slurm's queue without the shim's exit status, by slurmctld's record."""
    state = record.state.split("+")[0]
    if state in LOST_STATES:
        return AttemptStatus(
            "lost",
            detail=f"Slurm job {job_id} ended {state} ({record.reason}): its node failed or Slurm took "
            "it back",
            heartbeat_at=beat,
        )
    if record.signal:
        code = 128 + record.signal
    elif state in ("CANCELLED", "TIMEOUT", "OUT_OF_MEMORY"):
        code = 128 + 9  # Slurm recorded no signal: it ended the job, as a SIGKILL would
    else:
        code = record.exit_code
    why = {
        "TIMEOUT": "Slurm's time limit",
        "OUT_OF_MEMORY": "out of memory in Slurm",
        "CANCELLED": "cancelled in Slurm",
    }
    detail = why.get(state, f"Slurm job {job_id} ended {state} before its shim recorded an exit status")
    if state not in why:
        detail += f"; its Slurm output: {log_tail(attempt_dir / SLURM_OUT, 500)}"
    return AttemptStatus("exited", exit_code=code, detail=detail, heartbeat_at=beat)
