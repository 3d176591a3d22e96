"""Graceful stop: SIGTERM, SIGUSR1 or a first Ctrl-C ask the trainer to finish the current
step, write a checkpoint and exit with code 75 (preempted, resumable). A second Ctrl-C
stops at once (the last checkpoint is still there)."""

from __future__ import annotations

import signal
import threading
from types import FrameType

EXIT_PREEMPTED = 75
# Stopped, after a checkpoint, at the epoch it was told to stop at (`--until-epoch`): a tuning
# trial at a rung of its study. Resumable like 75, but nobody asked it to stop: the queue
# keeps it paused until its study promotes it (sched/workload.py TrialWorkload).
EXIT_PAUSED = 76


class StopRequest:
    """A stop flag set by signal handlers (or by `request` from any thread).

    The flag is a plain attribute on purpose: a Python signal handler runs between bytecodes of
    the main thread, possibly in the middle of another handler, so it must never take a lock.
    (A threading.Event deadlocked here: a second SIGTERM arriving while the first handler was
    inside Event.set() waited forever for the lock the first one held.)"""

    def __init__(self) -> None:
        self._requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self._requested

    def request(self, reason: str) -> None:
        if not self._requested:
            self.signal_name = reason
        self._requested = True

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if signum == signal.SIGINT and self._requested and self.signal_name == "SIGINT":
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
