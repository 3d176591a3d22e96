"""The local DDP launcher: signals reach every rank as one clean stop; exits combine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# A stand-in rank: installs the trainer's stop handling, says it is ready, and exits 75 once
# asked to stop, like the trainer after its checkpoint; exit 130 if a second SIGINT aborted it.
RANK = r"""
import os, sys, time
from visionloop.train.signals import StopRequest
stop = StopRequest().install()
# One write() per line: both ranks share the pipe, and print() makes two writes (text, then
# end), which interleave between processes when output is unbuffered.
sys.stdout.write(f"ready {os.environ['RANK']}\n")
sys.stdout.flush()
try:
    while not stop.requested:
        time.sleep(0.01)
    sys.stdout.write(f"rank {os.environ['RANK']} stopping on {stop.signal_name}\n")
    sys.stdout.flush()
    time.sleep(1.0)  # the "checkpoint": a forwarded second signal would land here
except KeyboardInterrupt:
    sys.stdout.write(f"rank {os.environ['RANK']} aborted\n")
    sys.stdout.flush()
    sys.exit(130)
sys.exit(75)
"""

LAUNCHER = """
import sys
from visionloop.train.launch import launch
sys.exit(launch([sys.executable, "-c", sys.argv[1]], 2))
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_whole_group_stops_every_rank_cleanly(sig: signal.Signals) -> None:
    p = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, RANK], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert p.stdout is not None
    ready = {p.stdout.readline().split()[1] for _ in range(2)}
    assert ready == {"0", "1"}
    os.killpg(p.pid, sig)  # Ctrl-C in a terminal, or a scheduler's TERM: the whole group
    try:
        out, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"the launcher did not finish; its ranks said:\n{out}")
    assert p.returncode == 75, out
    assert out.count("stopping on") == 2 and "aborted" not in out, out


def test_a_failing_rank_stops_the_others(tmp_path: Path) -> None:
    marker, ready = tmp_path / "rank1-stopped", tmp_path / "rank1-ready"
    # Rank 0 fails only once rank 1 has installed its handler: under load, a stop that arrives
    # while rank 1 is still importing kills it with Python's default SIGTERM (seen in CI).
    rank = f"""
import os, sys, time
from visionloop.train.signals import StopRequest
stop = StopRequest().install()
if os.environ["RANK"] == "0":
    deadline = time.monotonic() + 50
    while not os.path.exists({str(ready)!r}) and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(3)
open({str(ready)!r}, "w").write("ready")
while not stop.requested:
    time.sleep(0.01)
open({str(marker)!r}, "w").write("stopped")
sys.exit(75)
"""
    p = subprocess.run([sys.executable, "-c", LAUNCHER, rank], capture_output=True, text=True, timeout=60)
    assert p.returncode == 3  # the real failure, not the 75 of the rank that was stopped
    assert marker.read_text() == "stopped"  # rank 1 got the launcher's stop and exited cleanly
