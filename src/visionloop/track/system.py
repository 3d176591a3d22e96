"""System metrics (CPU, memory, GPU) sampled by a thread and logged at the *training* step.

MLflow has a built-in system-metrics monitor, but it numbers its samples from 0 in every
process: a resumed run would log steps 0, 1, 2... again and the series would hold duplicates.
Sampling here and logging at `step_fn()` (the trainer's global step) puts system metrics on the
same axis as the loss, and the tracker's exactly-once rule covers them too: a sample whose step
did not advance since the last one is skipped.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import psutil

from visionloop.track.nvml import Nvml

log = logging.getLogger(__name__)

MIB = 1024 * 1024


class SystemSampler:
    """Calls `log(metrics, step)` every `every_s` seconds with a fresh sample.

    Keys: `system/cpu_percent` (whole machine), `system/process_cpu_percent` (this process and
    its children, e.g. DataLoader workers; 100 = one core), `system/process_rss_mib` (this process
    only: forked workers share most pages, summing their RSS would count them many times),
    `system/memory_used_percent`, and per visible GPU `system/gpu{i}/utilization_percent`,
    `.../memory_used_mib`, `.../memory_used_percent`, `.../power_w` where the GPU reports them.
    """

    def __init__(
        self,
        log_fn: Callable[[dict[str, float], int], None],
        step_fn: Callable[[], int],
        every_s: float = 10.0,
    ) -> None:
        if every_s <= 0:
            raise ValueError(f"every_s must be > 0, got {every_s}")
        self._log = log_fn
        self._step_fn = step_fn
        self._every_s = every_s
        self._last_step: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._proc = psutil.Process(os.getpid())
        self._children: dict[int, psutil.Process] = {}
        self._nvml = Nvml()
        self._warned = False
        # psutil's cpu_percent measures since the previous call; the first call only primes it.
        self._proc.cpu_percent(None)
        psutil.cpu_percent(None)

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("SystemSampler already started")
        self._thread = threading.Thread(target=self._run, name="visionloop-system-metrics", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._nvml.close()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self.tick()

    def tick(self) -> bool:
        """Take and log one sample if the step advanced; True if a sample was logged.

        Never raises: a broken sensor must not stop training, it is reported once.
        """
        try:
            step = int(self._step_fn())
            if self._last_step is not None and step <= self._last_step:
                return False
            metrics = self.sample()
            self._log(metrics, step)
            self._last_step = step
            return True
        except Exception as e:
            if not self._warned:
                log.warning("system metrics sample failed (%s); will keep trying quietly", e)
                self._warned = True
            else:
                log.debug("system metrics sample failed: %s", e)
            return False

    def sample(self) -> dict[str, float]:
        m: dict[str, float] = {
            "system/cpu_percent": float(psutil.cpu_percent(None)),
            "system/process_cpu_percent": self._process_tree_cpu(),
            "system/process_rss_mib": self._proc.memory_info().rss / MIB,
            "system/memory_used_percent": float(psutil.virtual_memory().percent),
        }
        m.update(self._gpu_sample())
        return m

    def _process_tree_cpu(self) -> float:
        total = float(self._proc.cpu_percent(None))
        alive: dict[int, psutil.Process] = {}
        for child in self._proc.children(recursive=True):
            # Keep one Process object per pid: cpu_percent(None) needs the previous reading,
            # a new object would report 0 every time.
            known = self._children.get(child.pid, child)
            try:
                total += float(known.cpu_percent(None))
            except psutil.Error:  # exited between listing and reading
                continue
            alive[child.pid] = known
        self._children = alive
        return total

    def _gpu_sample(self) -> dict[str, float]:
        nv = self._nvml.pynvml
        out: dict[str, float] = {}
        for gpu in self._nvml.gpus:
            prefix = f"system/gpu{gpu.index}"
            # Each reading on its own: MIG slices and some boards refuse some of them.
            try:
                out[f"{prefix}/utilization_percent"] = float(nv.nvmlDeviceGetUtilizationRates(gpu.handle).gpu)
            except Exception as e:
                log.debug("GPU %d utilization unavailable: %s", gpu.index, e)
            try:
                mem = nv.nvmlDeviceGetMemoryInfo(gpu.handle)
                out[f"{prefix}/memory_used_mib"] = mem.used / MIB
                out[f"{prefix}/memory_used_percent"] = 100.0 * mem.used / mem.total if mem.total else 0.0
            except Exception as e:
                log.debug("GPU %d memory unavailable: %s", gpu.index, e)
            try:
                out[f"{prefix}/power_w"] = nv.nvmlDeviceGetPowerUsage(gpu.handle) / 1000.0
            except Exception as e:
                log.debug("GPU %d power unavailable: %s", gpu.index, e)
        return out
