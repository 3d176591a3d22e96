"""What the Slurm executor reads an attempt's outcome from: each node's shim exit status
(`exit.json`, exact), and for a node that left none, slurmctld's record of the job (see
`slurm.py`'s docstring, Outcomes). The parts of a run across nodes read as one attempt, as the
trainer's launcher combines its ranks' exit codes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from visionloop.sched import shim
from visionloop.sched.executors.attempt_files import log_tail, read_status
from visionloop.sched.executors.base import AttemptStatus
from visionloop.sched.executors.slurm_cli import JobRecord
from visionloop.train.launch import RESUMABLE_EXITS, combine_exit_codes

SLURM_OUT = "slurm.out"  # Slurm's own stdout/stderr of the batch script (before the shims run)
# slurmctld's end states that mean the attempt's machines, not its program, failed.
LOST_STATES = frozenset({"NODE_FAIL", "BOOT_FAIL", "PREEMPTED", "DEADLINE", "REVOKED"})


def node_dirs(attempt_dir: Path, nodes: int) -> list[Path]:
    """Where each node's shim keeps its files: node 0's in the attempt folder itself (its log
    is the attempt's log), node k's in `node-k/` inside it."""
    return [attempt_dir] + [attempt_dir / f"node-{k}" for k in range(1, nodes)]


def exited(shim_dir: Path) -> AttemptStatus | None:
    """The shim's exit status in `shim_dir`, None if it has written none (yet)."""
    ended = read_status(shim_dir / shim.EXIT_JSON)
    if ended is None:
        return None
    return AttemptStatus("exited", exit_code=int(ended["exit_code"]), heartbeat_at=ended.get("ended_at"))


def failed_node(exits: Sequence[AttemptStatus | None]) -> tuple[int, AttemptStatus] | None:
    """The node that failed first (an exit that is neither success nor a checkpointed stop), by
    when it ended: the nodes stopped after it only echo it."""
    failed = [(k, e) for k, e in enumerate(exits) if e is not None and e.exit_code not in RESUMABLE_EXITS]
    return min(failed, key=lambda f: f[1].heartbeat_at or 0.0) if failed else None


def combined(exits: Sequence[AttemptStatus]) -> AttemptStatus:
    """Every node's exit as the attempt's: all 0 → 0; 0 or 75 → 75; 0 or 76 → 76; else the
    first failure, with its node."""
    if len(exits) == 1:
        return exits[0]
    first = failed_node(exits)
    if first is not None:
        k, e = first
        detail = f"node {k} of {len(exits)}: exit {e.exit_code}" + (f"; {e.detail}" if e.detail else "")
        return AttemptStatus("exited", exit_code=e.exit_code, detail=detail, heartbeat_at=e.heartbeat_at)
    code = combine_exit_codes([e.exit_code or 0 for e in exits])
    return AttemptStatus("exited", exit_code=code, detail=f"all {len(exits)} nodes exited")


def from_record(job_id: str, record: JobRecord, attempt_dir: Path, beat: float | None) -> AttemptStatus:
    """A node's part that left Slurm's queue without the shim's exit status, by slurmctld's
    record of the job."""
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


def not_ours(job_id: str, found: str, expected: str) -> str:
    return (
        f"Slurm job {job_id} is named {found!r}, not {expected!r}: the attempt's slurm.json was changed "
        "(the job can write in its folder); that job is left alone, and this attempt counts as lost"
    )
