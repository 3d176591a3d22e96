"""The simulated cluster: nodes of GPUs with a price class, spot nodes following a spot trace,
and the teams with their quotas.

The default is a plausible mid-size CV team's fleet, 64 A100-80GB GPUs in 8 nodes of 8:
  - 4 owned nodes (32 GPUs), bought and amortised;
  - 2 on-demand cloud nodes (16 GPUs), always available, the most expensive hours;
  - 2 spot nodes (16 GPUs), cheap but interrupted, each following one real spot trace.
Teams get entitlements of 50/30/20% (the traces' team mix): detection 32, segmentation 19,
research 13 GPUs, weights 0.5/0.3/0.2, and each may borrow up to the whole cluster while it
is idle (so no job in the traces is impossible by quota alone; borrowed GPUs are reclaimed
when their owner needs them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from visionloop.sched.sim.trace import SpotTrace, load_spot_trace
from visionloop.sched.view import Gpu, PriceClass, Team


@dataclass(frozen=True)
class NodeSpec:
    name: str
    gpus: int
    gpu_type: str = "A100-80GB"
    price_class: PriceClass = "owned"
    spot_trace: SpotTrace | None = None  # only for spot nodes; None: always up

    def gpu_list(self, up: bool = True) -> list[Gpu]:
        return [
            Gpu(f"{self.name}/{i}", self.name, self.gpu_type, self.price_class, up) for i in range(self.gpus)
        ]


@dataclass(frozen=True)
class ClusterSpec:
    nodes: tuple[NodeSpec, ...]
    teams: tuple[Team, ...] = field(default_factory=tuple)

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def nominal_gpus(self, team: str) -> int:
        """The team's nominal quota (0 for a team the cluster does not know)."""
        return next((t.nominal_gpus for t in self.teams if t.name == team), 0)


# Which stretch of which spot trace each spot node follows (files under DATA/spot/). Both
# traces start up and stay mostly up over the two days a simulation lasts, with real
# interruptions: preemption/us-west-2b from 3,584 s in is 93% up with 10 interruptions in
# its first 48 h (longest 1.2 h); availability/us-west-2c from its start is 96% up with 5
# interruptions (longest 0.7 h). Offsets chosen so that each window starts up.
DEFAULT_SPOT_TRACES: tuple[tuple[str, float], ...] = (
    ("preemption/us-west-2b_v100_1.json", 3584.0),
    ("availability/us-west-2c_v100_1.json", 0.0),
)

DEFAULT_ENTITLEMENT: tuple[tuple[str, float], ...] = (
    ("detection", 0.5),
    ("segmentation", 0.3),
    ("research", 0.2),
)


def default_spot_traces(data: Path) -> list[SpotTrace]:
    """The default spot traces, read from `data` (the shared data folder with `spot/`)."""
    return [load_spot_trace(data / "spot" / rel, offset) for rel, offset in DEFAULT_SPOT_TRACES]


def default_cluster(
    spot_traces: Sequence[SpotTrace | None] = (None, None),
    *,
    owned_nodes: int = 4,
    on_demand_nodes: int = 2,
    gpus_per_node: int = 8,
    gpu_type: str = "A100-80GB",
) -> ClusterSpec:
    """The default fleet; one spot node per entry of `spot_traces` (None: never interrupted)."""
    nodes: list[NodeSpec] = []
    for _ in range(owned_nodes):
        nodes.append(NodeSpec(f"node{len(nodes)}", gpus_per_node, gpu_type, "owned"))
    for _ in range(on_demand_nodes):
        nodes.append(NodeSpec(f"node{len(nodes)}", gpus_per_node, gpu_type, "on_demand"))
    for trace in spot_traces:
        nodes.append(NodeSpec(f"node{len(nodes)}", gpus_per_node, gpu_type, "spot", trace))
    total = gpus_per_node * len(nodes)
    return ClusterSpec(tuple(nodes), entitlement_teams(total))


def entitlement_teams(
    total_gpus: int, shares: Sequence[tuple[str, float]] = DEFAULT_ENTITLEMENT
) -> tuple[Team, ...]:
    """Teams whose nominal quotas split `total_gpus` by `shares` (largest remainder, so they
    add up exactly), each allowed to borrow the rest of the cluster."""
    exact = [(name, share * total_gpus) for name, share in shares]
    nominal = {name: int(x) for name, x in exact}
    left = total_gpus - sum(nominal.values())
    for name, _ in sorted(exact, key=lambda e: e[1] - int(e[1]), reverse=True)[:left]:
        nominal[name] += 1
    return tuple(
        Team(name, nominal[name], total_gpus - nominal[name], weight=share) for name, share in shares
    )
