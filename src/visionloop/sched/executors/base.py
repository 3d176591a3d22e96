"""The executor contract: what the control plane asks of every place that runs jobs.

The control plane commits an attempt (job RUNNING, GPUs allocated) *before* it calls
`launch`, and stores the returned handle. Everything an executor needs to find the attempt
again must be in that handle, because the control plane may be SIGKILLed at any moment and
restarted: the new process calls `poll(handle)` on every open attempt and re-adopts the ones
still alive. So handles are plain JSON, and an attempt's outcome (its exit code) must be
readable from the handle by a process that did not start it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from visionloop.sched.view import Gpu

Handle = dict[str, Any]  # JSON-serialisable; stored in the job store with the attempt


@dataclass(frozen=True)
class LaunchRequest:
    job_id: int
    attempt: int
    # The trainer command, e.g. [python, -m, visionloop, train, spec.yaml, --run-dir, DIR].
    # Multi-GPU jobs already carry `--nproc-per-node N`; the executor only pins devices.
    command: Sequence[str]
    gpus: Sequence[Gpu]  # the GPUs the scheduler allocated (empty: a CPU job)
    attempt_dir: Path  # where the attempt's log, pid and exit files live
    env: Mapping[str, str] = field(default_factory=dict)
    cpus: float = 1.0  # the job's total (split evenly over `nodes`)
    memory_gb: float = 1.0  # likewise
    # Machines one run spans (one DDP process group): `gpus` then lie on exactly `nodes`
    # nodes, the same number on each (a CPU job: the executor picks the nodes). The executor
    # starts `command` once per node, with the rendezvous in the environment (VISIONLOOP_NNODES,
    # VISIONLOOP_NODE_RANK, MASTER_ADDR, MASTER_PORT: see visionloop.train.launch), and reports
    # the attempt as one: exited when every node's process has, lost when any node was.
    # Executors that run on one machine refuse nodes > 1 (see `multi_node`).
    nodes: int = 1


@dataclass(frozen=True)
class AttemptStatus:
    state: Literal["running", "exited", "lost"]
    exit_code: int | None = None  # set when state == "exited"
    detail: str = ""  # for "lost": what was found (no process, pid reused, ...)
    heartbeat_at: float | None = None  # last sign of life, epoch seconds


class Executor(Protocol):
    name: str

    def capacity(self) -> list[Gpu]:
        """The GPUs this executor can place work on (discovered or configured)."""
        ...

    def launch(self, request: LaunchRequest) -> Handle:
        """Start the attempt and return at once; raise ExecutorError if it cannot start."""
        ...

    def poll(self, handle: Handle) -> AttemptStatus:
        """Where the attempt stands; works from a process that did not launch it."""
        ...

    def terminate(self, handle: Handle) -> None:
        """Ask the attempt to checkpoint and exit (SIGTERM: the trainer exits 75)."""
        ...

    def kill(self, handle: Handle) -> None:
        """Stop the attempt now (SIGKILL), after the grace period ran out."""
        ...

    def log_path(self, handle: Handle) -> Path | None:
        """The attempt's combined stdout/stderr, if the control plane can read it locally."""
        ...

    def read_log(self, handle: Handle, offset: int = 0) -> Iterator[bytes]:
        """The log from byte `offset` on, in pieces (for `jobs logs --follow`)."""
        ...


def multi_node(executor: object) -> bool:
    """Whether `executor` runs one job across several nodes (LaunchRequest.nodes > 1): its
    class says so with `multi_node = True`; the others (the local executor) cannot, and the
    control plane must keep such jobs off them."""
    return getattr(executor, "multi_node", False) is True
