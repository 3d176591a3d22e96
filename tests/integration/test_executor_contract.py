"""The executor contract: one suite, the same assertions, against every executor: local
processes, a real two-node Ray cluster on loopback (tests/_raykit.py, started once per
session) and a real Slurm cluster (tests/_slurmkit.py: slurmctld and two slurmd with two
fake GPUs, started once by .ci/slurm.sh). What the control plane relies on:

- exit codes 0 / 3 / 75, a signal death (128 + N) and a command that cannot run (127 / 126)
  are read back exactly by `poll`, also by a fresh executor instance (the control plane
  restarted) and through the bare pre-launch handle `{"attempt_dir": ...}`;
- `terminate` sends SIGTERM to the job's main process only, which has time to "checkpoint"
  and exits 75, also when a fresh instance sends it; `kill` stops a job that ignores
  SIGTERM, children included (137); signals to a finished attempt are no-ops;
- an attempt that never started reads lost (the control plane requeues it);
- the log (stdout and stderr) reads back from any byte offset;
- a CPU job sees no GPU, a 1-GPU job exactly one (fake GPUs), and the job's environment
  carries the request's variables and VISIONLOOP_JOB_ID / VISIONLOOP_ATTEMPT.

What only one executor does stays in test_local_executor.py and test_ray_executor.py; the
control plane on Ray, end to end, is in test_control_plane_ray.py. Jobs are short
`python -c` programs printing their markers in pieces (Ray's log starts with the command).
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from _execkit import log_text, wait_exited, wait_log
from _slurmkit import PARTITION, slurm_conf
from visionloop.sched.executors.base import Handle, LaunchRequest
from visionloop.sched.executors.local import LocalExecutor
from visionloop.sched.executors.ray import RayExecutor
from visionloop.sched.executors.slurm import SlurmExecutor
from visionloop.sched.view import Gpu

pytest_plugins = ["_raysession"]  # the session's Ray cluster: `ray_cluster`

PY = sys.executable
PREFIX = "vlcontract"  # Ray submission ids; other modules on the shared cluster use their own
FAKE_GPUS = (Gpu("local/0", "box", "A100-80GB"), Gpu("local/1", "box", "A100-80GB"))
_job_ids = itertools.count(1)

AnyExecutor = LocalExecutor | RayExecutor | SlurmExecutor


@dataclass
class Rig:
    """One executor under test, and how to make a fresh instance of it (a restart)."""

    kind: str
    ex: AnyExecutor
    fresh: Callable[[], AnyExecutor]
    tmp: Path
    handles: list[Handle] = field(default_factory=list)

    def request(
        self, command: Sequence[str], *, gpus: Sequence[Gpu] = (), env: dict[str, str] | None = None
    ) -> LaunchRequest:
        job_id = next(_job_ids)
        return LaunchRequest(
            job_id=job_id,
            attempt=1,
            command=list(command),
            gpus=list(gpus),
            attempt_dir=self.tmp / f"job-{job_id}" / "attempt-1",
            env=env or {},
            cpus=0.05,  # each test Ray node has 1 CPU
            memory_gb=0.0,
        )

    def launch(self, request: LaunchRequest) -> Handle:
        self.handles.append(self.ex.launch(request))
        return self.handles[-1]

    def run(self, src: str, **kw: object) -> tuple[Handle, LaunchRequest]:
        request = self.request([PY, "-c", src], **kw)  # type: ignore[arg-type]
        return self.launch(request), request


@pytest.fixture(params=["local", "ray", "slurm"])
def executor_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def rig(executor_kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rig]:
    """The executor of `executor_kind`; whatever its jobs left running is killed after."""
    fresh: Callable[[], AnyExecutor]
    if executor_kind == "ray":
        address = request.getfixturevalue("ray_cluster").address

        def fresh() -> AnyExecutor:
            return RayExecutor(address, prefix=PREFIX)
    elif executor_kind == "slurm":
        conf = slurm_conf()

        def fresh() -> AnyExecutor:
            # Job ids restart at 1 in every test process: the pid keeps two workers' names apart.
            prefix = f"{PREFIX}-{os.getpid()}"
            return SlurmExecutor(PARTITION, prefix=prefix, slurm_conf=conf, heartbeat_s=0.5)
    else:

        def fresh() -> AnyExecutor:
            return LocalExecutor(FAKE_GPUS, heartbeat_s=0.2)

    rig = Rig(executor_kind, fresh(), fresh, tmp_path)
    yield rig
    for handle in rig.handles:
        rig.ex.kill(handle)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- exit codes, restarts, the bare handle ------------------------------------------------------


def test_exit_codes_are_read_back_exactly_also_after_a_restart(rig: Rig) -> None:
    missing, not_executable = rig.tmp / "missing-program", rig.tmp / "not-executable"
    not_executable.write_text("#!/bin/sh\necho hi\n")
    not_executable.chmod(0o644)
    say = "print('bye', 6 * 7, flush=True); "
    commands: dict[int, list[str]] = {
        0: [PY, "-c", say + "raise SystemExit(0)"],
        3: [PY, "-c", say + "raise SystemExit(3)"],
        75: [PY, "-c", say + "raise SystemExit(75)"],
        128 + 9: [PY, "-c", say + "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
        127: [str(missing), "--flag"],  # as a shell reports a command it cannot find
        126: [str(not_executable)],  # ... or cannot execute
    }
    requests = {code: rig.request(cmd) for code, cmd in commands.items()}
    handles = {code: rig.launch(r) for code, r in requests.items()}  # all at once: faster on Ray
    for code, handle in handles.items():
        status = wait_exited(rig.ex, handle)
        assert (status.state, status.exit_code) == ("exited", code), (status, log_text(rig.ex, handle))

    restarted = rig.fresh()  # the control plane was restarted: it knows only what it stored
    for code, handle in handles.items():
        assert restarted.poll(handle).exit_code == code
        # Killed between committing the attempt and storing the handle, it has only the
        # bare pre-launch handle: the attempt is found from its folder.
        bare: Handle = {"attempt_dir": str(requests[code].attempt_dir)}
        assert restarted.poll(bare).exit_code == code
        adopted = restarted.adopt(requests[code].attempt_dir)
        assert adopted is not None and restarted.poll(adopted).exit_code == code
        if code not in (126, 127):
            assert "bye 42" in log_text(restarted, bare)


def test_an_attempt_that_never_started_reads_lost(rig: Rig) -> None:
    # The control plane committed the attempt and died before launching it.
    bare: Handle = {"attempt_dir": str(rig.tmp / "job-999999" / "attempt-1")}
    status = rig.ex.poll(bare)
    assert status.state == "lost" and status.detail, status
    assert rig.ex.adopt(rig.tmp / "job-999999" / "attempt-1") is None
    rig.ex.terminate(bare)  # nothing to signal: no error
    rig.ex.kill(bare)
    assert log_text(rig.ex, bare) == ""


# -- signals -------------------------------------------------------------------------------------

# The main process starts a child, traps SIGTERM, "checkpoints" for 3.5 s (longer than Ray's
# default stop wait of 3 s: the grace period must be the control plane's) and exits 75. The
# child reports a SIGTERM of its own, which must not come: only the main process is signalled
# (a checkpointing trainer needs its DataLoader workers).
TRAP = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import signal, sys, time
def h(s, f):
    print("child got", "SIGTERM", flush=True); sys.exit(1)
signal.signal(signal.SIGTERM, h)
print("child", "ready", flush=True)
time.sleep(600)
'''])
def h(s, f):
    print("parent got", "SIGTERM", flush=True)
    time.sleep(3.5)
    child.kill(); child.wait()
    print("check", "pointed", flush=True)
    sys.exit(75)
signal.signal(signal.SIGTERM, h)
print("parent", "ready", flush=True)
while True:
    time.sleep(0.05)
"""


def test_terminate_gives_the_main_process_time_to_checkpoint_and_exit_75(rig: Rig) -> None:
    handle, request = rig.run(TRAP)
    wait_log(rig.ex, handle, "parent ready")
    wait_log(rig.ex, handle, "child ready")
    # A restarted control plane re-adopts the running attempt from the bare handle and
    # preempts it.
    restarted = rig.fresh()
    bare: Handle = {"attempt_dir": str(request.attempt_dir)}
    assert restarted.poll(bare).state == "running"
    restarted.terminate(bare)
    status = wait_exited(rig.ex, handle)
    log = log_text(rig.ex, handle)
    assert (status.state, status.exit_code) == ("exited", 75), log
    assert "parent got SIGTERM" in log and "check pointed" in log
    assert "child got SIGTERM" not in log
    assert restarted.poll(handle).exit_code == 75
    restarted.terminate(handle)  # finished: both are no-ops, and the outcome stays
    restarted.kill(handle)
    assert rig.ex.poll(handle).exit_code == 75


def test_kill_stops_a_job_that_ignores_sigterm_and_its_children(rig: Rig) -> None:
    pid_file = rig.tmp / "child.pid"
    src = f"""
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open({str(pid_file)!r}, "w").write(str(child.pid))
print("re" + "ady", flush=True)
while True:
    time.sleep(0.05)
"""
    handle, _ = rig.run(src)
    wait_log(rig.ex, handle, "ready")
    child = int(pid_file.read_text())
    rig.ex.terminate(handle)  # ignored
    rig.ex.kill(handle)
    status = wait_exited(rig.ex, handle)
    assert (status.state, status.exit_code) == ("exited", 128 + 9), status
    deadline = time.monotonic() + 30
    while _alive(child):
        assert time.monotonic() < deadline, f"the job's child {child} survived kill()"
        time.sleep(0.1)
    rig.ex.kill(handle)  # already stopped: no-op
    assert rig.ex.poll(handle).exit_code == 128 + 9


# -- logs and devices ----------------------------------------------------------------------------


def test_the_log_reads_back_from_any_offset(rig: Rig) -> None:
    src = (
        "import sys; print('out', 'line'); print('err', 'line', file=sys.stderr); "
        "print('line-2 \\u00e9'); print('x' * 200_000)"
    )
    handle, _ = rig.run(src)
    assert wait_exited(rig.ex, handle).exit_code == 0
    chunks = list(rig.ex.read_log(handle))
    # Ray serves a job's log through its dashboard agent, whose copy can trail the job's end
    # by a moment on a loaded machine (seen under two test workers): read until it is whole.
    deadline = time.monotonic() + 30
    while b"x" * 200_000 + b"\n" not in b"".join(chunks) and time.monotonic() < deadline:
        time.sleep(0.2)
        chunks = list(rig.ex.read_log(handle))
    assert len(chunks) > 1  # a big log comes in pieces
    full = b"".join(chunks)
    text = full.decode()
    assert "out line\n" in text and "err line\n" in text and "line-2 é\n" in text
    assert "x" * 200_000 + "\n" in text
    offset = full.index(b"line-2")
    assert b"".join(rig.fresh().read_log(handle, offset)) == full[offset:]
    assert b"".join(rig.ex.read_log(handle, len(full))) == b""
    assert b"".join(rig.ex.read_log(handle, len(full) + 10)) == b""
    path = rig.ex.log_path(handle)  # None when the log is not on this machine (Ray)
    assert path is None or path.read_bytes() == full


SHOW = (
    "import os; print('CVD=' + repr(os.environ.get('CUDA_VISIBLE_DEVICES')), "
    "os.environ['VISIONLOOP_JOB_ID'], os.environ['VISIONLOOP_ATTEMPT'], os.environ['MINE'])"
)


def _shown(rig: Rig, handle: Handle) -> list[str]:
    """What SHOW printed: [repr(CUDA_VISIBLE_DEVICES), job id, attempt, MINE]."""
    assert wait_exited(rig.ex, handle).exit_code == 0, log_text(rig.ex, handle)
    log = log_text(rig.ex, handle)
    line = next((x for x in log.splitlines() if x.startswith("CVD=")), None)
    assert line is not None, log
    return line.removeprefix("CVD=").split()


def test_a_cpu_job_sees_no_gpu(rig: Rig) -> None:
    handle, request_ = rig.run(SHOW, env={"MINE": "cpu"})
    # '' (no GPU), not None (unset: every GPU of the machine).
    assert _shown(rig, handle) == ["''", str(request_.job_id), "1", "cpu"]


def test_a_one_gpu_job_sees_exactly_one_gpu(rig: Rig) -> None:
    handle, request = rig.run(SHOW, gpus=rig.ex.capacity()[:1], env={"MINE": "gpu"})
    devices, job_id, attempt, mine = _shown(rig, handle)
    assert devices.strip("'").isdigit(), devices  # one device index
    assert (job_id, attempt, mine) == (str(request.job_id), "1", "gpu")
