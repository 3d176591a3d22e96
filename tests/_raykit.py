"""A real two-node Ray cluster on loopback, for the Ray executor's tests.

Both nodes run on this machine, from this interpreter's Ray, each as a `ray start --block`
in its own session, sharing one short temp dir (Ray names the second node's sockets
`raylet.1`, ...; separate temp dirs confuse Ray 2.60's log lookup, which then reads another
node's job log). Every port is chosen free up front, so the cluster never collides with
another Ray on the machine, and teardown kills only this cluster's processes (by session
id) — never `ray stop`, which stops every Ray on the machine.

Fake GPUs: `--num-gpus 2` on a machine without GPUs gives Ray two GPU resources per node and
`CUDA_VISIBLE_DEVICES` for jobs that ask for them, which is all the executor needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

START_TIMEOUT_S = 120.0
# Node labels and resources the executor reads types and price classes from.
HEAD_RESOURCES = {"spot": 1, "gpu_type:L4": 1}
WORKER_LABELS = "visionloop.io/gpu-type=A100-80GB,visionloop.io/price-class=on_demand"


# Every port handed to a Ray process by this module: two picks never collide.
_HANDED: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for port 0 binds (where `_free_port` picks)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED:
            _HANDED.add(port)
            return port


def _free_range(size: int) -> int:
    """The first port of `size` consecutive free ports (Ray's worker ports per node), below
    the kernel's ephemeral range: a port `_free_port` picks later (it binds port 0) could
    otherwise land inside it, and Ray refuses to start on the overlap."""
    low, _ = _ephemeral_range()
    for _ in range(200):
        base = random.randrange(20000, max(20001, low - size))
        if any(p in _HANDED for p in range(base, base + size)):
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + size):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            _HANDED.update(range(base, base + size))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {size} consecutive free ports found for Ray's workers")


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no output)"


@dataclass
class RayCluster:
    address: str  # the dashboard URL: what RayExecutor takes
    gcs_address: str
    temp_dir: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    retired: set[int] = field(default_factory=set)  # pids of nodes a test stopped on purpose

    def node_count(self) -> int:
        from ray.util.state import list_nodes

        nodes = list_nodes(address=self.address, timeout=10, raise_on_missing_output=False)
        return sum(1 for n in nodes if str(n.state) == "ALIVE" and n.resources_total.get("GPU"))

    def add_worker(self, labels: str, num_gpus: int = 2) -> subprocess.Popen[bytes]:
        """Start one more worker node (fake GPUs, `labels` as in WORKER_LABELS) and wait until
        Ray lists it: a node joining the cluster while the control plane runs."""
        before = self.node_count()
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        args = [
            f"--address={self.gcs_address}",
            f"--labels={labels}",
            "--include-log-monitor=False",
            "--node-ip-address=127.0.0.1",
            "--num-cpus=1",
            f"--num-gpus={num_gpus}",
            f"--object-store-memory={100 * 1024 * 1024}",
            f"--temp-dir={self.temp_dir}",
            "--disable-usage-stats",
            *_node_ports(_free_range(40)),
        ]
        self.logs.append(self.temp_dir / f"worker-{len(self.procs)}.out")
        proc = _ray_start(args, self.logs[-1], env)
        self.procs.append(proc)
        _wait(f"waiting for node {len(self.procs)} to join", lambda: self.node_count() == before + 1, self)
        return proc

    def remove_worker(self, proc: subprocess.Popen[bytes]) -> None:
        """Stop a node added by add_worker, as a machine leaving would: `ray start --block`
        takes SIGTERM as its cue to stop the node's processes."""
        self.retired.add(proc.pid)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            for pid in psutil.pids():
                with contextlib.suppress(OSError):
                    if os.getsid(pid) == proc.pid:
                        os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        """Kill this cluster's processes only: everything in the sessions its `ray start`s
        lead (daemons, workers, supervisors), then any job process left behind (jobs run in
        sessions of their own; Ray's watchdog kills them when their supervisor dies)."""
        sessions = {p.pid for p in self.procs}
        for pid in psutil.pids():
            try:
                if os.getsid(pid) in sessions:
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        # Job processes: their RAY_ADDRESS is this cluster's GCS (the port is unique to it).
        gcs_port = ":" + self.gcs_address.rsplit(":", 1)[1]
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            left = []
            for proc in psutil.process_iter(["environ"]):
                with contextlib.suppress(psutil.Error):
                    if (proc.info["environ"] or {}).get("RAY_ADDRESS", "").endswith(gcs_port):
                        left.append(proc)
            if not left:
                break
            for proc in left:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _ray_start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", *args],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its session id marks every process of this node
        )


def _node_ports(worker_range: int) -> list[str]:
    return [
        f"--dashboard-agent-listen-port={_free_port()}",
        f"--dashboard-agent-grpc-port={_free_port()}",
        f"--metrics-export-port={_free_port()}",
        f"--runtime-env-agent-port={_free_port()}",
        f"--node-manager-port={_free_port()}",
        f"--object-manager-port={_free_port()}",
        f"--min-worker-port={worker_range}",
        f"--max-worker-port={worker_range + 39}",
    ]


class ClusterError(RuntimeError):
    """The test cluster cannot start; waiting longer will not help."""


def _wait(what: str, ok: Callable[[], bool], cluster: RayCluster, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        for p, log in zip(cluster.procs, cluster.logs, strict=True):
            if p.poll() is not None and p.pid not in cluster.retired:
                raise ClusterError(f"`ray start` exited with {p.returncode} while {what}:\n{_tail(log)}")
        try:
            if ok():
                return
        except ClusterError:
            raise
        except Exception as e:  # not up yet: keep the last reason for the failure message
            last = e
        time.sleep(0.5)
    logs = "\n".join(f"--- {log}\n{_tail(log)}" for log in cluster.logs)
    raise ClusterError(f"the test Ray cluster timed out {what} after {timeout:.0f} s ({last!r}):\n{logs}")


def start_cluster() -> RayCluster:
    """Start the head (2 fake GPUs, spot, type from a `gpu_type:L4` resource) and one worker
    (2 fake GPUs, type and price class from node labels), and wait until both run jobs."""
    temp_dir = Path(tempfile.mkdtemp(prefix="vlray-", dir="/tmp"))  # short: Ray's socket paths
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    gcs_port, dash_port = _free_port(), _free_port()
    cluster = RayCluster(
        address=f"http://127.0.0.1:{dash_port}",
        gcs_address=f"127.0.0.1:{gcs_port}",
        temp_dir=temp_dir,
    )
    common = [
        "--node-ip-address=127.0.0.1",
        "--num-cpus=1",
        "--num-gpus=2",
        f"--object-store-memory={100 * 1024 * 1024}",
        f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]
    try:
        head_args = [
            "--head",
            f"--port={gcs_port}",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dash_port}",
            f"--ray-client-server-port={_free_port()}",
            f"--resources={json.dumps(HEAD_RESOURCES)}",
            *common,
            *_node_ports(_free_range(40)),
        ]
        cluster.logs.append(temp_dir / "head.out")
        cluster.procs.append(_ray_start(head_args, cluster.logs[-1], env))

        def dashboard_up() -> bool:
            with urllib.request.urlopen(f"{cluster.address}/api/version", timeout=5) as r:
                return bool(r.status == 200)

        _wait("starting the head's dashboard", dashboard_up, cluster)
        worker_args = [
            f"--address={cluster.gcs_address}",
            f"--labels={WORKER_LABELS}",
            "--include-log-monitor=False",  # one log monitor per host
            *common,
            *_node_ports(_free_range(40)),
        ]
        cluster.logs.append(temp_dir / "worker.out")
        cluster.procs.append(_ray_start(worker_args, cluster.logs[-1], env))
        _wait("waiting for 2 nodes with GPUs", lambda: cluster.node_count() == 2, cluster)
        _warm_up(cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _warm_up(cluster: RayCluster) -> None:
    """One trivial job per node, so the job agents are ready and the first test's job does
    not pay for starting Ray's worker pools."""
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import list_nodes

    client = JobSubmissionClient(cluster.address)
    ids = []
    for i, node in enumerate(list_nodes(address=cluster.address, timeout=10)):
        ids.append(
            client.submit_job(
                entrypoint="true",
                submission_id=f"warm-up-{i}",
                entrypoint_num_cpus=0.01,
                entrypoint_label_selector={"ray.io/node-id": node.node_id},
            )
        )

    def done() -> bool:
        states = [client.get_job_status(i) for i in ids]
        failed = [str(s) for s in states if str(s) in ("FAILED", "STOPPED")]
        if failed:
            raise ClusterError(f"a warm-up job failed: {[client.get_job_logs(i) for i in ids]}")
        return all(str(s) == "SUCCEEDED" for s in states)

    _wait("running a warm-up job on each node", done, cluster)
