"""Time, cost and the recommendation: hand-checked arithmetic, a tiny model that fits
everywhere (cheapest GPU wins), a large one refused by the T4 with the reason, and limits that
nothing meets (no choice, the closest option, what to change)."""

from __future__ import annotations

from pathlib import Path

import pytest

from _trainkit import spec_doc
from visionloop.core.errors import SpecError
from visionloop.core.settings import load_settings
from visionloop.sched.prices import load_catalog
from visionloop.size.api import size_training
from visionloop.size.catalog import Device, load_devices
from visionloop.size.predict import (
    ComputeChoice,
    StepCost,
    compute_precision,
    fraction_from_run,
    measured_fractions,
    multi_gpu_efficiency,
    predict_time,
)
from visionloop.size.recommend import parse_deadline, recommend
from visionloop.specs import validate_train_spec

GPU = Device(
    "G", "test", fp32_tflops=10.0, fp16_tflops=100.0, memory_gib=16, bandwidth_gbs=1, sustained_fraction=0.5
)


def test_time_arithmetic_by_hand() -> None:
    assert multi_gpu_efficiency(1) == 1.0 and multi_gpu_efficiency(2) == pytest.approx(0.9)
    assert multi_gpu_efficiency(8) == pytest.approx(0.729)
    cost = StepCost(flops_per_image=1e9, ops_per_step=0)
    # 100 TFLOPS x 0.5 = 5e13 FLOP/s; 1e9 FLOPs per image -> 50,000 images/s; 3.6e8 images -> 2 h.
    t = predict_time(cost, 360_000_000, 100, GPU, 1, ComputeChoice("fp16", "fp16"))
    assert t is not None and t.hours == pytest.approx(2.0) and t.images_per_s == pytest.approx(50_000)
    t2 = predict_time(cost, 360_000_000, 100, GPU, 2, ComputeChoice("fp16", "fp16"))
    assert t2 is not None and t2.hours == pytest.approx(2.0 / (2 * 0.9))
    # Each operator costs a fixed time per step: 1,000 ops x 10 us = 10 ms on every step.
    slow = predict_time(StepCost(1e9, 1000), 360_000_000, 100, GPU, 1, ComputeChoice("fp16", "fp16"))
    assert slow is not None and slow.seconds_per_step == pytest.approx(100 / 50_000 + 0.01)
    # A run's measured speed gives back the fraction that predicts it.
    measured = fraction_from_run(
        slow.images_per_s, 100, StepCost(1e9, 1000), GPU, 1, ComputeChoice("fp16", "fp16")
    )
    assert measured == pytest.approx(0.5)


def test_precision_resolves_as_the_trainer_does() -> None:
    devices = load_devices(None)
    a100, t4 = devices.device("A100-80GB"), devices.device("T4")
    assert compute_precision("fp32", False, a100).compute == "tf32"
    assert compute_precision("fp32", True, a100).compute == "fp32"  # deterministic turns TF32 off
    assert compute_precision("auto", False, a100) == ComputeChoice("bf16", "bf16")
    assert compute_precision("auto", False, t4).compute == "fp16"
    assert compute_precision("bf16", False, t4).compute == "fp32"


def test_parse_deadline() -> None:
    assert [parse_deadline(t) for t in ("12h", "90m", "2d", "3600s", "1.5")] == [12, 1.5, 48, 1, 1.5]
    for bad in ("soon", "-1h", "0h", "12 hours"):
        with pytest.raises(SpecError, match=r"is not a duration; give e\.g\. 12h"):
            parse_deadline(bad)


def test_a_tiny_model_fits_everywhere_and_the_cheapest_gpu_wins(digits_dataset: Path) -> None:
    spec = validate_train_spec(spec_doc(digits_dataset))
    report = size_training(spec, load_devices(None), load_catalog(None), settings=load_settings())
    rec = report.recommendation
    assert all(o.fits for o in rec.options)
    assert rec.choice is not None and (rec.choice.device, rec.choice.gpus) == ("T4", 1)
    assert report.num_params == 164_962 and report.images == 2 * (1438 // 64) * 64
    others = [o for o in rec.options if o is not rec.choice and not o.problem]
    assert others and all(o.verdict.startswith("costs more") for o in others)
    by = {(o.device, o.gpus): o for o in rec.options}
    assert by[("T4", 3)].verdict == "data.batch_size 64 does not divide over 3 GPUs"
    assert by[("A10G", 1)].verdict.startswith("costs more")


def test_a_gpu_type_without_a_price_is_never_recommended(digits_dataset: Path, tmp_path: Path) -> None:
    prices = tmp_path / "prices.toml"
    prices.write_text('[gpus."L4"]\nowned = 0.3\non_demand = 0.8\nspot = 0.35\n')
    spec = validate_train_spec(spec_doc(digits_dataset))
    report = size_training(spec, load_devices(None), load_catalog(prices), settings=load_settings())
    rec = report.recommendation
    assert rec.choice is not None and (rec.choice.device, rec.choice.gpus) == ("L4", 1)
    unpriced = [o for o in rec.options if o.device != "L4" and o.gpus == 1]
    assert unpriced and all(o.verdict.startswith("no price for") for o in unpriced)


def test_a_large_batch_does_not_fit_a_t4_and_says_why(digits_dataset: Path) -> None:
    doc = spec_doc(digits_dataset, model__arch="resnet18", model__kwargs={}, data__image_size=224)
    doc.update(epochs=None, steps=1000, deterministic=False)
    doc["data"]["batch_size"] = 2048
    spec = validate_train_spec(doc)
    report = size_training(spec, load_devices(None), load_catalog(None), deadline_h=24.0)
    by = {(o.device, o.gpus): o for o in report.recommendation.options}
    t4 = by[("T4", 1)]
    assert t4.memory is not None and not t4.fits and t4.memory.total_gib > 15.0
    assert t4.verdict == (
        f"does not fit: needs {t4.memory.total_gib:.1f} GiB per GPU of 15.0 GiB (batch 2048 per GPU)"
    )
    assert by[("A100-80GB", 1)].fits
    # Memory per GPU falls as the batch spreads over more GPUs.
    assert by[("T4", 8)].memory.total_gib < by[("T4", 2)].memory.total_gib  # type: ignore[union-attr]
    choice = report.recommendation.choice
    assert choice is not None and choice.fits and choice.time is not None and choice.time.hours <= 24.0


def test_limits_nothing_meets_give_the_closest_option_and_what_to_change(digits_dataset: Path) -> None:
    spec = validate_train_spec(spec_doc(digits_dataset))
    report = size_training(spec, load_devices(None), load_catalog(None), deadline_h=1e-9)
    rec = report.recommendation
    assert rec.choice is None and rec.closest is not None
    fastest = min((o for o in rec.options if o.usable), key=lambda o: o.time.hours)  # type: ignore[union-attr]
    assert (rec.closest.device, rec.closest.gpus) == (fastest.device, fastest.gpus)
    assert "no option finishes within" in rec.advice and "Raise --deadline to at least" in rec.advice
    assert all(o.verdict.startswith("too slow") for o in rec.options if o.usable)
    # Within the deadline but over budget: the cheapest on-time option, and the budget it needs.
    over = recommend(rec.options, deadline_h=None, budget_usd=1e-12)
    assert over.choice is None and over.closest is not None and over.closest.device == "T4"
    assert "Raise --budget to at least" in over.advice
    assert all(o.verdict.startswith("too expensive") for o in over.options if o.usable)


def test_a_train_split_smaller_than_one_batch_is_refused(digits_dataset: Path) -> None:
    doc = spec_doc(digits_dataset)
    doc["data"]["batch_size"] = 4096
    with pytest.raises(SpecError, match="fewer than one batch of 4096"):
        size_training(validate_train_spec(doc), load_devices(None), load_catalog(None))


def test_earlier_runs_correct_the_sustained_fraction(digits_dataset: Path) -> None:
    """A real MLflow run, tagged as the trainer tags one that ran on an A100, whose measured
    speed implies a fraction of 0.1: the prediction for the A100 uses it, others keep 0.2."""
    from mlflow import MlflowClient

    settings = load_settings()
    spec = validate_train_spec(spec_doc(digits_dataset))
    devices = load_devices(None)
    report = size_training(spec, devices, load_catalog(None), settings=settings)
    assert report.measured == {}
    cost = StepCost(report.flops_per_image, report.ops_per_step)
    a100 = devices.device("A100-80GB")
    choice = compute_precision("bf16", False, a100)
    # The speed at which a fraction of 0.1 predicts, at batch 64 on one GPU.
    t = predict_time(
        cost, 64_000, 64, a100.__class__(**{**a100.__dict__, "sustained_fraction": 0.1}), 1, choice
    )
    assert t is not None
    settings.ensure()
    client = MlflowClient(tracking_uri=settings.tracking_uri)
    exp = client.create_experiment("sized")
    run = client.create_run(
        exp,
        tags={
            "visionloop.arch": "small_cnn",
            "visionloop.task": "classification",
            "visionloop.precision": "bf16",
            "visionloop.world_size": "1",
            "visionloop.device_type": "cuda",
            "visionloop.env.gpus": "NVIDIA A100-SXM4-80GB",
        },
    )
    client.log_param(run.info.run_id, "data.image_size", "16")
    client.log_param(run.info.run_id, "data.batch_size", "64")
    for step, ips in enumerate([t.images_per_s / 10, t.images_per_s]):  # the first is warm-up
        client.log_metric(run.info.run_id, "train/images_per_s", ips, step=step)
    found = measured_fractions(
        settings, devices, task="classification", arch="small_cnn", image_size=16, cost=cost
    )
    assert set(found) == {"A100-80GB"} and found["A100-80GB"].fraction == pytest.approx(0.1)
    assert found["A100-80GB"].run_ids == (run.info.run_id,)
    again = size_training(spec, devices, load_catalog(None), settings=settings)
    by = {(o.device, o.gpus): o for o in again.recommendation.options}
    assert by[("A100-80GB", 1)].time.sustained_fraction == pytest.approx(0.1)  # type: ignore[union-attr]
    assert by[("H100-80GB", 1)].time.sustained_fraction == 0.2  # type: ignore[union-attr]
    assert "measured by 1 earlier run" in by[("A100-80GB", 1)].time.fraction_source  # type: ignore[union-attr]
