"""What only the Slurm executor does, against a real Slurm cluster (tests/_slurmkit.py: a
slurmd for each of the nodes vl0 and vl1 on this machine, two fake a100 GPUs each, typed
gpu_type:A100-80GB, vl1 spot). What every executor does is in test_executor_contract.py.

- capacity is the partition's gpu gres, typed and priced by node features;
- a job Slurm has not started yet reads running ("pending in Slurm"), and a terminate cancels it;
- a second launch of an attempt adopts the job Slurm already has; a new attempt of the same job
  stops the old one; a job with no GPU sees none, and none of the control plane's secrets; a
  job that points its slurm.json at another job stops nothing;
- what Slurm says of a job that ended without the shim's exit status (a node that could not run
  it, a failed node, a forgotten job) becomes an exit code or "lost";
- one run across both nodes: one rendezvous, the stop file reaching every node's main process
  (and not its children), a failed node stopping the others after the peer grace;
- the `[executor]` section for Slurm, and the control plane end to end: a higher-priority job
  preempts a running one through its checkpoint and the victim resumes; a DDP job across both
  nodes.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _cpflows import preempt_and_resume, two_node_job
from _cpkit import TEAMS, cluster_config, control_plane
from _dbkit import fresh_database
from _execkit import log_text, wait_exited, wait_log
from _slurmkit import PARTITION, slurm_conf
from visionloop.api.server import build_executor
from visionloop.core.errors import ConfigError, ExecutorError, ExecutorUnavailableError
from visionloop.sched.config import parse_cluster_config
from visionloop.sched.executors.base import Handle, LaunchRequest
from visionloop.sched.executors.slurm import SLURM_JSON, SlurmExecutor
from visionloop.sched.executors.slurm_cli import JobRecord, parse_job_record, parse_sinfo
from visionloop.sched.executors.slurm_status import from_record
from visionloop.sched.service import Principal
from visionloop.sched.view import Gpu

PY = sys.executable
ADMIN = Principal(team=None, admin=True)
_job_ids = itertools.count(1)
SLEEP = "import time; print('sle' + 'eping', flush=True); time.sleep(600)"


@pytest.fixture
def ex() -> Iterator[SlurmExecutor]:
    executor = SlurmExecutor(
        PARTITION, prefix=f"vlslurm-{os.getpid()}", slurm_conf=slurm_conf(), heartbeat_s=0.5
    )
    executor.launched = []  # type: ignore[attr-defined]
    yield executor
    for handle in executor.launched:  # type: ignore[attr-defined]
        executor.kill(handle)


def _request(
    tmp: Path,
    src: str,
    *,
    gpus: list[Gpu] | None = None,
    job_id: int | None = None,
    attempt: int = 1,
    env: dict[str, str] | None = None,
) -> LaunchRequest:
    job = job_id if job_id is not None else next(_job_ids)
    return LaunchRequest(
        job_id=job,
        attempt=attempt,
        command=[PY, "-c", src],
        gpus=gpus or [],
        attempt_dir=tmp / f"job-{job}" / f"attempt-{attempt}",
        env=env or {},
        cpus=1,
        memory_gb=0.0,
    )


def _launch(ex: SlurmExecutor, request: LaunchRequest) -> Handle:
    handle = ex.launch(request)
    ex.launched.append(handle)  # type: ignore[attr-defined]
    return handle


# -- capacity -------------------------------------------------------------------------------------


def test_capacity_is_the_partitions_gpu_gres_typed_by_the_nodes_features(ex: SlurmExecutor) -> None:
    assert ex.capacity() == [
        Gpu("vl0/0", "vl0", "A100-80GB", "owned"),
        Gpu("vl0/1", "vl0", "A100-80GB", "owned"),
        Gpu("vl1/0", "vl1", "A100-80GB", "spot"),
        Gpu("vl1/1", "vl1", "A100-80GB", "spot"),
    ]


def test_sinfo_lines_become_typed_and_priced_nodes() -> None:
    nodes = parse_sinfo(
        "\n".join(
            [
                "a1|gpu:a100:8(S:0-1)|gpu_type:A100-80GB,spot|mixed",
                "a1|gpu:a100:8(S:0-1)|gpu_type:A100-80GB,spot|mixed",  # a second partition
                "t1|gpu:4,shard:8|on_demand|idle",
                "c1|(null)|(null)|allocated",
                "d1|gpu:h100:8|(null)|drained",
                "n1|gpu:l4:1|price_class:owned|idle*",  # not responding
                "garbage line",
            ]
        )
    )
    got = {n.name: (n.gpus, n.gpu_type, n.price_class, n.usable) for n in nodes}
    assert got == {
        "a1": (8, "A100-80GB", "spot", True),
        "t1": (4, "unknown", "on_demand", True),
        "c1": (0, "unknown", "owned", True),
        "d1": (8, "h100", "owned", False),
        "n1": (1, "l4", "owned", False),
    }


# -- what Slurm says of a job that left no exit status -------------------------------------------


@pytest.mark.parametrize(
    ("line", "state", "code", "words"),
    [
        ("JobId=7 JobState=NODE_FAIL Reason=NodeDown ExitCode=0:0", "lost", None, "its node failed"),
        ("JobId=7 JobState=CANCELLED Reason=None ExitCode=0:15", "exited", 143, "cancelled in Slurm"),
        ("JobId=7 JobState=CANCELLED Reason=None ExitCode=0:0", "exited", 137, "cancelled in Slurm"),
        ("JobId=7 JobState=TIMEOUT Reason=TimeLimit ExitCode=0:0", "exited", 137, "time limit"),
        (
            "JobId=7 JobState=OUT_OF_MEMORY Reason=OutOfMemory ExitCode=0:125",
            "exited",
            128 + 125,
            "out of memory",
        ),
        ("JobId=7 JobState=FAILED Reason=NonZeroExitCode ExitCode=127:0", "exited", 127, "ended FAILED"),
    ],
)
def test_a_slurm_record_without_an_exit_status_becomes_an_outcome(
    line: str, state: str, code: int | None, words: str, tmp_path: Path
) -> None:
    record = parse_job_record(line)
    assert isinstance(record, JobRecord)
    status = from_record("7", record, tmp_path, None)
    assert (status.state, status.exit_code) == (state, code) and words in status.detail, status
    assert parse_job_record("slurm_load_jobs error: Invalid job id specified") is None


def test_a_command_the_node_cannot_run_reads_its_exit_code_and_slurms_message(tmp_path: Path) -> None:
    # visionloop is not where `python` says on the node: the batch script cannot start the shim.
    ex = SlurmExecutor(
        PARTITION, prefix=f"vlslurm-{os.getpid()}", slurm_conf=slurm_conf(), python="/nowhere/python"
    )
    handle = ex.launch(_request(tmp_path, "print(1)"))
    status = wait_exited(ex, handle)
    assert (status.state, status.exit_code) == ("exited", 127), status
    assert "/nowhere/python" in status.detail and "not found" in status.detail, status.detail


def test_a_job_slurm_no_longer_knows_with_no_exit_status_reads_lost(
    ex: SlurmExecutor, tmp_path: Path
) -> None:
    attempt_dir = tmp_path / "job-5" / "attempt-1"
    attempt_dir.mkdir(parents=True)
    status = ex.poll({"executor": "slurm", "attempt_dir": str(attempt_dir), "slurm_job_id": "99999999"})
    assert status.state == "lost" and "no longer knows" in status.detail, status


def test_a_request_no_node_can_hold_says_what_was_asked_and_what_to_do(
    ex: SlurmExecutor, tmp_path: Path
) -> None:
    request = dataclasses.replace(_request(tmp_path, "print(1)"), memory_gb=4096.0)
    with pytest.raises(ExecutorError) as e:
        ex.launch(request)
    said = str(e.value)
    assert "Memory specification can not be satisfied" in said and "--mem=4194304M" in said, said
    assert "Lower resources.cpus or memory_gb" in said and "sinfo -N" in said, said


def test_a_controller_that_cannot_be_reached_is_unavailable_not_a_failure(tmp_path: Path) -> None:
    # The test cluster's config with slurmctld's port moved to where nothing listens.
    conf = Path(slurm_conf())
    dead = tmp_path / "slurm.conf"
    dead.write_text(re.sub(r"(?m)^SlurmctldPort=\d+", "SlurmctldPort=9", conf.read_text()))
    (tmp_path / "gres.conf").write_text((conf.parent / "gres.conf").read_text())
    ex = SlurmExecutor(PARTITION, prefix=f"vlslurm-{os.getpid()}", slurm_conf=str(dead), command_timeout_s=30)
    with pytest.raises(ExecutorUnavailableError, match=r"cannot reach slurmctld .*scontrol ping"):
        ex.capacity()
    # A launch that meets it (the control plane then requeues the job without counting it).
    quick = SlurmExecutor(
        PARTITION, prefix=f"vlslurm-{os.getpid()}", slurm_conf=str(dead), command_timeout_s=1
    )
    with pytest.raises(ExecutorUnavailableError, match="did not answer within 1 s"):
        quick.launch(_request(tmp_path, "print(1)"))


# -- pending, adoption, one attempt at a time ----------------------------------------------------


def test_a_job_pending_in_slurm_reads_running_and_terminate_cancels_it(
    ex: SlurmExecutor, tmp_path: Path
) -> None:
    gpus = [g for g in ex.capacity() if g.node == "vl0"]
    blocker = _launch(ex, _request(tmp_path, SLEEP, gpus=gpus))  # both of vl0's GPUs
    wait_log(ex, blocker, "sleeping")
    waiting = _launch(ex, _request(tmp_path, "print('ran')", gpus=gpus[:1]))
    deadline = time.monotonic() + 30
    while "pending in Slurm" not in (status := ex.poll(waiting)).detail:
        assert time.monotonic() < deadline and status.state == "running", status
        time.sleep(0.2)
    ex.terminate(waiting)
    status = wait_exited(ex, waiting)
    assert (status.state, status.exit_code) == ("exited", 137) and "cancelled in Slurm" in status.detail, (
        status
    )
    assert log_text(ex, waiting) == ""  # it never ran
    assert ex.poll(blocker).state == "running"


def test_a_second_launch_adopts_and_a_new_attempt_stops_the_old(ex: SlurmExecutor, tmp_path: Path) -> None:
    first = _request(tmp_path, SLEEP, job_id=next(_job_ids))
    handle = _launch(ex, first)
    wait_log(ex, handle, "sleeping")
    # The control plane lost sbatch's answer and launches again: the same Slurm job, not two.
    (first.attempt_dir / SLURM_JSON).unlink()
    again = ex.launch(first)
    assert again["slurm_job_id"] == handle["slurm_job_id"]
    # Attempt 1 was counted as failed meanwhile: attempt 2 must not run beside it.
    second = _launch(ex, _request(tmp_path, SLEEP, job_id=first.job_id, attempt=2))
    status = wait_exited(ex, handle)
    # Cancelled: SIGTERM, which the sleeping job does not catch (143), or SIGKILL after KillWait.
    assert status.state == "exited" and status.exit_code in (128 + 15, 128 + 9), status
    wait_log(ex, second, "sleeping")
    assert ex.poll(second).state == "running"


def test_a_job_that_points_its_slurm_json_at_another_job_stops_nothing(
    ex: SlurmExecutor, tmp_path: Path
) -> None:
    other = _launch(ex, _request(tmp_path, SLEEP))
    wait_log(ex, other, "sleeping")
    request = _request(tmp_path, SLEEP)
    mine = _launch(ex, request)
    wait_log(ex, mine, "sleeping")
    # The job writes in its own folder: it names the other team's Slurm job as its own. A
    # control plane that lost the handle (killed between sbatch and storing it) reads that.
    (request.attempt_dir / SLURM_JSON).write_text(
        f'{{"slurm_job_id": "{other["slurm_job_id"]}", "name": "x"}}'
    )
    bare: Handle = {"attempt_dir": str(request.attempt_dir)}
    status = ex.poll(bare)
    assert status.state == "lost" and "is named" in status.detail and "left alone" in status.detail, status
    ex.terminate(bare)
    ex.kill(bare)
    time.sleep(1)
    assert ex.poll(other).state == "running" and "got" not in log_text(ex, other)
    assert ex.poll(mine).state == "running"  # its own handle, from launch, still finds it


def test_a_job_sees_none_of_the_control_planes_secrets(
    ex: SlurmExecutor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VISIONLOOP_DB_URL", "postgresql://vl:s3cret@db/vl")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cret")
    src = (
        "import os; print('seen', sorted(k for k in os.environ if 'SECRET' in k or k.endswith('DB_URL')), "
        "os.environ['MINE'])"
    )
    handle = _launch(ex, _request(tmp_path, src, env={"MINE": "mine"}))
    assert wait_exited(ex, handle).exit_code == 0
    assert "seen [] mine" in log_text(ex, handle)


def test_gpus_that_do_not_match_the_nodes_asked_for_are_refused(ex: SlurmExecutor, tmp_path: Path) -> None:
    one_node = [g for g in ex.capacity() if g.node == "vl0"]
    request = _request(tmp_path, "print(1)", gpus=one_node)
    with pytest.raises(ExecutorError, match=r"asks for 2 node\(s\), but its GPUs lie on 1 \(vl0: 2\)"):
        ex.launch(dataclasses.replace(request, nodes=2))


# -- one run across nodes ------------------------------------------------------------------------

RENDEZVOUS = (
    "import os; print('rdv|' + '|'.join(str(os.environ.get(k)) for k in ('VISIONLOOP_NNODES', "
    "'VISIONLOOP_NODE_RANK', 'MASTER_ADDR', 'MASTER_PORT', 'SLURMD_NODENAME', 'CUDA_VISIBLE_DEVICES')), "
    "flush=True)"
)


def _node_log(request: LaunchRequest, k: int) -> str:
    path = request.attempt_dir / (f"node-{k}" if k else "") / "log"
    return path.read_text() if path.exists() else ""


def test_a_run_across_two_nodes_gets_one_rendezvous(ex: SlurmExecutor, tmp_path: Path) -> None:
    request = dataclasses.replace(_request(tmp_path, RENDEZVOUS), nodes=2)
    handle = _launch(ex, request)
    assert handle["nodes"] == 2
    status = wait_exited(ex, handle)
    assert (status.state, status.exit_code) == ("exited", 0), (
        status,
        _node_log(request, 0),
        _node_log(request, 1),
    )
    lines = [
        next(x for x in _node_log(request, k).splitlines() if x.startswith("rdv|")).split("|") for k in (0, 1)
    ]
    (_, n0, r0, addr0, port0, host0, cvd0), (_, n1, r1, addr1, port1, host1, cvd1) = lines
    assert (n0, r0, n1, r1) == ("2", "0", "2", "1")
    assert addr0 == addr1 == "127.0.0.1" and port0 == port1 and 20000 <= int(port0) < 40000
    assert {host0, host1} == {"vl0", "vl1"}  # two machines, as Slurm sees them
    assert cvd0 == cvd1 == ""  # a CPU job sees no GPU on any node
    assert log_text(ex, handle) == _node_log(request, 0)  # the attempt's log is node 0's
    # A restarted control plane reads the same from the bare handle.
    assert ex.poll({"attempt_dir": str(request.attempt_dir)}).exit_code == 0


# Every node's main process traps SIGTERM, "checkpoints" and exits 75; its child must not be
# signalled (a Slurm step signal would reach it: the stop file does not).
TRAP_NODE = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
    "signal.signal(signal.SIGTERM, lambda s, f: (print('child got', 'SIGTERM', flush=True), sys.exit(1))); "
    "time.sleep(600)"])
def h(s, f):
    print("parent got", "SIGTERM", flush=True)
    time.sleep(1)
    child.kill(); child.wait()
    sys.exit(75)
signal.signal(signal.SIGTERM, h)
print("parent", "ready", flush=True)
while True:
    time.sleep(0.05)
"""


def test_terminate_stops_every_node_through_the_stop_file_and_reads_75(
    ex: SlurmExecutor, tmp_path: Path
) -> None:
    request = dataclasses.replace(_request(tmp_path, TRAP_NODE), nodes=2)
    handle = _launch(ex, request)
    deadline = time.monotonic() + 60
    while not all("parent ready" in _node_log(request, k) for k in (0, 1)):
        assert time.monotonic() < deadline, (_node_log(request, 0), _node_log(request, 1))
        time.sleep(0.2)
    ex.fresh = SlurmExecutor(PARTITION, prefix=ex.prefix, slurm_conf=slurm_conf())  # type: ignore[attr-defined]
    ex.fresh.terminate({"attempt_dir": str(request.attempt_dir)})  # type: ignore[attr-defined]
    status = wait_exited(ex, handle)
    logs = [_node_log(request, k) for k in (0, 1)]
    assert (status.state, status.exit_code) == ("exited", 75), (status, logs)
    assert all("parent got SIGTERM" in log and "child got SIGTERM" not in log for log in logs), logs


def test_a_node_that_fails_stops_the_others_after_the_peer_grace(tmp_path: Path) -> None:
    ex = SlurmExecutor(PARTITION, prefix=f"vlslurm-{os.getpid()}", slurm_conf=slurm_conf(), peer_grace_s=2)
    src = (
        "import os, sys, time; rank = os.environ['VISIONLOOP_NODE_RANK']; print('rank', rank, flush=True); "
        "sys.exit(3) if rank == '1' else time.sleep(600)"
    )
    request = dataclasses.replace(_request(tmp_path, src), nodes=2)
    handle = ex.launch(request)
    try:
        status = wait_exited(ex, handle)
    finally:
        ex.kill(handle)
    assert (status.state, status.exit_code) == ("exited", 3), status
    assert "node 1 of 2: exit 3" in status.detail, status


# -- configuration ---------------------------------------------------------------------------------


def test_the_slurm_executor_section_is_parsed_and_built() -> None:
    cfg = parse_cluster_config(
        {
            "executor": {
                "kind": "slurm",
                "partition": "gpu",
                "account": "vision",
                "prefix": "vl-cv",
                "slurm_conf": "/etc/slurm/slurm.conf",
                "command_timeout_s": 10,
                "python": "/opt/vl/bin/python",
            }
        }
    )
    built = build_executor(cfg)
    assert isinstance(built, SlurmExecutor)
    assert (built.partition, built.account, built.prefix, built.python) == (
        "gpu",
        "vision",
        "vl-cv",
        "/opt/vl/bin/python",
    )
    assert (built.cli.slurm_conf, built.cli.timeout_s) == ("/etc/slurm/slurm.conf", 10.0)


@pytest.mark.parametrize(
    ("section", "words"),
    [
        (
            {"kind": "slurm", "partition": "gpu; rm -rf /"},
            "executor.partition must be a Slurm partition name",
        ),
        ({"kind": "slurm", "account": 3}, "executor.account must be a Slurm account name"),
        ({"kind": "slurm", "python": "venv/bin/python"}, "executor.python must be an absolute path"),
        ({"kind": "slurm", "address": "http://h:8265"}, 'address only apply to kind = "ray"'),
        ({"kind": "ray", "partition": "gpu"}, 'partition only apply to kind = "slurm"'),
        ({"kind": "slurm", "command_timeout_s": 0}, "command_timeout_s must be a finite number >= 1"),
        ({"kind": "slurm", "prefix": "Team A"}, "executor.prefix must be lower-case"),
    ],
)
def test_a_bad_slurm_section_says_what_to_write(section: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_cluster_config({"executor": section}, Path("/etc/vl/cluster.toml"))
    assert words in str(e.value) and "/etc/vl/cluster.toml" in str(e.value), str(e.value)


def test_an_inventory_beside_slurm_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"Remove \[\[inventory\]\].*Feature=gpu_type"):
        parse_cluster_config({"executor": {"kind": "slurm"}, "inventory": [{"count": 1}]})


# -- the control plane on Slurm, end to end ----------------------------------------------------------


def _slurm_config(prefix: str) -> Any:
    executor = {"kind": "slurm", "partition": PARTITION, "prefix": prefix, "slurm_conf": slurm_conf()}
    return cluster_config(executor=executor, teams=TEAMS, scheduler={"cycle_s": 0.5})


def test_on_slurm_a_higher_priority_job_preempts_through_a_checkpoint_and_the_victim_resumes(
    digits_dataset: Path, tmp_path: Path
) -> None:
    prefix = f"vlcp-{os.getpid()}"
    with fresh_database("sqlite", tmp_path) as db_url, control_plane(db_url, _slurm_config(prefix)) as cp:
        assert isinstance(cp.plane.executor, SlurmExecutor)
        gpus = cp.plane.store.list_gpus()
        assert sorted((g.id, g.price_class) for g in gpus) == [
            ("vl0/0", "owned"),
            ("vl0/1", "owned"),
            ("vl1/0", "spot"),
            ("vl1/1", "spot"),
        ]
        # Three GPUs out of service: the two jobs compete for vl1/0. (vl0's GPUs are left to the
        # other tests, which a second test worker may run on this cluster meanwhile.)
        for gpu in ("vl0/0", "vl0/1", "vl1/1"):
            cp.plane.spot_interrupt(gpu, reason="held back by the test")
        low, high = preempt_and_resume(
            cp, digits_dataset, {"resources": {"gpus": 1, "cpus": 1, "memory_gb": 0.5}}
        )
        for attempt in (*low["attempts"], *high["attempts"]):
            assert attempt["executor"] == "slurm" and attempt["handle"]["slurm_job_id"].isdigit()
            assert attempt["handle"]["name"].startswith(f"{prefix}-job-")
            assert [a["gpu_id"] for a in attempt["allocations"]] == ["vl1/0"]


def test_on_slurm_a_job_with_two_nodes_runs_one_process_group_across_both(
    digits_dataset: Path, tmp_path: Path
) -> None:
    with (
        fresh_database("sqlite", tmp_path) as db_url,
        control_plane(db_url, _slurm_config(f"vlmn-{os.getpid()}")) as cp,
    ):
        attempt = two_node_job(cp, digits_dataset, {"gpus": 0, "nodes": 2, "cpus": 2, "memory_gb": 1})
        assert attempt["handle"]["nodes"] == 2 and attempt["exit_code"] == 0
        # Node 1 ran its own shim (its rank is quiet), which recorded a clean exit.
        node1 = json.loads((Path(attempt["handle"]["attempt_dir"]) / "node-1" / "exit.json").read_text())
        assert node1["exit_code"] == 0
