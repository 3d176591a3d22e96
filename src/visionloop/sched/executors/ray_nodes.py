"""What the Ray executor reads from a Ray node: its identity, GPU type and price class, from
the labels and resources the node was started with (see `ray.py`'s docstring)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from visionloop.core.errors import ExecutorError
from visionloop.sched.view import PriceClass

GPU_TYPE_LABEL = "visionloop.io/gpu-type"
PRICE_CLASS_LABEL = "visionloop.io/price-class"
NODE_ID_LABEL = "ray.io/node-id"
_PRICE_CLASSES: tuple[PriceClass, ...] = ("owned", "on_demand", "spot")


@dataclass(frozen=True)
class RayNode:
    node_id: str
    ip: str
    name: str  # the Gpu.node name: "{node_name}-{node_id[:8]}"
    cpus: float = 0.0  # the node's CPU resource (total), for placing CPU jobs across nodes


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
