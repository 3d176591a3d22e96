"""The rendezvous of a Ray attempt across nodes: where node 0's rank 0 listens
(MASTER_ADDR:MASTER_PORT) and the variables every node's part starts with, from which the
trainer's launcher (visionloop.train.launch) numbers the global ranks (see `ray.py`'s
docstring, One run across nodes)."""

from __future__ import annotations

import zlib

from visionloop.core.errors import ExecutorError
from visionloop.sched.executors.ray_nodes import RayNode
from visionloop.train.launch import NNODES_ENV, NODE_RANK_ENV

# Where node 0's rank 0 listens: torchrun's default port starts the range.
DEFAULT_RENDEZVOUS_PORTS = (29500, 30499)


def check_ports(rendezvous_ports: tuple[int, int]) -> tuple[int, int]:
    """The range (inclusive), if it is one of unprivileged ports; ExecutorError otherwise."""
    low, high = rendezvous_ports
    if not 1024 <= low <= high <= 65535:
        raise ExecutorError(
            f"RayExecutor rendezvous_ports {rendezvous_ports} is not a port range; give (low, high) "
            "with 1024 <= low <= high <= 65535, e.g. (29500, 30499)."
        )
    return (low, high)


def rendezvous_port(sid: str, ports: tuple[int, int]) -> int:
    """MASTER_PORT of a multi-node attempt: drawn from the range by the submission id, so
    a re-launch (adoption) gets the same one and the next attempt most likely another
    (the control plane cannot see which ports are free on a Ray node; a taken one fails
    the attempt, and its retry draws again)."""
    low, high = ports
    return low + zlib.crc32(sid.encode()) % (high - low + 1)


def rendezvous_address(first: RayNode, sid: str, ports: tuple[int, int]) -> str:
    """The attempt's rendezvous, "IP:PORT": node 0's IP as Ray knows it, and its port."""
    return f"{first.ip}:{rendezvous_port(sid, ports)}"


def rendezvous_env(rendezvous: str, n_nodes: int, rank: int) -> dict[str, str]:
    """What node `rank`'s part of the attempt learns the rendezvous from."""
    addr, port = rendezvous.rsplit(":", 1)
    return {
        NNODES_ENV: str(n_nodes),
        NODE_RANK_ENV: str(rank),
        "MASTER_ADDR": addr,
        "MASTER_PORT": port,
    }
