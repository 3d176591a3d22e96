"""Talking to Slurm through its own commands (sbatch, squeue, scontrol, scancel, sinfo), and
reading what they print. Every call has a time limit and its failure becomes an
ExecutorError that quotes Slurm; every parser takes Slurm's text and returns typed values,
so the executor never handles raw output.

Only the client commands are needed on the control plane's machine, with a slurm.conf that
names the cluster (`SLURM_CONF`, or the executor's `slurm_conf`); no accounting database
(slurmdbd): a job is read from squeue while it is queued or running, then from scontrol
while slurmctld still remembers it (`MinJobAge`, 300 s by default), and after that from the
exit status the attempt's shim wrote (see `slurm.py`).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from visionloop.core.errors import ExecutorError, ExecutorUnavailableError
from visionloop.sched.view import PriceClass

# squeue's states of a job that still holds, or waits for, its allocation.
ACTIVE_STATES = frozenset(
    {
        "PENDING",
        "CONFIGURING",
        "RUNNING",
        "COMPLETING",
        "SUSPENDED",
        "REQUEUED",
        "REQUEUE_FED",
        "REQUEUE_HOLD",
        "RESIZING",
        "SIGNALING",
        "STAGE_OUT",
        "STOPPED",
        "RESV_DEL_HOLD",
    }
)
# A node in one of these base states takes new work (sinfo's long names, lower case).
USABLE_NODE_STATES = frozenset({"idle", "mixed", "allocated", "completing", "planned"})
# What the executor reads of a queued job: state, reason, name and node count.
_QUEUE_FORMAT = "%T|%r|%j|%D"
QUEUE_TTL_S = 1.0  # the queue is read whole at most this often (see SlurmCli.queue_state)
# What Slurm's clients say when slurmctld cannot be reached (down, wrong host or port).
_UNREACHABLE = re.compile(
    r"unable to contact slurm controller|socket timed out|connection refused|could not establish a "
    r"configuration source",
    re.IGNORECASE,
)
# What slurmctld answers about a job it no longer (or never did) know.
_UNKNOWN_JOB = re.compile(r"invalid job id", re.IGNORECASE)
_GRES_GPU = re.compile(r"^gpu(?::(?P<type>[^:(]+))?:(?P<count>\d+)")
_PRICE_CLASSES: dict[str, PriceClass] = {
    "owned": "owned",
    "on_demand": "on_demand",
    "on-demand": "on_demand",
    "ondemand": "on_demand",
    "spot": "spot",
}


@dataclass(frozen=True)
class SlurmNode:
    """A node as sinfo shows it: its GPUs (gres `gpu[:type]:count`), type and price class from
    its features, and whether it takes new work."""

    name: str
    gpus: int
    gpu_type: str
    price_class: PriceClass
    usable: bool
    state: str


@dataclass(frozen=True)
class JobRecord:
    """What slurmctld says of a job that has left the queue (scontrol show job)."""

    state: str  # COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY, ...
    exit_code: int  # the batch script's exit status (0 when a signal ended it)
    signal: int  # the signal that ended it, 0 if none
    reason: str
    name: str = ""


@dataclass(frozen=True)
class Queued:
    """A job still in Slurm's queue (squeue): pending, running or completing."""

    state: str
    reason: str
    name: str
    nodes: int = 1


class SlurmCli:
    """Runs Slurm's commands with `timeout_s` each, in an environment that names the cluster
    (`slurm_conf`, else the caller's SLURM_CONF) and holds nothing else of ours but PATH."""

    def __init__(
        self, slurm_conf: str | None = None, timeout_s: float = 30.0, queue_ttl_s: float = QUEUE_TTL_S
    ) -> None:
        self.slurm_conf = slurm_conf or os.environ.get("SLURM_CONF") or None
        self.timeout_s = timeout_s
        self.queue_ttl_s = queue_ttl_s
        self._lock = threading.Lock()
        self._queue: dict[str, Queued] = {}
        self._queue_at = -math.inf

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(extra or {})}
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        return env

    def run(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        ok_if: re.Pattern[str] | None = None,
    ) -> tuple[int, str]:
        """(exit code, stdout). A non-zero exit raises ExecutorError with Slurm's message,
        unless its stderr matches `ok_if` (an expected answer, such as an unknown job id)."""
        try:
            done = subprocess.run(
                list(argv),
                env=dict(env) if env is not None else self.env(),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=self.timeout_s,
            )
        except FileNotFoundError as e:
            raise ExecutorError(
                f"{argv[0]} is not installed here: the Slurm executor needs Slurm's client commands "
                "(sbatch, squeue, scontrol, scancel, sinfo) on the control plane's machine, e.g. "
                "apt-get install slurm-client."
            ) from e
        except subprocess.TimeoutExpired as e:
            # Unavailable, not failed: a launch that meets it is not held against the job.
            raise ExecutorUnavailableError(
                f"{' '.join(argv[:2])} did not answer within {self.timeout_s:g} s; is slurmctld up "
                "(`scontrol ping`)? Raise executor.command_timeout_s if it is only slow."
            ) from e
        if done.returncode != 0 and not (ok_if and ok_if.search(done.stderr)):
            said = done.stderr.strip()[-500:] or "(no message)"
            if _UNREACHABLE.search(done.stderr):
                raise ExecutorUnavailableError(
                    f"cannot reach slurmctld ({argv[0]}: {said}); is it running (`scontrol ping`)? The "
                    f"cluster is the one {self.slurm_conf or 'Slurm finds by default'} names "
                    "(executor.slurm_conf, else SLURM_CONF)."
                )
            raise ExecutorError(f"{' '.join(argv[:2])} failed (exit {done.returncode}): {said}")
        return done.returncode, done.stdout

    # -- queries ------------------------------------------------------------------------

    def nodes(self, partition: str | None) -> list[SlurmNode]:
        argv = ["sinfo", "--noheader", "--Node", "--format=%N|%G|%f|%T"]
        if partition:
            argv.append(f"--partition={partition}")
        return parse_sinfo(self.run(argv)[1])

    def queue_state(self, job_id: str, *, fresh: bool = False) -> Queued | None:
        """The job while it is in the queue (pending, running, completing); None once it has
        left it, or if slurmctld does not know it.

        A control plane polls every attempt each cycle: one squeue per job would be a process
        and an RPC to slurmctld per running job per cycle (which Slurm admins rightly forbid).
        So the whole queue is read at most once per `queue_ttl_s`, and a job found there is
        answered from it; a job missing from it (it ended, or was submitted since) is asked
        about alone, so an answer is never staler than the snapshot for a running job.
        `fresh`: ask about the job alone now (before signalling it, which depends on whether it
        has started)."""
        if self.queue_ttl_s > 0 and not fresh:
            with self._lock:
                now = time.monotonic()
                if now - self._queue_at > self.queue_ttl_s:
                    out = self.run(["squeue", "--noheader", f"--format=%i|{_QUEUE_FORMAT}"])[1]
                    self._queue = parse_squeue_all(out)
                    self._queue_at = now
                found = self._queue.get(job_id)
            if found is not None:
                return found
        code, out = self.run(
            ["squeue", "--noheader", f"--jobs={job_id}", f"--format={_QUEUE_FORMAT}"], ok_if=_UNKNOWN_JOB
        )
        if code != 0:
            return None
        return parse_squeue_state(out)

    def forget(self, job_id: str) -> None:
        """Drop the job from the queue snapshot (it was just signalled or cancelled)."""
        with self._lock:
            self._queue.pop(job_id, None)

    def find(self, name: str) -> str | None:
        """The id of the queued or running job named `name`, None if there is none."""
        out = self.run(["squeue", "--noheader", f"--name={name}", "--format=%i"])[1]
        ids = [line.strip() for line in out.splitlines() if line.strip()]
        return ids[0] if ids else None

    def named_like(self, prefix: str) -> list[tuple[str, str]]:
        """(id, name) of every queued or running job whose name starts with `prefix`."""
        out = self.run(["squeue", "--noheader", "--format=%i|%j"])[1]
        rows = [line.split("|", 1) for line in out.splitlines() if "|" in line]
        return [(i.strip(), n.strip()) for i, n in rows if n.strip().startswith(prefix)]

    def record(self, job_id: str) -> JobRecord | None:
        """The job as slurmctld remembers it; None once it has forgotten it (MinJobAge)."""
        code, out = self.run(["scontrol", "--oneliner", "show", "job", job_id], ok_if=_UNKNOWN_JOB)
        return None if code != 0 else parse_job_record(out)

    # -- actions --------------------------------------------------------------------------

    def signal_batch(self, job_id: str, sig: str) -> None:
        """`sig` to the job's batch script only (the attempt's shim), not to its children: the
        shim forwards it to the job's main process (a checkpointing trainer needs its
        DataLoader workers)."""
        self.run(["scancel", "--batch", f"--signal={sig}", job_id], ok_if=_UNKNOWN_JOB)
        self.forget(job_id)

    def cancel(self, job_id: str) -> None:
        """Slurm's own stop: SIGTERM to every process of the job, SIGKILL after the cluster's
        KillWait (30 s by default), through its process tracking, so children that left the
        job's process group go too. A pending job is just removed. (`scancel --signal=KILL`
        is no quicker: Slurm treats it as this; `--batch --signal=KILL` kills the batch script
        alone, and left its orphaned grandchildren running here.)"""
        self.run(["scancel", job_id], ok_if=_UNKNOWN_JOB)
        self.forget(job_id)


# -- parsers ----------------------------------------------------------------------------------


def parse_sinfo(text: str) -> list[SlurmNode]:
    """sinfo --Node --format=%N|%G|%f|%T: one node per line (a node in two partitions appears
    twice and is kept once). GPU type: a feature `gpu_type:<TYPE>` (a name the price catalog
    knows, e.g. gpu_type:A100-80GB), else the gres type (gpu:a100:8 → "a100"), else
    "unknown". Price class: a feature `spot`, `on_demand` or `owned` (or
    `price_class:<class>`), else owned."""
    nodes: dict[str, SlurmNode] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4 or not parts[0]:
            continue
        name, gres, features, state = (p.strip() for p in parts)
        gpus, gres_type = 0, ""
        for item in gres.split(","):
            m = _GRES_GPU.match(item.strip())
            if m:
                gpus += int(m.group("count"))
                gres_type = gres_type or (m.group("type") or "")
        feats = [f.strip() for f in features.split(",") if f.strip() and f.strip() != "(null)"]
        gpu_type = next((f.split(":", 1)[1] for f in feats if f.startswith("gpu_type:")), "") or gres_type
        price: PriceClass = "owned"
        for f in feats:
            key = f.split(":", 1)[1] if f.startswith("price_class:") else f
            if key.lower() in _PRICE_CLASSES:
                price = _PRICE_CLASSES[key.lower()]
        base = state.lower().rstrip("*~#!%$@^-+").split("+")[0]
        nodes.setdefault(
            name,
            SlurmNode(
                name=name,
                gpus=gpus,
                gpu_type=gpu_type or "unknown",
                price_class=price,
                # A trailing "*" means slurmctld cannot reach the node's slurmd.
                usable=base in USABLE_NODE_STATES and not state.endswith("*"),
                state=state,
            ),
        )
    return list(nodes.values())


def parse_squeue_all(text: str) -> dict[str, Queued]:
    """squeue --format=%i|%T|%r|%j|%D of the whole queue: the active jobs by id."""
    jobs = {}
    for line in text.splitlines():
        job_id, _, rest = line.strip().partition("|")
        queued = parse_squeue_state(rest)
        if job_id and queued is not None:
            jobs[job_id] = queued
    return jobs


def parse_squeue_state(text: str) -> Queued | None:
    """squeue --format=%T|%r|%j|%D of one job, if it is still active."""
    for line in text.splitlines():
        state, _, rest = line.strip().partition("|")
        reason, _, rest = rest.partition("|")
        name, _, nodes = rest.partition("|")
        if state in ACTIVE_STATES:
            return Queued(state, reason.strip(), name.strip(), int(nodes) if nodes.strip().isdigit() else 1)
    return None


def parse_job_record(text: str) -> JobRecord | None:
    """scontrol --oneliner show job: JobState, ExitCode=<status>:<signal> and Reason."""
    fields = {m.group(1): m.group(2) for m in re.finditer(r"(\w+)=(\S*)", text)}
    if "JobState" not in fields:
        return None
    status, _, sig = fields.get("ExitCode", "0:0").partition(":")
    try:
        exit_code, signal = int(status), int(sig or 0)
    except ValueError:
        exit_code, signal = 0, 0
    return JobRecord(
        state=fields["JobState"],
        exit_code=exit_code,
        signal=signal,
        reason=fields.get("Reason", "None"),
        name=fields.get("JobName", ""),
    )
