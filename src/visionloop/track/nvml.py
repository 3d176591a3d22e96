"""The GPUs this process may use, through NVML (`nvidia-ml-py`), without creating a CUDA context.

NVML numbers every GPU in the machine; CUDA numbers only those in CUDA_VISIBLE_DEVICES. On a
shared 8-GPU box a job given GPU 5 must report GPU 5 as its `gpu0`, and nothing about the
other seven, so the visible list is resolved here once for the sampler and the tags alike.
A machine without a GPU, driver or `pynvml` yields no devices and no error.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Gpu:
    index: int  # the CUDA ordinal as this process sees it
    handle: Any
    name: str


def _visible(pynvml: Any, count: int) -> list[Any]:
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    all_handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    if spec is None:
        return all_handles
    handles: list[Any] = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        if entry.lstrip("-").isdigit():
            i = int(entry)
            # CUDA stops at the first invalid ordinal ("0,7,1" on a 2-GPU box is just GPU 0).
            if not 0 <= i < count:
                break
            handles.append(all_handles[i])
            continue
        # A (possibly shortened) GPU-/MIG- UUID.
        matches = [h for h in all_handles if str(_text(pynvml.nvmlDeviceGetUUID(h))).startswith(entry)]
        if len(matches) != 1:
            break
        handles.append(matches[0])
    return handles


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Nvml:
    """An NVML session; `gpus` is empty when NVML is unavailable. Use as a context manager."""

    def __init__(self) -> None:
        self.pynvml: Any = None
        self.gpus: list[Gpu] = []
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:  # no package, no driver, no GPU: all mean "no GPU metrics"
            log.debug("NVML unavailable: %s", e)
            return
        self.pynvml = pynvml
        try:
            handles = _visible(pynvml, int(pynvml.nvmlDeviceGetCount()))
            self.gpus = [Gpu(i, h, _text(pynvml.nvmlDeviceGetName(h))) for i, h in enumerate(handles)]
        except Exception as e:
            log.debug("NVML could not list GPUs: %s", e)
            self.gpus = []

    def driver_version(self) -> str | None:
        if self.pynvml is None:
            return None
        try:
            return _text(self.pynvml.nvmlSystemGetDriverVersion())
        except Exception:
            return None

    def close(self) -> None:
        if self.pynvml is not None:
            try:
                self.pynvml.nvmlShutdown()
            except Exception as e:
                log.debug("nvmlShutdown failed: %s", e)
            self.pynvml = None
            self.gpus = []

    def __enter__(self) -> Nvml:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
