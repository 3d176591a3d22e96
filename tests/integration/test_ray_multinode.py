"""One training run across two Ray nodes (one DDP process group, gloo on CPU) through the Ray
executor, on the session's real two-node Ray cluster on loopback (tests/_raysession.py):

- a CPU job with `nodes: 2` (one process per node, on nodes the executor picks) ends with
  weights bitwise identical to the same world size on one node (`--nproc-per-node 2`);
- a job on a GPU of the head and one of a node that joins for the test loses that node
  mid-run (its Ray processes and its rank SIGKILLed, as when a machine dies): the attempt
  reads as lost (the control plane requeues it), and the next attempt, placed on the head
  and the other worker, resumes from the checkpoint and ends bitwise identical too.

The GPUs are Ray's fake ones (`--num-gpus`): the spec says `device: cpu`, so every rank
trains on the CPU with gloo whatever Ray puts in CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from safetensors.torch import load_file

from _execkit import log_text, require_ray, wait_exited
from _raykit import RayCluster
from _trainkit import spec_doc, write_spec
from visionloop.sched.executors.base import Handle, LaunchRequest
from visionloop.sched.executors.ray import SUBMISSION_ENV, RayExecutor
from visionloop.sched.view import Gpu

require_ray(allow_module_level=True)

pytest_plugins = ["_raysession"]  # the session's Ray cluster: `ray_cluster`

PREFIX = "vlmn"  # Ray submission ids; other modules on the shared cluster use their own
STEPS = 60  # ~3 s of training here: room to lose a node after the first checkpoint (step 4)
RUN_S = 300.0  # a bound for one run on a loaded 2-core machine; a hang fails with the log


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory, digits_dataset: Path) -> tuple[Path, Path]:
    """The spec, and the weights of the same world size on one node (`--nproc-per-node 2`)."""
    root = tmp_path_factory.mktemp("multinode")
    doc = spec_doc(
        digits_dataset, epochs=None, steps=STEPS, data__workers=0, device="cpu", tracking__enabled=False
    )
    spec = write_spec(root / "spec.yaml", doc)
    run_dir = root / "one-node"
    cmd = [sys.executable, "-m", "visionloop", "train", str(spec), "--run-dir", str(run_dir)]
    done = subprocess.run([*cmd, "--nproc-per-node", "2", "--no-track"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return spec, run_dir / "final.safetensors"


@pytest.fixture
def ex(ray_cluster: RayCluster) -> Iterator[RayExecutor]:
    yield RayExecutor(ray_cluster.address, prefix=PREFIX)


def _request(spec: Path, run_dir: Path, job_id: int, attempt: int, gpus: list[Gpu]) -> LaunchRequest:
    return LaunchRequest(
        job_id=job_id,
        attempt=attempt,
        command=[
            sys.executable,
            "-m",
            "visionloop",
            "train",
            str(spec),
            "--run-dir",
            str(run_dir),
            "--no-track",
        ],
        gpus=gpus,
        attempt_dir=run_dir.parent / f"job-{job_id}" / f"attempt-{attempt}",
        env={"VISIONLOOP_HOME": os.environ["VISIONLOOP_HOME"]},
        cpus=0.4,  # 0.2 on each node: the test nodes have 1 CPU each
        memory_gb=0.0,
        nodes=2,
    )


def _same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(str(a)), load_file(str(b))
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _driver_nodes(cluster: RayCluster, handle: Handle) -> list[str]:
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(cluster.address)
    return [str(client.get_job_info(n["submission_id"]).driver_node_id) for n in handle["nodes"]]


def _marked(sid: str) -> list[psutil.Process]:
    """The processes of one node's part of an attempt (the entrypoint and its children)."""
    found = []
    for proc in psutil.process_iter(["environ"]):
        with contextlib.suppress(psutil.Error):
            if (proc.info["environ"] or {}).get(SUBMISSION_ENV) == sid:
                found.append(proc)
    return found


def test_a_cpu_job_on_two_nodes_ends_bitwise_identical_to_two_processes_on_one(
    ex: RayExecutor, ray_cluster: RayCluster, reference: tuple[Path, Path], tmp_path: Path
) -> None:
    spec, expected = reference
    run_dir = tmp_path / "run"
    handle = ex.launch(_request(spec, run_dir, job_id=1, attempt=1, gpus=[]))
    assert [n["submission_id"] for n in handle["nodes"]] == [
        f"{PREFIX}-job-1-attempt-1",
        f"{PREFIX}-job-1-attempt-1-node-1",
    ]
    status = wait_exited(ex, handle, timeout=RUN_S)
    log = log_text(ex, handle)
    assert (status.state, status.exit_code) == ("exited", 0), f"{status}\n{log}"
    assert "2 processes" in log, log  # rank 0 trains in a process group of 2
    ran_on = _driver_nodes(ray_cluster, handle)
    assert len(set(ran_on)) == 2 and ran_on == [n["node_id"] for n in handle["nodes"]]
    assert _same_weights(expected, run_dir / "final.safetensors")

    # A control plane that died between launch and storing the handle has only the attempt
    # folder: adopt and poll find both nodes from it, asking Ray once about each submission
    # (node 0, node 1, and the node 2 that is not there); before, node 1 was asked twice.
    asked: list[str] = []
    info = ex.jobs.info

    def counted(sid: str) -> Any:
        asked.append(sid)
        return info(sid)

    ex.jobs.info = counted  # type: ignore[method-assign]
    bare = {"attempt_dir": str(_request(spec, run_dir, 1, 1, []).attempt_dir)}
    adopted = ex.adopt(Path(bare["attempt_dir"]))
    assert adopted is not None and adopted["nodes"] == [
        {"submission_id": n["submission_id"], "node_id": n["node_id"]} for n in handle["nodes"]
    ]
    expected_asks = [*(n["submission_id"] for n in handle["nodes"]), f"{PREFIX}-job-1-attempt-1-node-2"]
    assert sorted(asked) == sorted(expected_asks), asked
    asked.clear()
    polled = ex.poll(bare)
    assert (polled.state, polled.exit_code) == ("exited", 0)
    assert sorted(asked) == sorted(expected_asks), asked


def test_a_node_lost_mid_run_reads_lost_and_the_next_attempt_resumes_to_the_same_weights(
    ex: RayExecutor, ray_cluster: RayCluster, reference: tuple[Path, Path], tmp_path: Path
) -> None:
    spec, expected = reference
    run_dir = tmp_path / "run"
    joining = ray_cluster.add_worker("visionloop.io/gpu-type=T4", num_gpus=1)
    gpus = ex.capacity()
    head = next(g for g in gpus if g.type == "L4")
    lost_gpu = next(g for g in gpus if g.type == "T4")
    handle = ex.launch(_request(spec, run_dir, job_id=2, attempt=1, gpus=[head, lost_gpu]))
    assert [n["node_id"][:8] for n in handle["nodes"]] == [head.id[:8], lost_gpu.id[:8]]

    # Freeze the joining node's rank right after the first checkpoint (its peer then waits in
    # the next collective), then kill that node outright: its Ray daemons and its rank.
    node_sid = handle["nodes"][1]["submission_id"]
    deadline = time.monotonic() + RUN_S
    ranks: list[psutil.Process] = []
    while not list((run_dir / "checkpoints").glob("step-*")):
        assert time.monotonic() < deadline and ex.poll(handle).state == "running", log_text(ex, handle)
        ranks = ranks or _marked(node_sid)
        time.sleep(0.02)
    for proc in ranks or _marked(node_sid):
        proc.send_signal(signal.SIGSTOP)
    ray_cluster.retired.add(joining.pid)
    for pid in psutil.pids():
        with contextlib.suppress(OSError):
            if os.getsid(pid) == joining.pid:
                os.kill(pid, signal.SIGKILL)
    for proc in _marked(node_sid):
        proc.kill()
    joining.wait(timeout=30)

    status = wait_exited(ex, handle, timeout=RUN_S)
    assert status.state == "lost", status
    assert f"node 1 of 2 ({node_sid})" in status.detail, status
    assert not (run_dir / "final.safetensors").exists()
    # Node 0 was stopped, not left running alone.
    assert ex.poll(handle).state == "lost"

    # Requeued: the next attempt goes to the head and the other worker, and resumes.
    other = next(g for g in ex.capacity() if g.type == "A100-80GB")
    retry = ex.launch(_request(spec, run_dir, job_id=2, attempt=2, gpus=[head, other]))
    status = wait_exited(ex, retry, timeout=RUN_S)
    log = log_text(ex, retry)
    assert (status.state, status.exit_code) == ("exited", 0), f"{status}\n{log}"
    assert "resuming from step-" in log, log
    assert _same_weights(expected, run_dir / "final.safetensors")
