"""The local executor with real processes: what only it does. The executor contract it
shares with the Ray executor (exit codes read back exactly, terminate → SIGTERM → 75, kill
of a job and its children, polling from a fresh executor and the bare handle, logs from an
offset, CPU and 1-GPU jobs) is tests/integration/test_executor_contract.py; the real trainer
preempted and resumed through it, under the control plane, is test_control_plane.py's.

Here: exit.json and shim reaping, heartbeats and `adopt`, GPU pinning by device index, the
DDP launcher under the shim, a SIGKILLed control plane or shim, leftovers, pid reuse, a
launch in progress, commands that cannot run, and what `launch` refuses. Jobs are small
Python commands; waits are bounded and fail with what was seen; no assert depends on
wall-clock speed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from _hangkit import in_thread
from visionloop.core.errors import ExecutorError
from visionloop.sched import shim
from visionloop.sched.executors.attempt_files import log_tail
from visionloop.sched.executors.base import AttemptStatus, Handle, LaunchRequest
from visionloop.sched.executors.local import LocalExecutor, gpu_type
from visionloop.sched.view import Gpu

FAKE_GPUS = [
    Gpu("local/0", "box", "A100-80GB"),
    Gpu("local/1", "box", "A100-80GB"),
    Gpu("local/2", "box", "A100-80GB", price_class="spot"),
    Gpu("local/3", "box", "A100-80GB", price_class="spot"),
]

# A job that says it is ready, then exits 75 on SIGTERM (like the trainer after its
# checkpoint), or 0 once a "go" file appears. One write per line, flushed.
TRAP = r"""
import os, signal, sys, time
from pathlib import Path
stop = []
signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
go = Path(sys.argv[1]) if len(sys.argv) > 1 else None
sys.stdout.write(f"ready {os.getpid()}\n"); sys.stdout.flush()
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    if stop:
        sys.stdout.write("got SIGTERM, checkpointing\n"); sys.stdout.flush()
        sys.exit(75)
    if go is not None and go.exists():
        sys.exit(0)
    time.sleep(0.02)
sys.exit(1)
"""

# A job with a grandchild in its process group, as the DDP launcher has ranks; it stays
# for argv[1] seconds (default 120), its grandchild for 120.
TREE = r"""
import subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
sys.stdout.write(f"grandchild {g.pid}\n"); sys.stdout.flush()
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 120)
"""

# A stand-in rank that stops like the trainer, run by visionloop's own DDP launcher.
RANK = r"""
import os, sys, time
from visionloop.train.signals import StopRequest
stop = StopRequest().install()
sys.stdout.write(f"ready {os.environ['RANK']}\n"); sys.stdout.flush()
while not stop.requested:
    time.sleep(0.02)
sys.stdout.write(f"rank {os.environ['RANK']} stopping on {stop.signal_name}\n"); sys.stdout.flush()
sys.exit(75)
"""
DDP = r"""
import sys
from visionloop.train.launch import launch
sys.exit(launch([sys.executable, "-c", sys.argv[1]], 2))
"""


def py(script: str, *args: str) -> list[str]:
    return [sys.executable, "-c", script, *args]


def wait_for(check: Callable[[], object], what: str | Callable[[], str], timeout: float = 30.0) -> None:
    """Poll `check` until true; fail after `timeout` with `what` (a callable: built at failure)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {timeout:.0f} s waiting for {what() if callable(what) else what}")
        time.sleep(0.02)


def alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie may linger if PID 1 does not reap)."""
    info = shim.proc_info(pid)
    return info is not None and not info.zombie


def log_text(ex: LocalExecutor, handle: Handle, offset: int = 0) -> str:
    return b"".join(ex.read_log(handle, offset)).decode()


def wait_log(ex: LocalExecutor, handle: Handle, needle: str) -> str:
    wait_for(
        lambda: needle in log_text(ex, handle), lambda: f"{needle!r} in the log:\n{log_text(ex, handle)}"
    )
    return log_text(ex, handle)


def wait_done(ex: LocalExecutor, handle: Handle, timeout: float = 60.0) -> AttemptStatus:
    statuses: list[AttemptStatus] = []

    def done() -> bool:
        statuses.append(ex.poll(handle))
        return statuses[-1].state != "running"

    wait_for(
        done, lambda: f"the attempt in {handle['attempt_dir']} to end; log:\n{log_text(ex, handle)}", timeout
    )
    return statuses[-1]


@pytest.fixture
def ex() -> LocalExecutor:
    return LocalExecutor(FAKE_GPUS, heartbeat_s=0.2)


@pytest.fixture
def launched(ex: LocalExecutor, tmp_path: Path) -> Iterator[Callable[..., Handle]]:
    """launch(command, gpus=(), attempt=1) → handle; whatever is left running is killed after."""
    handles: list[Handle] = []

    def launch(command: list[str], gpus: tuple[Gpu, ...] = (), attempt: int = 1, **env: str) -> Handle:
        request = LaunchRequest(
            job_id=7,
            attempt=attempt,
            command=command,
            gpus=gpus,
            attempt_dir=tmp_path / f"a{len(handles)}",
            env=env,
        )
        handles.append(ex.launch(request))
        return handles[-1]

    yield launch
    for h in handles:
        ex.kill(h)


def test_the_shim_records_the_exit_in_exit_json_and_is_reaped(
    ex: LocalExecutor, launched: Callable[..., Handle]
) -> None:
    finished = launched(py("raise SystemExit(3)"))
    killed = launched(py(TREE))
    wait_log(ex, killed, "grandchild ")
    ex.kill(killed)
    for handle, code in ((finished, 3), (killed, 137)):
        assert wait_done(ex, handle).exit_code == code
        record = json.loads((Path(handle["attempt_dir"]) / "exit.json").read_text())
        assert record["exit_code"] == code and record["ended_at"] > 0

        # The executor that launched the shim reaps it (on its next call): no zombie accumulates.
        def reaped(h: Handle = handle) -> bool:
            return ex.poll(h).state == "exited" and shim.proc_info(h["pid"]) is None

        wait_for(reaped, f"shim pid {handle['pid']} to be reaped")


STOPPABLE = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
    "signal.signal(signal.SIGTERM, lambda s, f: (print('child got', 'SIGTERM', flush=True), sys.exit(1))); "
    "time.sleep(600)"])
def h(s, f):
    print("parent got", "SIGTERM", flush=True)
    child.kill()
    sys.exit(75)
signal.signal(signal.SIGTERM, h)
print("re" + "ady", flush=True)
time.sleep(600)
"""


def test_the_shim_answers_its_stop_file_with_sigterm_to_its_job_only(tmp_path: Path) -> None:
    # How a run across machines is stopped (the Slurm executor): a file, not a signal.
    stop, attempt_dir, log = tmp_path / "stop", tmp_path / "attempt", tmp_path / "attempt" / "log"
    argv = [sys.executable, "-m", "visionloop.sched.shim", str(attempt_dir), "--stop-file", str(stop)]
    proc = subprocess.Popen([*argv, "--", sys.executable, "-c", STOPPABLE])
    try:
        wait_for(lambda: log.exists() and "ready" in log.read_text(errors="replace"), "the job to start")
        time.sleep(1)
        assert proc.poll() is None  # no stop file: it runs on
        stop.write_text("stop")
        assert proc.wait(timeout=30) == 75
    finally:
        proc.kill()
    text = log.read_text()
    assert "stop requested" in text and "parent got SIGTERM" in text and "child got SIGTERM" not in text, text
    assert json.loads((attempt_dir / "exit.json").read_text())["exit_code"] == 75


def test_cuda_visible_devices_follows_the_allocation(
    ex: LocalExecutor, launched: Callable[..., Handle]
) -> None:
    assert ex.capacity() == FAKE_GPUS and sum(g.spot for g in ex.capacity()) == 2
    show = "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')), os.environ['VISIONLOOP_JOB_ID'], "
    show += "os.environ['VISIONLOOP_ATTEMPT'], os.environ['CUDA_DEVICE_ORDER'], os.environ['MINE'])"
    # The request's env cannot override the pinning.
    gpu_job = launched(
        py(show), gpus=(FAKE_GPUS[3], FAKE_GPUS[1]), attempt=2, MINE="x", CUDA_VISIBLE_DEVICES="0"
    )
    assert wait_done(ex, gpu_job).exit_code == 0
    assert "'3,1' 7 2 PCI_BUS_ID x" in log_text(ex, gpu_job)
    assert gpu_job["cuda_visible_devices"] == "3,1"


def test_a_ddp_launcher_under_the_shim_stops_every_rank_once(
    ex: LocalExecutor, launched: Callable[..., Handle]
) -> None:
    handle = launched(py(DDP, RANK), gpus=(FAKE_GPUS[0], FAKE_GPUS[1]))
    wait_for(lambda: log_text(ex, handle).count("ready ") == 2, "both ranks to be ready")
    ex.terminate(handle)
    status = wait_done(ex, handle)
    text = log_text(ex, handle)
    assert (status.state, status.exit_code) == ("exited", 75), text
    # Only the launcher was signalled; it forwarded once to each rank.
    assert text.count("stopping on SIGTERM") == 2 and "left" not in text, text


def test_heartbeats_advance_and_adopt_completes_the_bare_handle(
    ex: LocalExecutor, launched: Callable[..., Handle]
) -> None:
    handle = launched(py(TRAP))
    wait_log(ex, handle, "ready")
    first = ex.poll(handle)
    assert first.state == "running" and first.heartbeat_at is not None
    wait_for(lambda: (ex.poll(handle).heartbeat_at or 0) > (first.heartbeat_at or 0), "a newer heartbeat")
    restarted = LocalExecutor(FAKE_GPUS)  # as after a control-plane restart
    assert (restarted.poll({"attempt_dir": handle["attempt_dir"]}).heartbeat_at or 0) > 0
    adopted = restarted.adopt(Path(handle["attempt_dir"]))
    assert adopted is not None
    assert (adopted["pid"], adopted["pid_start_ticks"]) == (handle["pid"], handle["pid_start_ticks"])
    assert adopted["child_pid"] == handle["child_pid"] and adopted["token"] == handle["token"]


CONTROL_PLANE = r"""
import json, sys, time
from pathlib import Path
from visionloop.sched.executors.base import LaunchRequest
from visionloop.sched.executors.local import LocalExecutor
ex = LocalExecutor([])
h = ex.launch(LaunchRequest(1, 1, sys.argv[2:], (), Path(sys.argv[1])))
sys.stdout.write(json.dumps(h) + "\n"); sys.stdout.flush()
time.sleep(120)
"""


def test_a_sigkilled_control_plane_leaves_its_jobs_running(tmp_path: Path) -> None:
    go = tmp_path / "go"
    cp = subprocess.Popen(
        py(CONTROL_PLANE, str(tmp_path / "attempt"), *py(TRAP, str(go))),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert cp.stdout is not None
    line = cp.stdout.readline()
    assert line, f"the control plane died before launching: exit {cp.wait()}"
    handle = json.loads(line)
    os.killpg(cp.pid, signal.SIGKILL)  # the control plane and its whole process group
    cp.wait()

    ex = LocalExecutor([])
    wait_log(ex, handle, "ready")
    assert ex.poll(handle).state == "running"
    assert alive(handle["child_pid"])
    go.touch()
    status = wait_done(ex, handle)
    assert (status.state, status.exit_code) == ("exited", 0)
    assert json.loads((tmp_path / "attempt" / "exit.json").read_text())["exit_code"] == 0


def test_a_sigkilled_shim_takes_its_job_along_and_reads_lost(
    ex: LocalExecutor, launched: Callable[..., Handle]
) -> None:
    handle = launched(py(TREE))
    text = wait_log(ex, handle, "grandchild ")
    grandchild = int(text.split("grandchild ")[1].split()[0])
    os.kill(handle["pid"], signal.SIGKILL)
    wait_for(lambda: not alive(handle["child_pid"]), "the job to die with its shim (PR_SET_PDEATHSIG)")
    # Like a DDP rank whose launcher died: orphaned, still running, until the attempt is
    # declared lost, which must leave nothing of it behind.
    assert alive(grandchild)
    status = ex.poll(handle)
    assert status.state == "lost", status
    assert "without writing exit.json" in status.detail and "SIGKILL" in status.detail, status.detail
    assert "killed 1 leftover process" in status.detail, status.detail
    wait_for(lambda: not alive(grandchild), f"orphaned grandchild {grandchild} to die")
    assert LocalExecutor([]).poll(handle).state == "lost"  # a restarted control plane agrees
    ex.kill(handle)  # nothing left to kill: no error


def test_what_a_job_leaves_behind_dies_with_it(ex: LocalExecutor, launched: Callable[..., Handle]) -> None:
    handle = launched(py(TREE, "0"))  # exits at once; its grandchild would stay
    status = wait_done(ex, handle)
    assert (status.state, status.exit_code) == ("exited", 0)
    text = log_text(ex, handle)
    grandchild = int(text.split("grandchild ")[1].split()[0])
    assert "the job left 1 process(es) behind" in text
    wait_for(lambda: not alive(grandchild), f"leftover grandchild {grandchild} to die")


def test_a_reused_pid_is_never_signalled_and_reads_lost(ex: LocalExecutor, tmp_path: Path) -> None:
    stranger = subprocess.Popen(py("import time; time.sleep(120)"), start_new_session=True)
    try:
        ticks = shim.start_ticks(stranger.pid)
        assert ticks is not None
        (tmp_path / "old").mkdir()
        # The handle of a long-gone attempt whose pids now belong to someone else.
        handle: Handle = {
            "executor": "local",
            "node": ex.node,
            "attempt_dir": str(tmp_path / "old"),
            "token": "0123456789abcdef",
            "pid": stranger.pid,
            "pid_start_time": None,
            "pid_start_ticks": ticks - 1,
            "boot_id": shim.boot_id(),
            "child_pid": stranger.pid,
            "child_start_ticks": ticks - 1,
            "child_pgid": stranger.pid,
        }
        status = ex.poll(handle)
        assert status.state == "lost" and "belongs to another process" in status.detail, status
        ex.terminate(handle)
        ex.kill(handle)
        assert stranger.poll() is None, "a process that merely reuses a recorded pid was signalled"
    finally:
        stranger.kill()
        stranger.wait()


def test_a_launch_in_progress_reads_running_never_lost(ex: LocalExecutor, tmp_path: Path) -> None:
    # The executor holds the attempt's lock from before the fork; a control plane restarted
    # at that instant must not requeue (and so duplicate) the job.
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    fd = shim.take_lock(attempt)
    assert fd is not None
    try:
        status = ex.poll({"attempt_dir": str(attempt)})
        assert status.state == "running" and "starting" in status.detail
    finally:
        os.close(fd)
    status = ex.poll({"attempt_dir": str(attempt)})
    assert status.state == "lost" and "never started" in status.detail


@pytest.mark.parametrize(("make", "code"), [("missing", 127), ("not executable", 126)])
def test_a_command_that_cannot_run_exits_like_a_shell(
    ex: LocalExecutor, launched: Callable[..., Handle], tmp_path: Path, make: str, code: int
) -> None:
    program = tmp_path / "program"
    if make == "not executable":
        program.write_text("#!/bin/sh\necho hi\n")
        program.chmod(0o644)
    handle = launched([str(program), "--flag"])
    status = wait_done(ex, handle)
    assert (status.state, status.exit_code) == ("exited", code)
    assert f"cannot run '{program}'" in log_text(ex, handle)


def test_launch_refuses_what_it_cannot_do(
    ex: LocalExecutor, launched: Callable[..., Handle], tmp_path: Path
) -> None:
    with pytest.raises(ExecutorError, match="not on this executor"):
        launched(py("pass"), gpus=(Gpu("other/9", "box", "A100-80GB"),))
    handle = launched(py("pass"))
    wait_done(ex, handle)
    again = LaunchRequest(7, 1, py("pass"), (), Path(handle["attempt_dir"]))
    with pytest.raises(ExecutorError, match="already used"):
        ex.launch(again)
    with pytest.raises(ExecutorError, match="same device index"):
        LocalExecutor([Gpu("a/0", "a", "T4-16GB"), Gpu("b/0", "a", "T4-16GB")])
    LocalExecutor(
        [Gpu("local/0", "local", "fake"), Gpu("spot-a/0", "spot-a", "fake", "spot")]
    )  # simulated nodes
    with pytest.raises(ExecutorError, match="does not end in a device index"):
        LocalExecutor([Gpu("gpu-a", "a", "T4-16GB")])
    # A shim that cannot start: the error carries its output.
    broken = tmp_path / "broken-python"
    broken.write_text("#!/bin/sh\necho 'no module named visionloop' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(ExecutorError, match="no module named visionloop"):
        LocalExecutor([], python=str(broken)).launch(LaunchRequest(1, 1, py("pass"), (), tmp_path / "b"))


@pytest.mark.parametrize(
    ("name", "mib", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA H100 PCIe", 81559, "H100-80GB"),
        ("NVIDIA H100 NVL", 95830, "H100-94GB"),
        ("NVIDIA H200", 143771, "H200-141GB"),
        ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
        ("NVIDIA A10G", 23028, "A10G-24GB"),
        ("NVIDIA L4", 23034, "L4-24GB"),
        ("Tesla T4", 15360, "T4-16GB"),
        ("NVIDIA GeForce RTX 4090", 24564, "RTX4090-24GB"),
    ],
)
def test_gpu_type_names_from_nvml(name: str, mib: int, expected: str) -> None:
    assert gpu_type(name, mib * 2**20) == expected


@pytest.mark.gpu
def test_nvml_discovers_this_machines_gpus() -> None:
    import re

    gpus = LocalExecutor().capacity()
    assert gpus, "torch sees a GPU, NVML should too"
    assert [g.id for g in gpus] == [f"{gpus[0].node}/{i}" for i in range(len(gpus))]
    assert all(re.fullmatch(r"[A-Za-z0-9]+-\d+GB", g.type) and g.price_class == "owned" for g in gpus)


def test_a_log_replaced_by_a_link_or_a_fifo_is_refused_not_followed(
    ex: LocalExecutor, launched: Callable[..., Handle], tmp_path: Path
) -> None:
    """The job's own process owns its attempt folder: it may swap its log for a link to a file
    the control plane can read (the admin token) or for a FIFO (opening one blocked the API's
    thread until a writer came). `read_log` reads only a regular file."""
    secret = tmp_path / "admin.token"
    secret.write_text("vl-admin-secret")
    handle = launched(py("print('hello')"))
    assert wait_done(ex, handle).exit_code == 0
    assert "hello" in log_text(ex, handle)
    log = Path(handle["attempt_dir"]) / shim.LOG
    log.unlink()
    log.symlink_to(secret)
    with pytest.raises(ExecutorError, match="is a symbolic link; it is not read"):
        log_text(ex, handle)
    log.unlink()
    os.mkfifo(log)
    with pytest.raises(ExecutorError, match="is not a regular file; it is not read"):
        log_text(ex, handle)  # refused at once: before, this blocked until a writer came
    # The end of the log in a start failure's message: the link's target is not shown either.
    log.unlink()
    log.symlink_to(secret)
    shown = log_tail(log)
    assert "vl-admin-secret" not in shown and "is a symbolic link; it is not read" in shown
    # Its status files too: a FIFO as exit.json blocked every poll of the control plane.
    ended = Path(handle["attempt_dir"]) / shim.EXIT_JSON
    ended.unlink()
    os.mkfifo(ended)
    got = in_thread(lambda: ex.poll(handle))
    assert isinstance(got, ExecutorError) and "is not a regular file" in str(got), got
    ended.unlink()
    ended.symlink_to(secret)
    got = in_thread(lambda: ex.poll(handle))
    assert isinstance(got, ExecutorError) and "vl-admin-secret" not in str(got), got


def test_a_job_that_links_its_log_elsewhere_does_not_get_the_shim_to_write_there(
    ex: LocalExecutor, launched: Callable[..., Handle], tmp_path: Path
) -> None:
    """The shim writes its own lines (how the job ended) into the log. It opened the log by
    name for each line, so a job that replaced its log by a link had the shim append to the
    link's target (any file the control plane's user can write: the job store, a config)."""
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched\n")
    log = tmp_path / "a0" / shim.LOG  # the first launch's attempt folder
    code = "import os, signal, sys; os.unlink(sys.argv[1]); os.symlink(sys.argv[2], sys.argv[1]); "
    handle = launched(py(code + "os.kill(os.getpid(), signal.SIGTERM)", str(log), str(victim)))
    assert handle["attempt_dir"] == str(log.parent)
    status = wait_done(ex, handle)
    assert status.exit_code == 128 + signal.SIGTERM
    assert victim.read_text() == "untouched\n"
