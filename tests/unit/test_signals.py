"""Stop signals become a stop request; a second Ctrl-C stops at once."""

from __future__ import annotations

import os
import signal

import pytest

from visionloop.train.signals import StopRequest


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_signal_requests_a_stop_and_names_itself(sig: signal.Signals) -> None:
    before = signal.getsignal(sig)
    stop = StopRequest().install()
    try:
        # (A tuple, not `assert not stop.requested`: mypy would narrow the flag to False and not
        # see the handler set it.)
        assert (stop.requested, stop.signal_name) == (False, None)
        os.kill(os.getpid(), sig)
        assert stop.requested and stop.signal_name == sig.name
    finally:
        stop.uninstall()
    assert signal.getsignal(sig) == before


def test_second_ctrl_c_interrupts_immediately() -> None:
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.uninstall()


def test_a_burst_of_signals_never_deadlocks_the_handler() -> None:
    """A handler runs between bytecodes, even inside another handler: if it took a lock (as a
    threading.Event does), a second signal arriving mid-handler would wait forever for it.
    Two SIGTERMs in a row are normal: the launcher forwards one, the process group gets one."""
    import subprocess
    import sys

    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from visionloop.train.signals import StopRequest\n"
            "stop = StopRequest().install()\n"
            "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
            "t = time.time()\n"
            "while time.time() - t < 3: pass\n"
            "sys.stdout.write(f'{stop.requested} {stop.signal_name}\\n')\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    for _ in range(2000):
        child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0 and out == "True SIGTERM\n"
