"""Where each node's part of a Ray attempt runs: the nodes the scheduler placed its GPUs on
(the same count on each), or for a CPU job, Ray's choice on one node or, across nodes, alive
nodes chosen here, most CPUs first (see `ray.py`'s docstring)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from visionloop.core.errors import ExecutorError
from visionloop.sched.executors.base import LaunchRequest
from visionloop.sched.executors.ray_nodes import RayNode
from visionloop.sched.view import Gpu

# Reads the cluster again: its GPUs, and its alive nodes by short id.
Refresh = Callable[[], tuple[list[Gpu], Mapping[str, RayNode]]]


def place(
    request: LaunchRequest, known: Mapping[str, RayNode], refresh: Refresh
) -> list[tuple[RayNode | None, int]]:
    """Where each node's part of the request runs, node rank order, with its GPU count:
    the nodes the scheduler placed the GPUs on (in the order it listed them), or for a CPU
    job, one unpinned entry (Ray's choice) or, across nodes, the nodes picked here. `known`:
    the nodes of the last capacity reading, by short id; `refresh` reads them again."""
    if request.nodes < 1:
        raise ExecutorError(f"job {request.job_id}: nodes is {request.nodes}; it must be at least 1.")
    if not request.gpus:
        if request.nodes == 1:
            return [(None, 0)]
        return [(node, 0) for node in cpu_nodes(request, refresh()[1].values())]
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
    if any(short not in known for short in by_node):
        gpus, known = refresh()
        ids = {g.id for g in gpus}
        missing = [g.id for g in request.gpus if g.id not in ids]
        if missing or any(short not in known for short in by_node):
            raise ExecutorError(
                f"job {request.job_id}: GPUs {missing or [g.id for g in request.gpus]} are not in the "
                f"Ray cluster any more (it has {sorted(ids)}); a node left or restarted. Restart the "
                "control plane so it reads the cluster's GPUs again."
            )
    return [(known[short], n) for short, n in by_node.items()]


def cpu_nodes(request: LaunchRequest, alive: Iterable[RayNode]) -> list[RayNode]:
    """`request.nodes` distinct nodes of `alive` for a CPU job across nodes: the scheduler
    places no CPU job, so the executor does. Nodes with the most CPUs first (then by name:
    the same choice every time); each must have the job's per-node share of CPUs."""
    need = request.cpus / request.nodes
    nodes = sorted(alive, key=lambda n: (-n.cpus, n.name))
    fit = [n for n in nodes if n.cpus >= need]
    if len(fit) < request.nodes:
        has = ", ".join(f"{n.name}: {n.cpus:g}" for n in nodes) or "no alive node"
        raise ExecutorError(
            f"job {request.job_id} needs {request.nodes} Ray nodes with {need:g} CPUs each, and the "
            f"cluster has {len(fit)} ({has}); "
            "add nodes, or lower resources.nodes or resources.cpus."
        )
    return fit[: request.nodes]
