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
        assert not stop.requested
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
