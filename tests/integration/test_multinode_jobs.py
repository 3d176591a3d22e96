"""A job across nodes through the control plane: `resources.nodes` is stored with the job,
placed on that many nodes and launched as one process group by the Ray executor (on the
session's two-node Ray cluster on loopback); the local executor, which runs on one machine,
refuses it at submit with what to do instead."""

from __future__ import annotations

import os
from pathlib import Path

from _cpflows import two_node_job
from _cpkit import TEAMS, cluster_config, control_plane
from _cpkit import train_doc as _train
from _dbkit import fresh_database
from _raykit import RayCluster

pytest_plugins = ["_raysession"]  # the session's Ray cluster: `ray_cluster`


def test_the_local_executor_refuses_a_job_across_nodes(tmp_path: Path, digits_dataset: Path) -> None:
    cfg = cluster_config(
        inventory=[{"node": "local", "type": "fake", "count": 2, "price_class": "owned"}], teams=TEAMS
    )
    with fresh_database("sqlite", tmp_path) as url, control_plane(url, cfg, run_scheduler=False) as cp:
        spec = {"train": _train(digits_dataset), "resources": {"gpus": 2, "nodes": 2}}
        with cp.client() as c:
            r = c.post("/v1/jobs", json={"spec": spec, "team": "vision"})
            assert r.status_code == 422, r.text
            detail = r.json()["detail"]
            assert "needs the Ray or Slurm executor" in detail and "use nodes: 1" in detail
            assert c.get("/v1/jobs").json() == []  # nothing stored
            one = c.post("/v1/jobs", json={"spec": {**spec, "resources": {"gpus": 2}}, "team": "vision"})
            assert one.status_code == 201 and one.json()["nodes"] == 1


def test_on_ray_a_job_with_two_nodes_runs_one_process_group_across_both(
    ray_cluster: RayCluster, digits_dataset: Path, tmp_path: Path
) -> None:
    cfg = cluster_config(
        executor={"kind": "ray", "address": ray_cluster.address, "prefix": f"vlmn{os.getpid()}"},
        teams=TEAMS,
        scheduler={"cycle_s": 0.5},
    )
    with fresh_database("sqlite", tmp_path) as db_url, control_plane(db_url, cfg) as cp:
        # One process per node (each test Ray node has 1 CPU: ask for less).
        attempt = two_node_job(cp, digits_dataset, {"gpus": 0, "nodes": 2, "cpus": 0.8, "memory_gb": 1})
        parts = attempt["handle"]["nodes"]
        assert len(parts) == 2 and len({p["node_id"] for p in parts}) == 2  # two machines
