"""Memory fit: exact parameter, gradient and optimizer bytes; activations measured with a real
forward and backward pass, growing with the batch and shrinking with the precision."""

from __future__ import annotations

from pathlib import Path

import torch

from _trainkit import spec_doc
from visionloop.size.memory import (
    ALLOCATOR_HEADROOM,
    FRAMEWORK_OVERHEAD_GIB,
    GIB,
    ActivationProfile,
    estimate_memory,
    measure_activations,
    optimizer_slots,
    static_memory,
)
from visionloop.size.probe import open_probe
from visionloop.specs import OptimizerSpec, validate_train_spec


def test_static_memory_of_a_tiny_linear_model_by_hand() -> None:
    model = torch.nn.Linear(10, 3)  # 10 x 3 weights + 3 biases = 33 parameters
    n = sum(p.numel() for p in model.parameters())
    assert n == 33
    adamw = static_memory(n, n, OptimizerSpec(name="adamw"))
    # fp32 masters: 33 x 4 bytes each for weights and gradients; Adam keeps two fp32 slots.
    assert (adamw.weights, adamw.gradients, adamw.optimizer, adamw.ddp_buckets) == (132, 132, 264, 0)
    assert adamw.total == 528
    sgd = static_memory(n, n, OptimizerSpec(name="sgd", momentum=0.9))
    assert (sgd.optimizer, sgd.total) == (132, 396)
    assert static_memory(n, n, OptimizerSpec(name="sgd", momentum=0.0)).optimizer == 0
    # A frozen layer has weights but neither gradients nor slots; DDP adds one bucket copy.
    frozen = static_memory(n, 3, OptimizerSpec(name="adam"), gpus=2)
    assert (frozen.weights, frozen.gradients, frozen.optimizer, frozen.ddp_buckets) == (132, 12, 24, 12)
    assert [optimizer_slots(OptimizerSpec(name=k)) for k in ("adamw", "adam", "sgd")] == [2, 2, 1]


def test_activations_are_measured_and_scale_with_batch_and_precision(digits_dataset: Path) -> None:
    spec = validate_train_spec(spec_doc(digits_dataset))
    probe = open_probe(spec)
    assert probe.num_params == probe.trainable_params > 0
    fp32 = measure_activations(probe, "fp32")
    bf16 = measure_activations(probe, "bf16")
    assert fp32.per_image > 0 and fp32.method == "bytes saved for backward"
    # The first conv's input alone is saved: 3 x 16 x 16 fp32 values per image at least.
    assert fp32.per_image >= 3 * 16 * 16 * 4
    assert bf16.per_image < fp32.per_image
    # fp16 on the CPU is measured as bf16 (same element size).
    assert measure_activations(probe, "fp16").per_image == bf16.per_image

    def total(batch: int, profile: ActivationProfile, gpus: int = 1) -> int:
        return estimate_memory(
            probe.num_params,
            probe.trainable_params,
            spec.optimizer,
            profile,
            global_batch=batch,
            gpus=gpus,
        ).total

    assert total(64, fp32) < total(128, fp32) < total(1024, fp32)
    assert total(1024, bf16) < total(1024, fp32)
    one = estimate_memory(
        probe.num_params, probe.trainable_params, spec.optimizer, fp32, global_batch=64, gpus=1
    )
    static = static_memory(probe.num_params, probe.trainable_params, spec.optimizer)
    expected = static.total + round(fp32.at(64) * ALLOCATOR_HEADROOM) + round(FRAMEWORK_OVERHEAD_GIB * GIB)
    assert one.total == expected and one.batch_per_gpu == 64
    # Over 4 GPUs each holds a quarter of the batch (and DDP's buckets).
    four = estimate_memory(
        probe.num_params, probe.trainable_params, spec.optimizer, fp32, global_batch=64, gpus=4
    )
    assert four.batch_per_gpu == 16 and four.activations == fp32.at(16) < one.activations
    assert four.static.ddp_buckets == probe.trainable_params * 4
