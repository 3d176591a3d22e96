"""Graceful stop: SIGTERM, SIGUSR1 or a first Ctrl-C ask the trainer to finish the current
step, write a checkpoint and exit with code 75 (preempted, resumable). A second Ctrl-C
stops at once (the last checkpoint is still there)."""

from __future__ import annotations

import signal
import threading
from types import FrameType

EXIT_PREEMPTED = 75


class StopRequest:
    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self, reason: str) -> None:
        self.signal_name = reason
        self._event.set()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self._event.is_set():
            raise KeyboardInterrupt
        self.request(signal.Signals(signum).name)

    def install(self) -> StopRequest:
        # Signals can only be handled on the main thread; elsewhere (tests driving the
        # trainer from a thread) stopping is done through `request`.
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()
