"""The Ray executor's signal script (`SIGNAL_SCRIPT`), run as it runs in a signal job, on real
processes: it SIGTERMs the attempt's process marked with its submission id, and only one of
its own cluster (the same RAY_ADDRESS, which Ray gives every job's driver). Two clusters on
one machine can run jobs with the same submission id: a CI run saw one cluster's terminate
SIGTERM the other's attempt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from visionloop.sched.executors.ray_signal import SIGNAL_SCRIPT, SUBMISSION_ENV

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")

OURS, THEIRS = "127.0.0.1:6379", "127.0.0.1:6380"


@pytest.fixture
def attempt() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A sleeping process marked as attempt `sid` of the cluster at OURS."""
    sid = f"vltest-{uuid.uuid4().hex[:12]}-attempt-1"
    env = {"PATH": os.environ.get("PATH", ""), SUBMISSION_ENV: sid, "RAY_ADDRESS": OURS}
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    yield sid, proc
    proc.kill()
    proc.wait()


def send(sid: str, ray_address: str | None) -> subprocess.CompletedProcess[str]:
    """Run the script as a signal job would (its retries cut from ~10 s to ~0.5 s)."""
    script = SIGNAL_SCRIPT.replace("-ge 40 ]", "-ge 2 ]")
    assert script != SIGNAL_SCRIPT
    env = {"PATH": os.environ.get("PATH", "")}
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    return subprocess.run(
        ["sh", "-c", script, "vl-signal", sid, "TERM"], env=env, capture_output=True, text=True, timeout=30
    )


def test_another_clusters_signal_job_leaves_the_attempt_alone(
    attempt: tuple[str, subprocess.Popen[bytes]],
) -> None:
    sid, proc = attempt
    done = send(sid, THEIRS)
    assert done.returncode == 1 and f"no process of {sid}" in done.stdout
    assert proc.poll() is None  # still running


@pytest.mark.parametrize("address", [OURS, None], ids=["same-cluster", "no-address"])
def test_its_own_clusters_signal_job_sigterms_the_attempt(
    attempt: tuple[str, subprocess.Popen[bytes]], address: str | None
) -> None:
    sid, proc = attempt
    done = send(sid, address)
    assert done.returncode == 0 and f"sent SIGTERM to {proc.pid} ({sid})" in done.stdout, done
    assert proc.wait(timeout=10) == -signal.SIGTERM
