"""The layout of one run across nodes, without a Ray cluster: what `resources.nodes` and
`gpus_per_node` mean and refuse, how GPUs are picked on several nodes, the command and the
rendezvous variables each node gets, which executors can run it, and that the job store
keeps one attempt holding GPUs on two nodes (real SQLite). The runs themselves:
tests/integration/test_ray_multinode.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from visionloop.core.errors import TrainingError
from visionloop.sched.executors.base import multi_node
from visionloop.sched.executors.local import LocalExecutor
from visionloop.sched.executors.ray import RayExecutor
from visionloop.sched.placement import group_by_node, pick
from visionloop.sched.store import Store
from visionloop.sched.view import Gpu
from visionloop.sched.workload import CommandContext, TrainWorkload
from visionloop.specs import JobSpec, ResourcesSpec, TrainSpec
from visionloop.train.launch import NodeLayout, node_layout

TRAIN: dict[str, Any] = {"model": {"arch": "small_cnn"}, "data": {"dataset": "/data/digits"}, "epochs": 1}


# -- resources ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "gpus", "per_node", "procs"),
    [
        ({"nodes": 2, "gpus_per_node": 4}, 8, 4, 4),  # gpus derived from gpus_per_node
        ({"nodes": 2, "gpus": 4}, 4, None, 2),  # gpus alone: split evenly
        ({"nodes": 2, "gpus": 4, "gpus_per_node": 2}, 4, 2, 2),  # both, consistent
        ({"nodes": 3, "gpus": 0}, 0, None, 1),  # a CPU job: one process per node
        ({}, 1, None, 1),  # the single-node default is unchanged
    ],
)
def test_gpus_is_the_total_over_nodes(
    given: dict[str, int], gpus: int, per_node: int | None, procs: int
) -> None:
    r = ResourcesSpec.model_validate(given)
    assert (r.gpus, r.gpus_per_node, r.procs_per_node) == (gpus, per_node, procs)


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ({"nodes": 2, "gpus": 3}, "gpus (3) must divide evenly over nodes (2)"),
        ({"nodes": 2, "gpus": 4, "gpus_per_node": 1}, "gpus (4) must equal nodes (2) x gpus_per_node (1)"),
        ({"gpus": 0, "gpus_per_node": 1}, "gpus (0) must equal nodes (1) x gpus_per_node (1)"),
        ({"nodes": 0}, "greater than or equal to 1"),
    ],
)
def test_a_layout_that_does_not_add_up_is_refused_with_the_fix(given: dict[str, int], words: str) -> None:
    with pytest.raises(ValidationError) as e:
        ResourcesSpec.model_validate(given)
    assert words in str(e.value)


# -- placement ------------------------------------------------------------------------------


def _gpus(**nodes: tuple[int, str, str]) -> list[Gpu]:
    return [Gpu(f"{n}/{i}", n, t, pc) for n, (count, t, pc) in nodes.items() for i in range(count)]  # type: ignore[arg-type]


def test_pick_nodes_takes_the_same_count_on_distinct_nodes_one_type_and_the_tightest() -> None:
    pool = group_by_node(
        _gpus(a=(2, "L4", "owned"), b=(2, "A100", "owned"), c=(1, "A100", "owned"), d=(4, "A100", "owned"))
    )
    got = pick(pool, 4, "allowed", same_node=True, nodes=2)
    # Two A100 on each of two nodes, the tighter b before d; c (1 GPU) cannot hold 2.
    assert [g.id for g in got or []] == ["b/0", "b/1", "d/0", "d/1"]
    assert [g.id for g in pick(pool, 3, "allowed", True, nodes=3) or []] == ["c/0", "b/0", "d/0"]
    assert pick(pool, 6, "allowed", True, nodes=2) is None  # 3 on each: only d has 3
    assert pick(pool, 3, "allowed", True, nodes=2) is None  # does not divide


def test_pick_nodes_keeps_off_spot_for_never_and_uses_it_only_when_owned_is_short() -> None:
    pool = group_by_node(_gpus(a=(2, "A100", "owned"), s=(2, "A100", "spot"), t=(2, "A100", "spot")))
    assert pick(pool, 4, "never", True, nodes=2) is None
    got = pick(pool, 4, "allowed", True, nodes=2) or []
    assert sorted({g.node for g in got}) == ["a", "s"]  # owned first, one spot node to make up


# -- the command and the rendezvous ---------------------------------------------------------


def test_the_command_runs_one_launcher_per_node_with_its_share_of_the_gpus(tmp_path: Path) -> None:
    w = TrainWorkload(train=TrainSpec.model_validate(TRAIN))
    ctx = {"job_dir": tmp_path / "job", "run_dir": tmp_path / "run"}
    two_by_two = w.command(CommandContext(**ctx, gpus=4, nnodes=2))  # type: ignore[arg-type]
    assert two_by_two[-2:] == ["--nproc-per-node", "2"]
    for gpus, nnodes in ((2, 2), (0, 2), (1, 1)):  # one process per node: no launcher
        assert "--nproc-per-node" not in w.command(CommandContext(**ctx, gpus=gpus, nnodes=nnodes))  # type: ignore[arg-type]
    assert w.command(CommandContext(**ctx, gpus=4))[-2:] == ["--nproc-per-node", "4"]  # type: ignore[arg-type]


def test_the_rendezvous_variables_are_read_whole_or_refused() -> None:
    env = {
        "VISIONLOOP_NNODES": "2",
        "VISIONLOOP_NODE_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29501",
    }
    assert node_layout(env) == NodeLayout(2, 1, "10.0.0.1", 29501)
    assert node_layout({}) is None
    assert node_layout({**env, "VISIONLOOP_NNODES": "1", "VISIONLOOP_NODE_RANK": "0"}) is None
    for bad, words in (
        ({"VISIONLOOP_NODE_RANK": "2"}, "need 0 <= node rank < nodes"),
        ({"MASTER_PORT": "x"}, "must be integers too"),
        ({"MASTER_ADDR": ""}, "the address of node 0"),
    ):
        with pytest.raises(TrainingError, match=words):
            node_layout({**env, **bad})


def test_only_the_ray_executor_runs_a_job_across_nodes() -> None:
    assert multi_node(RayExecutor("http://127.0.0.1:9"))
    assert not multi_node(LocalExecutor([]))
    assert not multi_node(object())


# -- the store ------------------------------------------------------------------------------


def test_one_attempt_holds_gpus_on_two_nodes(tmp_path: Path) -> None:
    store = Store.open(f"sqlite:///{tmp_path / 'state.db'}", runs_dir=tmp_path / "runs")
    try:
        store.upsert_team("vision", 4, 0, 1.0, now=1.0)
        gpus = _gpus(a=(2, "A100", "owned"), b=(2, "A100", "owned"))
        store.sync_gpus(gpus, now=1.0)
        doc = {"resources": {"nodes": 2, "gpus_per_node": 1}, "train": TRAIN}
        job = store.submit(
            doc, JobSpec.model_validate(doc), team="vision", priority_rank=50, run_dir=None,
            idempotency_key=None, now=2.0,
        )  # fmt: skip
        assert job.gpus == 2
        placed = pick(group_by_node(gpus), 2, "allowed", True, nodes=2)
        assert placed is not None
        store.start_attempt(job.id, "ray", placed, now=3.0)
        (attempt,) = store.attempts(job.id)
        assert sorted((a.gpu_id, a.node) for a in attempt.allocations) == [("a/0", "a"), ("b/0", "b")]
        assert store.get_job(job.id).state.value == "running"
    finally:
        store.close()
