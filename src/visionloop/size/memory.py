"""Will a training job fit in a GPU's memory? Parameters, gradients, optimizer state and
activations at the spec's batch and precision, plus what the framework itself takes.

- Parameters, gradients and optimizer state are counted exactly. Mixed precision in
  visionloop is autocast (torch.amp): the weights stay fp32 masters, so their gradients and
  the optimizer's slots are fp32 too, whatever `precision` says. SGD with momentum keeps one
  slot per parameter, Adam and AdamW two (exp_avg, exp_avg_sq), SGD without momentum none.
- Activations are measured, not modelled: a real forward and backward pass of the spec's
  model on real training samples, at two small batch sizes, gives a fixed part (autocast's
  casted weight copies, the loss's own buffers) and a per-image slope, scaled linearly to the
  per-GPU batch (the global batch over the GPU count). On CUDA the measure is the allocator's
  peak; on the CPU it is the bytes of the tensors autograd saves for backward (deduplicated by
  storage, parameters excluded), which is what activation memory is.
- DDP (two GPUs or more) keeps its gradient buckets next to the gradients: one more fp32 copy
  of the trainable parameters.
- The framework's own share: the CUDA context with cuBLAS and cuDNN handles and workspaces is
  about 0.5-1 GiB depending on the driver and on lazy module loading; `FRAMEWORK_OVERHEAD_GIB`
  takes 1 GiB. The caching allocator's fragmentation adds about 10% to what is allocated
  (`ALLOCATOR_HEADROOM`), applied to the activations, the part that is allocated and freed
  every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from visionloop.size.probe import TrainingProbe, autocast
from visionloop.specs import OptimizerSpec

GIB = 1024**3
FP32_BYTES = 4
FRAMEWORK_OVERHEAD_GIB = 1.0
ALLOCATOR_HEADROOM = 1.10
# The two batch sizes activations are measured at: 2 rather than 1 because BatchNorm refuses
# a single value per channel in train mode (a classifier's last 1x1 feature map).
PROBE_BATCHES = (2, 4)


def optimizer_slots(optimizer: OptimizerSpec) -> int:
    """fp32 tensors the optimizer keeps per parameter."""
    if optimizer.name in ("adam", "adamw"):
        return 2
    return 1 if optimizer.momentum > 0 else 0


@dataclass(frozen=True)
class StaticMemory:
    """Bytes that do not depend on the batch: fp32 weights, their gradients (trainable ones),
    the optimizer's slots, and DDP's gradient buckets (0 on one GPU)."""

    weights: int
    gradients: int
    optimizer: int
    ddp_buckets: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.ddp_buckets


def static_memory(num_params: int, trainable: int, optimizer: OptimizerSpec, gpus: int = 1) -> StaticMemory:
    return StaticMemory(
        weights=num_params * FP32_BYTES,
        gradients=trainable * FP32_BYTES,
        optimizer=trainable * FP32_BYTES * optimizer_slots(optimizer),
        ddp_buckets=trainable * FP32_BYTES if gpus > 1 else 0,
    )


@dataclass(frozen=True)
class ActivationProfile:
    """Activation bytes of one training step at batch b: `fixed + per_image * b`, measured at
    `batches` on `device` under `precision`'s autocast."""

    fixed: int
    per_image: int
    precision: str
    device: str
    batches: tuple[int, int]
    method: str

    def at(self, batch: int) -> int:
        return self.fixed + self.per_image * batch


def _saved_tensor_bytes(probe: TrainingProbe, batch: int, precision: str, device: torch.device) -> int:
    """Bytes of the tensors autograd keeps for backward in one training step (each storage
    once; the parameters, which exist anyway, not at all)."""
    params = {p.untyped_storage().data_ptr() for p in probe.model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:
            seen[ptr] = storage.nbytes()
        return t

    images, targets = probe.batch(batch, device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast(precision, device):
        loss = probe.loss(images, targets)
    loss.backward()  # type: ignore[no-untyped-call]
    probe.model.zero_grad(set_to_none=True)
    return sum(seen.values())


def _cuda_peak_bytes(probe: TrainingProbe, batch: int, precision: str, device: torch.device) -> int:
    """The allocator's peak during one training step, above what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    images, targets = probe.batch(batch, device)
    with autocast(precision, device):
        loss = probe.loss(images, targets)
    loss.backward()  # type: ignore[no-untyped-call]
    probe.model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def measure_activations(
    probe: TrainingProbe, precision: str, device: torch.device | None = None
) -> ActivationProfile:
    """Activation memory of the probe's model, measured at two small batches and fitted."""
    device = device or next(probe.model.parameters()).device
    if device.type == "cpu" and precision == "fp16":
        # CPU fp16 kernels are emulated (about 100x slower than bf16 here); bf16 has the same
        # element size and autocast casts the same operators.
        precision = "bf16"
    measure = _cuda_peak_bytes if device.type == "cuda" else _saved_tensor_bytes
    method = "CUDA allocator peak" if device.type == "cuda" else "bytes saved for backward"
    small, large = PROBE_BATCHES
    a = measure(probe, small, precision, device)
    b = measure(probe, large, precision, device)
    per_image = max(0, (b - a) // (large - small))
    return ActivationProfile(
        fixed=max(0, a - per_image * small),
        per_image=per_image,
        precision=precision,
        device=str(device),
        batches=PROBE_BATCHES,
        method=method,
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """What one GPU of a `gpus`-GPU job holds at `batch_per_gpu` images per step."""

    static: StaticMemory
    activations: int
    overhead: int
    batch_per_gpu: int
    gpus: int

    @property
    def total(self) -> int:
        return self.static.total + round(self.activations * ALLOCATOR_HEADROOM) + self.overhead

    @property
    def total_gib(self) -> float:
        return self.total / GIB


def estimate_memory(
    num_params: int,
    trainable: int,
    optimizer: OptimizerSpec,
    activations: ActivationProfile,
    *,
    global_batch: int,
    gpus: int,
) -> MemoryEstimate:
    """Memory per GPU of a job whose global batch is split evenly over `gpus`."""
    per_gpu = max(1, global_batch // gpus)
    return MemoryEstimate(
        static=static_memory(num_params, trainable, optimizer, gpus),
        activations=activations.at(per_gpu),
        overhead=round(FRAMEWORK_OVERHEAD_GIB * GIB),
        batch_per_gpu=per_gpu,
        gpus=gpus,
    )
