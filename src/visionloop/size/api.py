"""`size_training`: the whole sizing of a train spec, as a function (the CLI renders it).

One real model and a few real batches are measured here, on this machine's CPU (or a GPU
when given): activation memory at two small batches and forward FLOPs per image. Everything
else is arithmetic over the device catalog, the price catalog and earlier runs' speeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from visionloop.core.errors import SpecError
from visionloop.core.settings import Settings
from visionloop.sched.prices import PriceCatalog
from visionloop.size.catalog import HOME_CATALOG, DeviceCatalog, load_devices
from visionloop.size.memory import ActivationProfile, estimate_memory, measure_activations
from visionloop.size.predict import (
    MeasuredFraction,
    compute_precision,
    images_to_train,
    measure_step_cost,
    measured_fractions,
    predict_time,
)
from visionloop.size.probe import open_probe
from visionloop.size.recommend import Option, Recommendation, memory_problem, recommend
from visionloop.specs import TrainSpec

MAX_GPUS = 8


def device_catalog(path: Path | None, settings: Settings) -> DeviceCatalog:
    """`path`, else `$VISIONLOOP_HOME/devices.toml` when it exists, else the shipped catalog."""
    if path is None:
        home_file = settings.home / HOME_CATALOG
        # exists(), not is_file(): a FIFO, device or folder named devices.toml is refused by
        # load_devices, not silently swapped for the shipped catalog (another set of figures).
        path = home_file if home_file.exists() else None
    return load_devices(path)


@dataclass(frozen=True)
class SizingReport:
    spec_arch: str
    task: str
    image_size: int
    global_batch: int
    precision: str
    num_params: int
    trainable_params: int
    train_images: int
    images: int
    flops_per_image: float
    ops_per_step: int
    activations: dict[str, ActivationProfile]
    measured: dict[str, MeasuredFraction]
    recommendation: Recommendation
    devices_source: str
    prices_source: str
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        rec = self.recommendation

        def option(o: Option) -> dict[str, Any]:
            t = o.time
            m = o.memory
            return {
                "device": o.device,
                "gpus": o.gpus,
                "fits": o.fits if m is not None else None,
                "memory_needed_gib": round(m.total_gib, 3) if m is not None else None,
                "device_memory_gib": o.device_memory_gib,
                "batch_per_gpu": m.batch_per_gpu if m is not None else None,
                "hours": t.hours if t is not None else None,
                "seconds_per_step": t.seconds_per_step if t is not None else None,
                "compute_precision": t.choice.compute if t is not None else None,
                "peak_tflops": t.peak_tflops if t is not None else None,
                "sustained_fraction": t.sustained_fraction if t is not None else None,
                "fraction_source": t.fraction_source if t is not None else None,
                "multi_gpu_efficiency": t.efficiency if t is not None else None,
                "on_demand_usd": o.on_demand_usd,
                "spot_usd": o.spot_usd,
                "verdict": o.verdict,
            }

        return {
            "arch": self.spec_arch,
            "task": self.task,
            "image_size": self.image_size,
            "global_batch": self.global_batch,
            "precision": self.precision,
            "num_params": self.num_params,
            "train_images": self.train_images,
            "images_to_train": self.images,
            "training_flops_per_image": self.flops_per_image,
            "operators_per_step": self.ops_per_step,
            "activations": {
                k: {"fixed_bytes": a.fixed, "per_image_bytes": a.per_image, "method": a.method}
                for k, a in self.activations.items()
            },
            "measured_fractions": {
                k: {"fraction": m.fraction, "runs": m.runs, "run_ids": list(m.run_ids)}
                for k, m in self.measured.items()
            },
            "price_class": rec.price_class,
            "deadline_hours": rec.deadline_h,
            "budget_usd": rec.budget_usd,
            "recommended": option(rec.choice) if rec.choice is not None else None,
            "closest": option(rec.closest) if rec.closest is not None else None,
            "advice": rec.advice,
            "options": [option(o) for o in rec.options],
            "devices_catalog": self.devices_source,
            "prices_catalog": self.prices_source,
            "notes": self.notes,
        }


def size_training(
    spec: TrainSpec,
    devices: DeviceCatalog,
    prices: PriceCatalog,
    *,
    deadline_h: float | None = None,
    budget_usd: float | None = None,
    settings: Settings | None = None,
    max_gpus: int = MAX_GPUS,
    measure_on: torch.device | None = None,
) -> SizingReport:
    """Every device x GPU count (1..max_gpus) for `spec`, judged and the best recommended."""
    measure_on = measure_on or torch.device("cpu")
    probe = open_probe(spec, measure_on)
    cost = measure_step_cost(probe, measure_on)
    images = images_to_train(spec, probe.train_images)
    if images == 0:
        raise SpecError(
            f"the train split has {probe.train_images} images, fewer than one batch of "
            f"{spec.data.batch_size}: the trainer would refuse this spec. Lower data.batch_size, or "
            "give `steps` instead of `epochs`."
        )
    measured = (
        measured_fractions(
            settings,
            devices,
            task=spec.task,
            arch=spec.model.arch,
            image_size=spec.data.image_size,
            cost=cost,
        )
        if settings is not None
        else {}
    )
    activations: dict[str, ActivationProfile] = {}
    notes: list[str] = []
    options: list[Option] = []
    batch = spec.data.batch_size
    for device in devices.devices.values():
        choice = compute_precision(spec.precision, spec.deterministic, device)
        if choice.note and choice.note not in notes:
            notes.append(f"{device.name}: {choice.note}")
        # Activations depend on the element size only: fp16 and bf16 share one measurement.
        key = "fp32" if choice.autocast == "fp32" else "half"
        profile = activations.get(key)
        if profile is None:
            profile = activations[key] = measure_activations(probe, choice.autocast, measure_on)
        has_price = device.name in prices.prices
        for gpus in range(1, max_gpus + 1):
            problem = ""
            if batch % gpus:
                problem = f"data.batch_size {batch} does not divide over {gpus} GPUs"
            memory = estimate_memory(
                probe.num_params,
                probe.trainable_params,
                spec.optimizer,
                profile,
                global_batch=batch,
                gpus=gpus,
            )
            problem = problem or memory_problem(memory, device.memory_gib)
            time = predict_time(cost, images, batch, device, gpus, choice, measured.get(device.name))
            on_demand = spot = None
            if has_price and time is not None:
                gpu_hours = time.hours * gpus
                on_demand = gpu_hours * prices.per_gpu_hour(device.name, "on_demand")
                spot = gpu_hours * prices.per_gpu_hour(device.name, "spot")
            elif not problem:
                table = f'[gpus."{device.name}"]'
                problem = f"no price for {device.name} in {prices.source}; add a {table} table"
            options.append(
                Option(
                    device=device.name,
                    gpus=gpus,
                    device_memory_gib=device.memory_gib,
                    memory=memory,
                    time=time,
                    on_demand_usd=on_demand,
                    spot_usd=spot,
                    problem=problem,
                )
            )
    rec = recommend(options, deadline_h=deadline_h, budget_usd=budget_usd, price_class="spot")
    return SizingReport(
        spec_arch=spec.model.arch,
        task=spec.task,
        image_size=spec.data.image_size,
        global_batch=batch,
        precision=spec.precision,
        num_params=probe.num_params,
        trainable_params=probe.trainable_params,
        train_images=probe.train_images,
        images=images,
        flops_per_image=cost.flops_per_image,
        ops_per_step=cost.ops_per_step,
        activations=activations,
        measured=measured,
        recommendation=rec,
        devices_source=devices.source,
        prices_source=prices.source,
        notes=notes,
    )
