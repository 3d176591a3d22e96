"""Test helper: run a call that might hang (a read waiting on a FIFO) under a deadline.

from _hangkit import in_thread
got = in_thread(lambda: load_state(home, "demo"))   # its result, or the exception it raised
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def in_thread(fn: Callable[[], Any]) -> Any:
    """Run `fn` with a deadline, so a read that hangs on a FIFO fails the test instead of
    blocking the suite: the thread is a daemon, left behind if it never returns. Returns what
    `fn` returned, or the exception it raised (for the test to check)."""
    box: list[object] = []

    def target() -> None:
        try:
            box.append(fn())
        except BaseException as e:  # handed to the test
            box.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(60)
    assert box, "the call hung (it is waiting on a FIFO)"
    return box[0]
