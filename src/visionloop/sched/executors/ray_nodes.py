"""What the Ray executor reads from a Ray node: its identity, GPU type and price class, from
the labels and resources the node was started with, and so the cluster's capacity: every
ALIVE node's GPUs as the scheduler's Gpu ids (see `ray.py`'s docstring)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from visionloop.core.errors import ExecutorError
from visionloop.sched.view import Gpu, PriceClass

GPU_TYPE_LABEL = "visionloop.io/gpu-type"
PRICE_CLASS_LABEL = "visionloop.io/price-class"
NODE_ID_LABEL = "ray.io/node-id"
_PRICE_CLASSES: tuple[PriceClass, ...] = ("owned", "on_demand", "spot")
_SHORT = 8  # hex digits of a node id in Gpu ids


@dataclass(frozen=True)
class RayNode:
    node_id: str
    ip: str
    name: str  # the Gpu.node name: "{node_name}-{node_id[:8]}"
    cpus: float = 0.0  # the node's CPU resource (total), for placing CPU jobs across nodes


def read_capacity(nodes: Iterable[Any]) -> tuple[list[Gpu], dict[str, RayNode]]:
    """The GPUs of the ALIVE nodes among `nodes` (the state API's NodeState records), as Gpu
    ids `{node_id[:8]}/{i}` on node `{node_name}-{node_id[:8]}` in node then index order, and
    those nodes by their short id."""
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
    return sorted(gpus, key=lambda g: (g.node, int(g.id.rsplit("/", 1)[1]))), known


def node_gpu_type(resources: Mapping[str, float], labels: Mapping[str, str]) -> str:
    """A node's GPU type: our label, then Ray's `gpu_type:`/accelerator resources and labels."""
    if labels.get(GPU_TYPE_LABEL):
        return labels[GPU_TYPE_LABEL]
    for key in resources:
        if key.startswith("gpu_type:"):
            return key.split(":", 1)[1]
    if labels.get("ray.io/accelerator-type"):
        return labels["ray.io/accelerator-type"]
    for key in resources:
        if key.startswith("accelerator_type:"):
            return key.split(":", 1)[1]
    return "unknown"


def node_price_class(resources: Mapping[str, float], labels: Mapping[str, str], node: str) -> PriceClass:
    """A node's price class: our label (a wrong value is refused), a `spot` resource, Ray's
    market-type label, else owned."""
    label = labels.get(PRICE_CLASS_LABEL)
    if label is not None:
        for price in _PRICE_CLASSES:
            if label == price:
                return price
        raise ExecutorError(
            f"Ray node {node} has label {PRICE_CLASS_LABEL}={label!r}; use one of "
            f"{', '.join(_PRICE_CLASSES)} (e.g. `ray start ... --labels {PRICE_CLASS_LABEL}=spot`)."
        )
    if resources.get("spot", 0) > 0:
        return "spot"
    market = labels.get("ray.io/market-type", "").lower().replace("-", "_")
    if market == "spot":
        return "spot"
    if market == "on_demand":
        return "on_demand"
    return "owned"


def ip_of(url: str | None) -> str | None:
    """The host of an http(s) URL with a port (IPv6 brackets removed), or None."""
    m = re.match(r"https?://\[?([^\]/]+?)\]?:\d+", url or "")
    return m.group(1) if m else None
