"""Peak memory of one benchmark point.

CPU: the process's resident-set high-water mark (VmHWM) above the RSS measured before the
model was loaded. Linux lets a process reset its own high-water mark (`echo 5 >
/proc/self/clear_refs`), so each batch size gets its own peak rather than the largest seen
so far. Where that is not possible the lifetime peak (`ru_maxrss`) is used, which can only
over-report a later, smaller point.

CUDA: `torch.cuda.max_memory_allocated` for eager PyTorch. ONNX Runtime allocates device
memory through its own arena, invisible to torch's allocator; its arena grows to the peak and
keeps it, so the drop in free device memory since before the session was made is its peak.
"""

from __future__ import annotations

import functools
import gc
import resource
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_kib(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def current_rss() -> int:
    kib = _status_kib("VmRSS")
    if kib is not None:
        return kib * 1024
    import psutil

    return int(psutil.Process().memory_info().rss)


def _lifetime_peak() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, looked up once (find_library runs ldconfig); None off glibc."""
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Give memory that earlier work freed back to the OS (glibc keeps it in its arenas, where
    it still counts in RSS). Without this, a configuration measured after another reuses that
    memory without raising RSS, and its peak reads as a few KiB. No-op off glibc."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def reset_rss_peak() -> bool:
    """Reset this process's RSS high-water mark to its current RSS; False if the OS can't."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def rss_peak() -> int:
    kib = _status_kib("VmHWM")
    return kib * 1024 if kib is not None else _lifetime_peak()


class PeakMeter(Protocol):
    kind: str

    def start_point(self) -> None: ...

    def peak_bytes(self) -> int | None: ...


class RssMeter:
    """RSS high-water mark above a baseline taken when the meter is made (before the model)."""

    kind = "rss"

    def __init__(self) -> None:
        trim_heap()
        self.baseline = current_rss()

    def start_point(self) -> None:
        trim_heap()
        reset_rss_peak()

    def peak_bytes(self) -> int | None:
        return max(0, rss_peak() - self.baseline)


class TorchCudaMeter:
    kind = "cuda"

    def __init__(self) -> None:
        import torch

        torch.cuda.synchronize()
        self.baseline = int(torch.cuda.memory_allocated())

    def start_point(self) -> None:
        import torch

        torch.cuda.reset_peak_memory_stats()

    def peak_bytes(self) -> int | None:
        import torch

        torch.cuda.synchronize()
        return max(0, int(torch.cuda.max_memory_allocated()) - self.baseline)


class DeviceFreeMeter:
    """Drop in free device memory since the meter was made (ONNX Runtime's CUDA arena)."""

    kind = "cuda"

    def __init__(self) -> None:
        import torch

        torch.cuda.synchronize()
        self.free_before = int(torch.cuda.mem_get_info()[0])

    def start_point(self) -> None:
        pass

    def peak_bytes(self) -> int | None:
        import torch

        torch.cuda.synchronize()
        return max(0, self.free_before - int(torch.cuda.mem_get_info()[0]))
