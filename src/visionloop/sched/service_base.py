"""What the control plane's parts (admission, reconciliation, the GPU inventory, the cycle
in service.py) share: the collaborators and state they work on, where a job's files go, and
how a job's process is signalled. `ControlPlane.__init__` sets every attribute declared here."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from visionloop.core.errors import ExecutorError
from visionloop.core.settings import Settings
from visionloop.sched.config import ClusterConfig
from visionloop.sched.executors.base import Executor
from visionloop.sched.prices import PriceCatalog
from visionloop.sched.progress import ProgressReader
from visionloop.sched.store import Store
from visionloop.sched.view import Freed

# One logger for the whole control plane, named as before it was split into modules, so log
# filters and the messages' names stay as operators know them.
log = logging.getLogger("visionloop.sched.service")


class PlaneBase:
    """The attributes the control plane's parts read and write, typed in one place."""

    store: Store
    executor: Executor
    config: ClusterConfig
    settings: Settings
    clock: Callable[[], float]
    wake: threading.Event
    _lock: threading.RLock
    jobs_dir: Path
    catalog: PriceCatalog
    # Caches that only spare the store redundant writes and reads (see ControlPlane.__init__).
    _beats_written: dict[int, float]
    _ckpt_steps: dict[int, set[int]]
    _progress: ProgressReader
    _attempts_ended: int
    _inventory_at: float
    # The GPUs the victims that left this cycle freed for the job each stepped aside for
    # (ClusterView.freed_for; the job is stored with the victim, `Job.leaving_for`): in
    # memory, for one cycle, as a restart in between only costs what the policy did before
    # it kept them (a job ahead may take them).
    _freed_for: dict[str, Freed]

    def job_dir(self, job_id: int) -> Path:
        return self.jobs_dir / f"job-{job_id}"

    def _signal(self, job_id: int, *, terminate: bool) -> None:
        for attempt in self.store.active_attempts():
            if attempt.job_id == job_id and attempt.handle:
                try:
                    if terminate:
                        self.executor.terminate(attempt.handle)
                    else:
                        self.executor.kill(attempt.handle)
                except ExecutorError as e:
                    log.warning("could not signal job %s: %s", job_id, e)
