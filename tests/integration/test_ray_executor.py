"""The Ray executor against a real two-node Ray cluster on loopback (tests/_raykit.py, one
per session: tests/_raysession.py): what only Ray does. The executor contract it shares with
the local executor (exit codes read back exactly, terminate → SIGTERM → 75, kill, polling
from a fresh executor and the bare handle, logs from an offset, CPU and 1-GPU jobs) is
tests/integration/test_executor_contract.py.

Here: capacity, types and price classes from the cluster, node pinning and Ray's
CUDA_VISIBLE_DEVICES, adopting a re-submitted attempt, stopping an orphaned earlier attempt,
jobs waiting in Ray's queue, unknown submissions, an unreachable or hung dashboard, and how
Ray's answers are read. Jobs are short `python -c` programs, not the trainer; both nodes are
on this machine, so jobs and tests share files under tmp_path.
"""

from __future__ import annotations

import itertools
import shlex
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from _execkit import WAIT_S, log_text, require_ray, wait_exited, wait_log
from _raykit import RayCluster
from visionloop.core.errors import ExecutorError, ExecutorUnavailableError
from visionloop.sched.executors.base import LaunchRequest
from visionloop.sched.executors.ray import EXIT_KILLED, RayExecutor
from visionloop.sched.view import Gpu

require_ray(allow_module_level=True)

pytest_plugins = ["_raysession"]  # the session's Ray cluster: `ray_cluster`

PY = sys.executable
PREFIX = "vltest"  # Ray submission ids; other modules on the shared cluster use their own
_job_ids = itertools.count(1)


@pytest.fixture
def cluster(ray_cluster: RayCluster) -> RayCluster:
    return ray_cluster


@pytest.fixture
def ex(cluster: RayCluster) -> RayExecutor:
    return RayExecutor(cluster.address, prefix=PREFIX)


# -- helpers --------------------------------------------------------------------------------


def req(tmp: Path, src: str, *, job_id: int | None = None, attempt: int = 1, gpus: Sequence[Gpu] = (),
        cpus: float = 0.05) -> LaunchRequest:  # fmt: skip
    job_id = next(_job_ids) if job_id is None else job_id
    return LaunchRequest(
        job_id=job_id,
        attempt=attempt,
        command=[PY, "-c", src],
        gpus=list(gpus),
        attempt_dir=tmp / f"job-{job_id}" / f"attempt-{attempt}",
        env={"VL_TEST_TMP": str(tmp)},
        cpus=cpus,
        memory_gb=0.0,
    )


def ray_node_id(cluster: RayCluster, gpu: Gpu) -> str:
    """The full Ray node id of the node a Gpu (id "{node_id[:8]}/{i}") is on."""
    from ray.util.state import list_nodes

    short = gpu.id.split("/")[0]
    return next(n.node_id for n in list_nodes(address=cluster.address) if n.node_id.startswith(short))


# -- Ray-specific ---------------------------------------------------------------------------


def test_a_submission_ray_does_not_know_or_a_folder_naming_none_is_lost(
    ex: RayExecutor, tmp_path: Path
) -> None:
    # (The bare handle of an attempt never submitted is the contract's.)
    handle = {"executor": "ray", "submission_id": f"{PREFIX}-job-99999-attempt-1"}
    status = ex.poll(handle)
    assert status.state == "lost" and "Ray has no job" in status.detail, status
    status = ex.poll({"attempt_dir": str(tmp_path / "elsewhere")})
    assert status.state == "lost" and "names no Ray submission" in status.detail, status
    ex.terminate(handle)
    ex.kill(handle)
    assert b"".join(ex.read_log(handle)) == b""


def test_capacity_reads_both_nodes_gpus_types_and_price_classes(ex: RayExecutor) -> None:
    gpus = ex.capacity()
    assert len(gpus) == 4
    assert len({g.id for g in gpus}) == 4
    by_node: dict[str, list[Gpu]] = {}
    for g in gpus:
        by_node.setdefault(g.node, []).append(g)
    assert sorted(len(v) for v in by_node.values()) == [2, 2]
    kinds = sorted({(g.type, g.price_class) for g in gpus})
    # Head: resources {"spot": 1, "gpu_type:L4": 1}; worker: labels gpu-type / price-class.
    assert kinds == [("A100-80GB", "on_demand"), ("L4", "spot")]
    for node, node_gpus in by_node.items():
        short = node_gpus[0].id.split("/")[0]
        assert node.endswith(short)
        assert sorted(g.id for g in node_gpus) == [f"{short}/0", f"{short}/1"]
        assert all(g.up for g in node_gpus)


def test_gpu_jobs_run_on_the_allocated_node_and_see_ray_cuda_visible_devices(
    ex: RayExecutor, cluster: RayCluster, tmp_path: Path
) -> None:
    from ray.job_submission import JobSubmissionClient

    gpus = ex.capacity()
    spot = [g for g in gpus if g.spot]
    on_demand = [g for g in gpus if not g.spot]
    src = "import os; print('CVD=' + os.environ['CUDA_VISIBLE_DEVICES'])"
    handles = [
        (ex.launch(req(tmp_path, src, gpus=spot[:1])), 1),
        (ex.launch(req(tmp_path, src, gpus=on_demand)), 2),
    ]
    client = JobSubmissionClient(cluster.address)
    for (handle, count), allocated in zip(handles, (spot[:1], on_demand), strict=True):
        assert wait_exited(ex, handle).exit_code == 0
        line = next(x for x in log_text(ex, handle).splitlines() if x.startswith("CVD="))
        devices = line.removeprefix("CVD=").split(",")
        assert len(devices) == count and set(devices) <= {"0", "1"}, line
        ran_on = client.get_job_info(handle["submission_id"]).driver_node_id
        assert ran_on == handle["node_id"] == ray_node_id(cluster, allocated[0])


def test_relaunching_an_attempt_adopts_it_instead_of_starting_a_second_copy(
    ex: RayExecutor, cluster: RayCluster, tmp_path: Path
) -> None:
    starts, go = tmp_path / "starts", tmp_path / "go"
    src = f"""
import os, time
open({str(starts)!r}, "a").write("started\\n")
deadline = time.time() + 60
while not os.path.exists({str(go)!r}) and time.time() < deadline:
    time.sleep(0.05)
"""
    request = req(tmp_path, src)
    first = ex.launch(request)
    again = RayExecutor(cluster.address, prefix=PREFIX).launch(request)  # e.g. after a restart
    assert again == first
    go.touch()
    assert wait_exited(ex, first).exit_code == 0
    assert starts.read_text() == "started\n"
    other = req(tmp_path, "print('something else')", job_id=request.job_id)
    with pytest.raises(ExecutorError, match="prefix"):
        ex.launch(other)


def test_launch_stops_an_earlier_attempt_still_running_in_ray(ex: RayExecutor, tmp_path: Path) -> None:
    first = ex.launch(
        req(tmp_path, "import time; print('re' + 'ady', flush=True); time.sleep(600)", job_id=next(_job_ids))
    )
    wait_log(ex, first, "ready")
    job_id = int(first["submission_id"].split("-")[2])
    second = ex.launch(req(tmp_path, "print('attempt 2')", job_id=job_id, attempt=2))
    assert wait_exited(ex, first).exit_code == EXIT_KILLED
    assert wait_exited(ex, second).exit_code == 0


def test_a_job_waiting_in_ray_reads_running_and_terminate_stops_it_when_it_would_start(
    ex: RayExecutor, cluster: RayCluster, tmp_path: Path
) -> None:
    """Someone else's Ray job holds the GPUs the scheduler gave ours: ours waits in Ray's
    queue (reported running, "pending"). A stop cannot reach a job whose supervisor Ray has
    not scheduled yet; it takes effect the moment Ray would start it."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    gpus = [g for g in ex.capacity() if not g.spot]
    go, holding = tmp_path / "go", tmp_path / "holding"
    hold = f"""
import os, time
open({str(holding)!r}, "w").close()
while not os.path.exists({str(go)!r}):
    time.sleep(0.05)
"""
    client = JobSubmissionClient(cluster.address)
    squatter = client.submit_job(
        entrypoint=shlex.join([PY, "-c", hold]),
        entrypoint_num_gpus=2,
        entrypoint_num_cpus=0.01,
        entrypoint_label_selector={"ray.io/node-id": ray_node_id(cluster, gpus[0])},
    )
    # Ours must be launched while the squatter holds the GPUs: on a slow machine a squatter
    # still in Ray's queue would let ours start first (and the test would stop a running job).
    deadline = time.monotonic() + WAIT_S
    while not (holding.exists() and client.get_job_status(squatter) == JobStatus.RUNNING):
        assert time.monotonic() < deadline, f"the squatter never ran: {client.get_job_info(squatter)}"
        time.sleep(0.2)
    handle = ex.launch(req(tmp_path, "import time; time.sleep(600)", gpus=gpus))
    status = ex.poll(handle)
    assert status.state == "running" and "pending" in status.detail, status
    ex.terminate(handle)
    go.touch()  # the GPUs come free
    assert wait_exited(ex, handle).exit_code == EXIT_KILLED
    assert str(client.get_job_status(squatter)) == "SUCCEEDED"


# -- failures that say what to do -----------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_dashboard_says_what_to_do(tmp_path: Path) -> None:
    dead = RayExecutor(f"http://127.0.0.1:{_closed_port()}", request_timeout_s=5)
    with pytest.raises(ExecutorUnavailableError, match="cannot reach the Ray dashboard"):
        dead.launch(req(tmp_path, "print('never runs')"))
    # ExecutorUnavailableError: the control plane holds it against no job (see test_control_plane_ray).
    with pytest.raises(ExecutorUnavailableError, match="ray status"):
        dead.capacity()
    with pytest.raises(ExecutorUnavailableError, match="ray status"):
        dead.poll({"submission_id": "vl-job-1-attempt-1"})


def test_a_hung_dashboard_times_out_instead_of_hanging_the_control_plane() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:  # accept, never answer
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        hung = RayExecutor(f"http://127.0.0.1:{server.getsockname()[1]}", request_timeout_s=1)
        with pytest.raises(ExecutorError, match="cannot reach the Ray dashboard"):
            hung.poll({"submission_id": "vl-job-1-attempt-1"})
    finally:
        stop.set()
        thread.join()
        for s in accepted:
            s.close()
        server.close()


def test_a_bad_prefix_or_a_conflicting_ray_address_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ExecutorError, match="prefix"):
        RayExecutor("http://127.0.0.1:8265", prefix="Bad_Prefix")
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    with pytest.raises(ExecutorError, match="RAY_ADDRESS"):
        RayExecutor("http://127.0.0.1:8265").poll({"submission_id": "vl-job-1-attempt-1"})


# -- how Ray's answers are read (no cluster) --------------------------------------------------


def _details(
    status: str, code: int | None = None, error_type: str | None = None, message: str = ""
) -> object:
    from types import SimpleNamespace

    return SimpleNamespace(status=status, driver_exit_code=code, error_type=error_type, message=message)


@pytest.mark.parametrize(
    ("details", "expected"),
    [
        (_details("PENDING", message="Job has not started yet."), ("running", None)),
        (_details("RUNNING"), ("running", None)),
        (_details("SUCCEEDED", 0), ("exited", 0)),
        (_details("FAILED", 3, "JOB_ENTRYPOINT_COMMAND_ERROR"), ("exited", 3)),
        (_details("FAILED", 75, "JOB_ENTRYPOINT_COMMAND_ERROR"), ("exited", 75)),
        (_details("FAILED", -15, "JOB_ENTRYPOINT_COMMAND_ERROR"), ("exited", 143)),  # killed by SIGTERM
        # Ray versions without driver_exit_code say it in the message.
        (
            _details("FAILED", None, "JOB_ENTRYPOINT_COMMAND_ERROR", "failed with exit code 5, last"),
            ("exited", 5),
        ),
        (_details("STOPPED"), ("exited", EXIT_KILLED)),
        (_details("FAILED", None, "JOB_SUPERVISOR_ACTOR_DIED", "node died"), ("lost", None)),
        (_details("FAILED", None, "RUNTIME_ENV_SETUP_FAILURE", "pip failed"), ("exited", 126)),
    ],
)
def test_ray_job_states_map_to_attempt_states(details: object, expected: tuple[str, int | None]) -> None:
    from visionloop.sched.executors.ray_status import attempt_status

    status = attempt_status(details)
    assert (status.state, status.exit_code) == expected


def test_types_and_price_classes_from_labels_and_resources() -> None:
    from visionloop.sched.executors.ray_nodes import node_gpu_type, node_price_class

    assert node_gpu_type({"GPU": 8, "accelerator_type:H100": 1}, {}) == "H100"  # Ray's own detection
    assert (
        node_gpu_type({"gpu_type:L4": 1, "accelerator_type:L4": 1}, {"visionloop.io/gpu-type": "L4-24GB"})
        == "L4-24GB"
    )
    assert node_gpu_type({"GPU": 2}, {}) == "unknown"
    assert node_price_class({}, {"ray.io/market-type": "spot"}, "n") == "spot"
    assert node_price_class({}, {"ray.io/market-type": "on-demand"}, "n") == "on_demand"
    # the label wins
    assert node_price_class({"spot": 1}, {"visionloop.io/price-class": "owned"}, "n") == "owned"
    assert node_price_class({}, {}, "n") == "owned"
    with pytest.raises(ExecutorError, match="owned, on_demand, spot"):
        node_price_class({}, {"visionloop.io/price-class": "preemptible"}, "n")


def test_older_ray_without_label_selectors_pins_to_the_node_ip() -> None:
    ex = RayExecutor("http://127.0.0.1:8265")
    ex.jobs._client_obj, ex.jobs._label_selectors = object(), False  # as if Ray's SDK lacked the keyword
    assert ex.jobs.pin("f00d", "10.0.0.7") == {"entrypoint_resources": {"node:10.0.0.7": 0.001}}
    ex.jobs._label_selectors = True
    assert ex.jobs.pin("f00d", "10.0.0.7") == {"entrypoint_label_selector": {"ray.io/node-id": "f00d"}}
