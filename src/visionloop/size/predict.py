"""How long a training job takes on a device: FLOPs per image times images, over the device's
sustained throughput.

- FLOPs per training image are 3 x the forward FLOPs (the backward pass costs about twice the
  forward: gradients with respect to the inputs and to the weights), the forward counted by
  `torch.utils.flop_counter.FlopCounterMode` on the spec's real model and a real batch.
- The device's throughput is its dense peak at the precision the trainer computes in (fp32
  runs on TF32 tensor cores on Ampere and later unless the spec is deterministic, bf16 and fp16
  on their tensor cores) times a sustained fraction, the GPU count, and a multi-GPU
  efficiency of `EFFICIENCY_PER_DOUBLING` (0.9) per doubling of GPUs: an assumption for DDP
  over NVLink on one node, gradient all-reduce overlapped with backward.
- The sustained fraction starts at the catalog's assumption (0.2 for convnets, see devices.toml) and is
  replaced, for a GPU type, by what earlier runs of the same task, architecture and image
  size measured on it: their `train/images_per_s` (MLflow metric; global images per second,
  data loading included) times FLOPs per image, over the peak of their recorded precision,
  world size and efficiency. A run is matched to a device by its `visionloop.env.gpus` tag
  (the NVML name), or to a device named "cpu" when it ran on the CPU.

Not modelled: evaluation passes, checkpoint writes, an input pipeline slower than the GPU
(measured runs include it, the default fraction does not), and time lost to spot
interruptions (a resumed run loses at most the work since its last checkpoint).
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from visionloop.core.settings import Settings
from visionloop.size.catalog import ComputePrecision, Device, DeviceCatalog
from visionloop.size.memory import PROBE_BATCHES
from visionloop.size.probe import TrainingProbe
from visionloop.specs import TrainSpec

log = logging.getLogger(__name__)

EFFICIENCY_PER_DOUBLING = 0.9
TRAINING_FLOPS_PER_FORWARD = 3
# What one eager operator costs beyond its arithmetic on a GPU: the CUDA launch and PyTorch's
# dispatch, about 5-20 us each. A small model at a small batch is bound by it, not by FLOPs.
OP_OVERHEAD_S = 10e-6
# At most this many earlier runs are read per lookup (one metric history each).
MAX_RUNS = 50


def multi_gpu_efficiency(gpus: int) -> float:
    """The share of linear speed-up `gpus` GPUs reach (1.0 for one)."""
    return float(EFFICIENCY_PER_DOUBLING ** math.log2(gpus)) if gpus > 1 else 1.0


class _OpCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the aten operators a forward dispatches: each is at least one kernel launch."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class StepCost:
    """What one training image costs in FLOPs (3 x forward), and what one training step costs in
    operators regardless of the batch (3 x the forward's), the launch-bound floor of a small
    model."""

    flops_per_image: float
    ops_per_step: int


def measure_step_cost(probe: TrainingProbe, device: torch.device | None = None) -> StepCost:
    """Forward FLOPs of one training image at the spec's size and the forward's operator count,
    on a real batch in train mode through the task's training forward (a detector's includes
    its loss heads)."""
    device = device or next(probe.model.parameters()).device
    batch = PROBE_BATCHES[0]
    images, targets = probe.batch(batch, device)
    counter = FlopCounterMode(display=False)
    ops = _OpCounter()
    with torch.no_grad(), counter, ops:
        probe.loss(images, targets)
    return StepCost(
        flops_per_image=TRAINING_FLOPS_PER_FORWARD * counter.get_total_flops() / batch,
        ops_per_step=TRAINING_FLOPS_PER_FORWARD * ops.ops,
    )


@dataclass(frozen=True)
class ComputeChoice:
    """What a spec's precision means on a device: the units it computes on (`compute`), the
    autocast precision (`autocast`: fp32, bf16 or fp16) and why, when it is not obvious."""

    compute: ComputePrecision
    autocast: str
    note: str = ""


def compute_precision(precision: str, deterministic: bool, device: Device) -> ComputeChoice:
    """As the trainer resolves it (`train.device.resolve_precision`, `configure_determinism`)."""
    if precision == "auto":
        if device.bf16_tflops is not None:
            return ComputeChoice("bf16", "bf16")
        return ComputeChoice("fp16", "fp16", "precision auto is fp16 here (no bf16 units)")
    if precision == "fp32":
        if deterministic or device.tf32_tflops is None:
            why = "deterministic: true turns TF32 off" if deterministic else ""
            return ComputeChoice("fp32", "fp32", why)
        return ComputeChoice("tf32", "fp32", "fp32 runs on TF32 tensor cores")
    if precision == "bf16" and device.bf16_tflops is None:
        return ComputeChoice("fp32", "bf16", "no bf16 units: predicted at the FP32 rate; use fp16")
    return ComputeChoice("bf16" if precision == "bf16" else "fp16", precision)


def images_to_train(spec: TrainSpec, train_images: int) -> int:
    """Images the trainer processes: whole batches only (it drops the last partial one)."""
    batch = spec.data.batch_size
    if spec.steps is not None:
        return spec.steps * batch
    return (spec.epochs or 1) * (train_images // batch) * batch


@dataclass(frozen=True)
class MeasuredFraction:
    device: str
    fraction: float
    runs: int
    run_ids: tuple[str, ...]


@dataclass(frozen=True)
class TimePrediction:
    hours: float
    seconds_per_step: float
    images_per_s: float
    peak_tflops: float
    sustained_fraction: float
    fraction_source: str  # "catalog assumption" or "measured: N runs"
    efficiency: float
    choice: ComputeChoice


def predict_time(
    cost: StepCost,
    images: int,
    global_batch: int,
    device: Device,
    gpus: int,
    choice: ComputeChoice,
    measured: MeasuredFraction | None = None,
    op_overhead_s: float = OP_OVERHEAD_S,
) -> TimePrediction | None:
    """The predicted training time, or None when the device has no peak for the precision.

    A step is its arithmetic (the global batch's FLOPs over the sustained throughput of all
    GPUs) plus its operators' fixed cost, paid on every GPU in parallel."""
    peak = device.peak_tflops(choice.compute)
    if peak is None:
        return None
    fraction = measured.fraction if measured is not None else device.sustained_fraction
    source = f"measured by {measured.runs} earlier run(s)" if measured is not None else "catalog assumption"
    efficiency = multi_gpu_efficiency(gpus)
    flops_per_s = peak * 1e12 * fraction * gpus * efficiency
    step_s = global_batch * cost.flops_per_image / flops_per_s + cost.ops_per_step * op_overhead_s
    steps = images / global_batch
    return TimePrediction(
        hours=steps * step_s / 3600.0,
        seconds_per_step=step_s,
        images_per_s=global_batch / step_s,
        peak_tflops=peak,
        sustained_fraction=fraction,
        fraction_source=source,
        efficiency=efficiency,
        choice=choice,
    )


def fraction_from_run(
    images_per_s: float,
    global_batch: int,
    cost: StepCost,
    device: Device,
    world_size: int,
    choice: ComputeChoice,
    op_overhead_s: float = OP_OVERHEAD_S,
) -> float | None:
    """The share of peak a run sustained, the inverse of `predict_time` (None when the device
    has no peak for its precision); capped at 1 when its steps were no slower than their
    operators' fixed cost."""
    peak = device.peak_tflops(choice.compute)
    if peak is None or images_per_s <= 0:
        return None
    compute_s = global_batch / images_per_s - cost.ops_per_step * op_overhead_s
    if compute_s <= 0:
        return 1.0
    flops_per_s = global_batch * cost.flops_per_image / compute_s
    return min(1.0, flops_per_s / (peak * 1e12 * world_size * multi_gpu_efficiency(world_size)))


def _device_of_run(tags: dict[str, str], catalog: DeviceCatalog) -> Device | None:
    if tags.get("visionloop.device_type") == "cpu":
        return next((d for d in catalog.devices.values() if d.name.lower() == "cpu"), None)
    gpus = tags.get("visionloop.env.gpus", "")
    first = gpus.split(",")[0].strip()
    if not first:
        return None
    return next((d for d in catalog.devices.values() if d.matches_gpu_name(first)), None)


def measured_fractions(
    settings: Settings,
    catalog: DeviceCatalog,
    *,
    task: str,
    arch: str,
    image_size: int,
    cost: StepCost,
) -> dict[str, MeasuredFraction]:
    """Per device name, the median sustained fraction of earlier finished runs of the same task,
    architecture and image size on that device. Empty when the store has none or cannot be
    read (the prediction then keeps the catalog's assumption, and says so)."""
    from visionloop.track import store

    if not store.store_exists(settings):
        return {}
    try:
        client = store.client(settings)
        runs = store.search_all(
            client,
            f"tags.`visionloop.arch` = {store.quote_filter_value(arch)} "
            f"and tags.`visionloop.task` = {store.quote_filter_value(task)} "
            f"and params.`data.image_size` = '{int(image_size)}'",
            max_results=MAX_RUNS,
        )
        found: dict[str, list[tuple[float, str]]] = {}
        for run in runs:
            tags = dict(run.data.tags)
            params = dict(run.data.params)
            device = _device_of_run(tags, catalog)
            precision = tags.get("visionloop.precision")
            if device is None or precision not in ("fp32", "bf16", "fp16"):
                continue
            history = [m.value for m in client.get_metric_history(run.info.run_id, "train/images_per_s")]
            # The first interval includes warm-up (allocator, cuDNN autotuning, compilation).
            steady = history[1:] or history
            if not steady:
                continue
            deterministic = params.get("deterministic", "False") == "True"
            choice = compute_precision(precision, deterministic, device)
            world = int(tags.get("visionloop.world_size", "1") or 1)
            batch = int(params.get("data.batch_size", "0") or 0)
            if batch <= 0:
                continue
            fraction = fraction_from_run(statistics.median(steady), batch, cost, device, world, choice)
            if fraction is not None:
                found.setdefault(device.name, []).append((fraction, run.info.run_id))
    except Exception as e:  # a store that is down must not stop a prediction that works without it
        log.warning("could not read earlier runs from the tracking store: %s", e)
        return {}
    return {
        name: MeasuredFraction(
            device=name,
            fraction=min(1.0, statistics.median(f for f, _ in rows)),
            runs=len(rows),
            run_ids=tuple(r for _, r in rows),
        )
        for name, rows in found.items()
    }
