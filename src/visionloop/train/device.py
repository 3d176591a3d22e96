"""Device, precision and determinism choices, resolved once from the spec."""

from __future__ import annotations

import os
import sys
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from visionloop.core.errors import TrainingError
from visionloop.train.dist import DistInfo


def resolve_device(name: str, info: DistInfo) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise TrainingError(
                f"device {name!r} was asked for but CUDA is not available here; use device: cpu or auto."
            )
        # Under torchrun each process owns the GPU of its local rank.
        index = info.local_rank if info.enabled or name == "cuda" else int(name.split(":")[1])
        if index >= torch.cuda.device_count():
            raise TrainingError(f"cuda:{index} does not exist ({torch.cuda.device_count()} GPU(s) visible).")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


@dataclass(frozen=True)
class Precision:
    name: str  # the resolved choice: fp32, bf16 or fp16
    dtype: torch.dtype | None  # autocast dtype, None for fp32

    @property
    def needs_scaler(self) -> bool:
        return self.dtype is torch.float16

    def autocast(self, device: torch.device) -> AbstractContextManager[object]:
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.dtype)


def resolve_precision(name: str, device: torch.device, deterministic: bool) -> Precision:
    if name == "auto":
        if device.type == "cuda":
            name = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        else:
            # CPU autocast is slower than fp32 on most CPUs without AMX, and fp32 is the
            # exactness reference.
            name = "fp32"
    if name == "fp16" and device.type == "cpu" and deterministic:
        raise TrainingError(
            "precision fp16 on CPU is not supported with deterministic: true; use fp32 or bf16."
        )
    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]
    return Precision(name=name, dtype=dtype)


def configure_determinism(deterministic: bool, device: torch.device, *, compiled: bool = False) -> None:
    if deterministic:
        # cuBLAS needs this to be deterministic; must be set before the first cuBLAS call.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # On CUDA several common backward kernels (adaptive average pooling, interpolate) have
        # no deterministic version and would raise; there torch warns instead. Bitwise
        # exactness is promised on CPU, the reference device.
        warn_only = device.type == "cuda"
        if compiled or "torch._inductor.config" in sys.modules:
            torch.use_deterministic_algorithms(True, warn_only=warn_only)
        else:
            # torch.use_deterministic_algorithms imports torch._inductor (and torch._dynamo with
            # it: ~2 s of CPU at every start) only to pass the flag on to inductor. A run that
            # does not compile has no inductor to tell: set the flag the function sets.
            torch._C._set_deterministic_algorithms(True, warn_only=warn_only)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    elif device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def cpu_threads(workers: int, info: DistInfo) -> int | None:
    """Torch's intra-op threads for a run on the CPU: the cores the loader workers leave, at
    least one; None leaves torch's setting alone (OMP_NUM_THREADS given, or a DDP launcher
    that divided the cores between processes).

    Why: torch's OpenMP threads busy-wait at every parallel region. With two threads and two
    loader workers on two cores, a native detector trained at ~170 images/s on a quiet machine
    and at 10 while one other process ran; with one thread it slows down in proportion."""
    if os.environ.get("OMP_NUM_THREADS") or info.enabled:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - workers)
