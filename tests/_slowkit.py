"""Test helper: make one call slow, to show what else goes on meanwhile (a health check that
must answer while a slow step runs off the event loop)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

SLOW_S = 3.0  # how long the slow step takes: far longer than a health check on loopback


class SlowStep:
    """Wraps a function: records the thread of every call; the first call that `when(*args)`
    accepts sets `started`, sleeps SLOW_S, runs the real function, then sets `ended`."""

    def __init__(self, real: Callable[..., Any], when: Callable[..., bool] = lambda *a: True) -> None:
        self.real = real
        self.when = when
        self.threads: list[threading.Thread] = []
        self.started = threading.Event()
        self.ended = threading.Event()

    def __call__(self, *args: Any) -> Any:
        self.threads.append(threading.current_thread())
        if self.started.is_set() or not self.when(*args):
            return self.real(*args)
        self.started.set()
        try:
            time.sleep(SLOW_S)
            return self.real(*args)
        finally:
            self.ended.set()
