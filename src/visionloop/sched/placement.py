"""Choosing GPUs for one job: which price classes its spot policy allows (and in which order
of preference), one GPU type when possible, and the fewest nodes.

Pure functions over a pool of candidate GPUs grouped by node; the policy calls `pick` on its
free pool, on free + releasing GPUs, and on free + releasing + would-be victims' GPUs, so that
"does it fit?" means the same thing in all three questions.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from visionloop.sched.view import ActiveJob, ClusterView, Gpu, PriceClass, SpotPolicy

# Price classes a spot policy may use, most preferred first. `allowed` takes the cheapest
# first (owned GPUs are already paid for, spot is cheaper than on-demand); `preferred` takes
# spot first and falls back when spot is gone; `never` keeps off spot GPUs entirely.
CLASS_ORDER: Mapping[SpotPolicy, tuple[PriceClass, ...]] = {
    "never": ("owned", "on_demand"),
    "allowed": ("owned", "spot", "on_demand"),
    "preferred": ("spot", "owned", "on_demand"),
}


def usable(gpu: Gpu, spot: SpotPolicy) -> bool:
    return gpu.up and (spot != "never" or gpu.price_class != "spot")


def group_by_node(gpus: Iterable[Gpu]) -> dict[str, list[Gpu]]:
    out: dict[str, list[Gpu]] = {}
    for g in gpus:
        out.setdefault(g.node, []).append(g)
    return out


def pick(
    pool: Mapping[str, Sequence[Gpu]],
    n: int,
    spot: SpotPolicy,
    same_node: bool,
    node_cap: Mapping[str, int] | None = None,
    nodes: int = 1,
) -> list[Gpu] | None:
    """`n` GPUs from `pool` for a job with spot policy `spot`, or None if they do not fit.
    A job spanning `nodes` > 1 nodes gets `n / nodes` GPUs on each of that many nodes
    (`pick_nodes`), whatever `same_node` says.

    Preference, in order: the most preferred price classes alone, widening one class at a
    time (so an `allowed` job uses spot only when owned GPUs do not suffice); then a single
    GPU type (the smallest type-pool that fits, keeping big pools for big jobs); then the
    fewest nodes, best fit. `node_cap` caps how many GPUs the job may take per node (its
    CPU and memory needs against what the node has left).
    """
    if n <= 0:
        return []
    if nodes > 1:
        return pick_nodes(pool, nodes, n // nodes, spot, node_cap) if n % nodes == 0 else None
    order = CLASS_ORDER[spot]
    rank = {c: i for i, c in enumerate(order)}
    for k in range(1, len(order) + 1):
        classes = order[:k]
        per_node: dict[str, list[Gpu]] = {}
        total = 0
        for node, gs in pool.items():
            sel = [g for g in gs if g.up and g.price_class in classes]
            if not sel:
                continue
            cap = len(sel) if node_cap is None else min(len(sel), node_cap.get(node, len(sel)))
            if cap <= 0:
                continue
            sel.sort(key=lambda g: (rank[g.price_class], g.id))
            per_node[node] = sel[:cap] if cap < len(sel) else sel
            total += len(per_node[node])
        if total < n:
            continue
        by_type: dict[str, int] = {}
        for gs in per_node.values():
            for g in gs:
                by_type[g.type] = by_type.get(g.type, 0) + 1
        if len(by_type) > 1:
            for t in sorted((t for t, c in by_type.items() if c >= n), key=lambda t: (by_type[t], t)):
                one_type = {nd: [g for g in gs if g.type == t] for nd, gs in per_node.items()}
                got = _pack({nd: gs for nd, gs in one_type.items() if gs}, n, same_node, rank)
                if got is not None:
                    return got
        got = _pack(per_node, n, same_node, rank)
        if got is not None:
            return got
    return None


def pick_nodes(
    pool: Mapping[str, Sequence[Gpu]],
    nodes: int,
    per_node: int,
    spot: SpotPolicy,
    node_cap: Mapping[str, int] | None = None,
) -> list[Gpu] | None:
    """`per_node` GPUs on each of `nodes` distinct nodes (one run across nodes: every node
    runs the same number of ranks), or None. Same preferences as `pick`: the most preferred
    price classes first, widening one at a time; then one GPU type for every node (DDP runs
    at the pace of its slowest rank); then the tightest nodes, so whole nodes stay free.
    The GPUs come grouped by node, nodes in the order chosen."""
    if nodes <= 0 or per_node <= 0:
        return []
    order = CLASS_ORDER[spot]
    rank = {c: i for i, c in enumerate(order)}
    for k in range(1, len(order) + 1):
        classes = order[:k]
        per: dict[str, list[Gpu]] = {}
        for node, gs in pool.items():
            cap = per_node if node_cap is None else node_cap.get(node, per_node)
            sel = sorted(
                (g for g in gs if g.up and g.price_class in classes),
                key=lambda g: (rank[g.price_class], g.id),
            )
            if cap >= per_node and len(sel) >= per_node:
                per[node] = sel
        if len(per) < nodes:
            continue
        # One type on every node if possible, the type with the fewest fitting nodes first
        # (big pools stay for big jobs); else mixed types.
        by_type = [{nd: [g for g in gs if g.type == t] for nd, gs in per.items()} for t in _types(per)]
        fits = [(_fitting(c, per_node), c) for c in by_type]
        fits = sorted((f for f in fits if len(f[0]) >= nodes), key=lambda f: len(f[0]))
        fits.append((_fitting(per, per_node), per))
        for fit, cand in fits:
            if len(fit) >= nodes:
                fit.sort(key=lambda nd: (len(cand[nd]), rank[cand[nd][0].price_class], nd))
                return [g for nd in fit[:nodes] for g in cand[nd][:per_node]]
    return None


def _types(per: Mapping[str, Sequence[Gpu]]) -> list[str]:
    return sorted({g.type for gs in per.values() for g in gs})


def _fitting(per: Mapping[str, Sequence[Gpu]], need: int) -> list[str]:
    return [nd for nd, gs in per.items() if len(gs) >= need]


def _pack(
    per_node: Mapping[str, list[Gpu]], n: int, same_node: bool, rank: Mapping[PriceClass, int]
) -> list[Gpu] | None:
    """The fewest nodes: one node if any holds `n` (the tightest such node, so that whole
    nodes stay free for big jobs), else the largest nodes first and the tightest for the
    remainder. GPUs inside a node come in preference order (lists arrive sorted)."""

    def best_fit(nodes: Iterable[str], need: int) -> str | None:
        fits = [nd for nd in nodes if len(per_node[nd]) >= need]
        if not fits:
            return None
        return min(fits, key=lambda nd: (len(per_node[nd]), rank[per_node[nd][0].price_class], nd))

    single = best_fit(per_node, n)
    if single is not None:
        return per_node[single][:n]
    if same_node:
        return None
    chosen: list[Gpu] = []
    remaining = dict(per_node)
    need = n
    while need > 0 and remaining:
        last = best_fit(remaining, need)
        if last is not None:
            chosen.extend(remaining[last][:need])
            return chosen
        big = max(remaining, key=lambda nd: (len(remaining[nd]), -rank[remaining[nd][0].price_class], nd))
        chosen.extend(remaining.pop(big))
        need = n - len(chosen)
    return None


def free_pool(view: ClusterView) -> dict[str, list[Gpu]]:
    """Up GPUs that no running job holds, by node."""
    held = {gid for j in view.running for gid in j.gpu_ids}
    return group_by_node(g for g in view.gpus if g.up and g.id not in held)


def held_by(jobs: Iterable[ActiveJob], gpu_by_id: Mapping[str, Gpu]) -> dict[str, list[Gpu]]:
    """The up GPUs these running jobs hold, by node: the pool of GPUs being released, or of
    would-be victims (for "would it fit if they left?")."""
    return group_by_node(
        gpu_by_id[gid] for j in jobs for gid in j.gpu_ids if gid in gpu_by_id and gpu_by_id[gid].up
    )


def capacities(gpus: Sequence[Gpu]) -> dict[SpotPolicy, tuple[int, int]]:
    """Per spot policy: GPUs it may ever use in the whole cluster, and on the largest node
    (up or down: a spot interruption is temporary)."""
    out: dict[SpotPolicy, tuple[int, int]] = {}
    for spot, classes in CLASS_ORDER.items():
        per_node: dict[str, int] = {}
        for g in gpus:
            if g.price_class in classes:
                per_node[g.node] = per_node.get(g.node, 0) + 1
        out[spot] = (sum(per_node.values()), max(per_node.values(), default=0))
    return out


def merge(*pools: Mapping[str, Sequence[Gpu]]) -> dict[str, list[Gpu]]:
    """One pool of several, by node (for "would it fit on free + releasing + victims?")."""
    out: dict[str, list[Gpu]] = {}
    for pool in pools:
        for node, gs in pool.items():
            out.setdefault(node, []).extend(gs)
    return out


def take(pool: dict[str, list[Gpu]], gpus: Iterable[Gpu]) -> None:
    """Remove GPUs from a pool (placed, claimed or held this cycle)."""
    for g in gpus:
        gs = pool.get(g.node)
        if gs is not None and g in gs:
            gs.remove(g)
            if not gs:
                del pool[g.node]
