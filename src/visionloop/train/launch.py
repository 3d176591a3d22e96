"""`visionloop train --nproc-per-node N`: N local DDP processes with torchrun's environment.

Why not simply exec torchrun: torchrun turns any non-zero worker exit into its own exit 1
and prints a SignalException traceback when it is asked to stop, so the "75 = stopped
after a checkpoint, rerun to resume" contract would be lost. This launcher sets the same
variables torchrun sets (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), forwards
SIGTERM/SIGUSR1/SIGINT to every worker, and maps their exits to one code.

**Several machines** (one process group over N nodes): whoever starts the command on each
node (the Ray executor does) sets, in its environment, VISIONLOOP_NNODES (N),
VISIONLOOP_NODE_RANK (0 .. N-1), MASTER_ADDR and MASTER_PORT (where node 0's rank 0 listens;
torchrun's names). The launcher then gives its local ranks the global RANK
`node_rank * nproc + local_rank` and WORLD_SIZE `N * nproc`; a command without
`--nproc-per-node` (one process per node, e.g. a CPU job) is itself rank `node_rank`
(visionloop.train.dist.from_env reads the same variables). Every node must run the same
`--nproc-per-node`. torchrun's own `--nnodes/--node-rank` work too: it sets WORLD_SIZE itself.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType

from visionloop.core.errors import TrainingError
from visionloop.train.signals import EXIT_PAUSED, EXIT_PREEMPTED

# Exits after which a rank's siblings are left to finish: done, stopped, paused at a rung.
RESUMABLE_EXITS = (0, EXIT_PREEMPTED, EXIT_PAUSED)

NNODES_ENV = "VISIONLOOP_NNODES"
NODE_RANK_ENV = "VISIONLOOP_NODE_RANK"

# After one worker fails, how long the others get to notice and exit before SIGKILL.
FAILURE_GRACE_S = 30.0


# Where rank 0's port is drawn from: below the kernel's usual ephemeral range (32768-60999),
# where outgoing connections take their ports.
RENDEZVOUS_PORTS = (10000, 20000)


def free_port() -> int:
    """A port that rank 0 can listen on. Between this pick and rank 0's bind (seconds: Python
    and torch start first) the port is nobody's, and any outgoing connection on the machine
    may take an ephemeral one: a port from the kernel's port-0 range failed with EADDRINUSE
    in CI. So it is drawn below that range, checked free, and only as a last resort port 0."""
    rng = random.Random()
    for _ in range(100):
        port = rng.randrange(*RENDEZVOUS_PORTS)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use: draw again
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class NodeLayout:
    """This node's place in a multi-node run, from the environment its launcher set."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int


def node_layout(env: Mapping[str, str]) -> NodeLayout | None:
    """The multi-node rendezvous in `env` (see the module docstring), or None on one node."""
    raw = env.get(NNODES_ENV, "")
    if not raw:
        return None
    try:
        nnodes, node_rank = int(raw), int(env.get(NODE_RANK_ENV, ""))
        port = int(env.get("MASTER_PORT", ""))
    except ValueError as e:
        raise TrainingError(
            f"{NNODES_ENV}={raw!r} is set, so {NODE_RANK_ENV} and MASTER_PORT must be integers too "
            f"({NODE_RANK_ENV}={env.get(NODE_RANK_ENV)!r}, MASTER_PORT={env.get('MASTER_PORT')!r}); "
            "set all four (with MASTER_ADDR) or none."
        ) from e
    addr = env.get("MASTER_ADDR", "")
    if nnodes < 1 or not 0 <= node_rank < nnodes or not addr or not 0 < port < 65536:
        raise TrainingError(
            f"bad multi-node rendezvous: {NNODES_ENV}={nnodes}, {NODE_RANK_ENV}={node_rank}, "
            f"MASTER_ADDR={addr!r}, MASTER_PORT={port}; need 0 <= node rank < nodes, the address of "
            "node 0 and a port in 1-65535."
        )
    return NodeLayout(nnodes, node_rank, addr, port) if nnodes > 1 else None


def combine_exit_codes(codes: Sequence[int]) -> int:
    """All 0 → 0; all in {0, 75, 76} with a 75 → 75 (stopped), else with a 76 → 76 (paused
    at a rung: every rank reaches the same epoch and pauses there); otherwise the first real
    failure."""
    failures = [c for c in codes if c not in RESUMABLE_EXITS]
    if failures:
        return failures[0] if failures[0] > 0 else 128 - failures[0]  # -9 → 137, like a shell
    if EXIT_PREEMPTED in codes:
        return EXIT_PREEMPTED
    return EXIT_PAUSED if EXIT_PAUSED in codes else 0


def launch(
    cmd: Sequence[str], nproc: int, env: dict[str, str] | None = None, *, ignore_stop_after: bool = False
) -> int:
    """Run cmd in nproc ranks, forward stop signals to them, and combine their exits.

    ignore_stop_after: when the workers are gone, SIGTERM and SIGUSR1 are ignored instead of
    given back their previous handlers. A command line that exits with the combined status
    wants this: the handlers it had are the default action, and a late SIGTERM in the moment
    between restoring it and exiting turned a saved run's 76 into 143 (seen in CI)."""
    base = dict(env if env is not None else os.environ)
    layout = node_layout(base)
    first = 0
    if layout is None:
        base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(nproc))
    else:
        first = layout.node_rank * nproc
        base["WORLD_SIZE"] = str(layout.nnodes * nproc)
    base.setdefault("OMP_NUM_THREADS", str(max((os.cpu_count() or 1) // nproc, 1)))
    procs: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        # Ctrl-C already reached every worker from the terminal (same process group); a
        # forwarded second SIGINT would read as "stop now" and abort them mid-collective.
        # SIGTERM asks for the same clean stop and is idempotent.
        sig = signal.SIGTERM if signum == signal.SIGINT else signum
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        for r in range(nproc):
            rank_env = {**base, "RANK": str(first + r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(nproc)}
            procs.append(subprocess.Popen(list(cmd), env=rank_env))
        failed_at: float | None = None
        while any(p.poll() is None for p in procs):
            codes = [p.returncode for p in procs if p.returncode is not None]
            if failed_at is None and any(c not in RESUMABLE_EXITS for c in codes):
                # A dead rank leaves the others blocked in a collective: stop them.
                failed_at = time.monotonic()
                forward(signal.SIGTERM, None)
            if failed_at is not None and time.monotonic() - failed_at > FAILURE_GRACE_S:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.1)
    finally:
        for p in procs:  # only non-empty if we are leaving on an error (e.g. a rank failed to start)
            if p.poll() is None:
                p.kill()
                p.wait()
        for s, h in previous.items():
            # Straight from the forwarding handler to SIG_IGN: no instant with the default.
            keep_out = ignore_stop_after and s in (signal.SIGTERM, signal.SIGUSR1)
            signal.signal(s, signal.SIG_IGN if keep_out else h)
    return combine_exit_codes([p.returncode for p in procs])
