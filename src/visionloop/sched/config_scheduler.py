"""cluster.toml's `[scheduler]` section: the control plane's timings and the policy's
switches (sched.policy.PolicyConfig says what each switch does; BENCHMARKS.md what each
measured)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from visionloop.core.errors import ConfigError
from visionloop.sched.config_values import number, shown, where


@dataclass(frozen=True)
class SchedulerTimings:
    cycle_s: float = 2.0
    grace_s: float = 120.0
    min_runtime_s: float = 600.0
    top_class_preempts_young: bool = True
    reclaim_preempts_young: bool = True
    quota_under_head: bool | None = None  # None: on, but with easy_backfill (PolicyConfig)
    holds_yield_to_quota: bool = True
    hold_freed_for_job: bool = True
    quota_keeps_lower_classes: bool = True
    hold_within_s: float = 60.0
    heartbeat_timeout_s: float = 60.0
    retry_backoff_s: float = 30.0
    inventory_sync_s: float = 30.0
    order: Literal["las", "fifo", "srpt"] = "las"
    srpt_preemption: bool = False
    las_preemption: bool = True
    las_threshold_gpu_s: float = 3250.0
    # Policy switches beside the timings (sched.policy.PolicyConfig has what each does and
    # BENCHMARKS.md what each measured; the defaults are PolicyConfig's).
    victim_order: Literal["least_lost", "smallest"] = "least_lost"
    easy_backfill: bool = False
    reservation_tenants: bool = False


def parse_scheduler(section: Mapping[str, Any], path: Path | None) -> SchedulerTimings:
    d = SchedulerTimings()
    if not isinstance(section, dict):
        # A string would be read as its characters ("unknown keys ['c', 'y']"), "" or [] crash.
        raise ConfigError(
            f"{where(path, '[scheduler]')} must be a table, got {shown(section)}; "
            "e.g.\n[scheduler]\ncycle_s = 2.0"
        )
    unknown = set(section) - {
        "cycle_s",
        "grace_s",
        "min_runtime_s",
        "top_class_preempts_young",
        "reclaim_preempts_young",
        "quota_under_head",
        "holds_yield_to_quota",
        "hold_freed_for_job",
        "quota_keeps_lower_classes",
        "hold_within_s",
        "heartbeat_timeout_s",
        "retry_backoff_s",
        "inventory_sync_s",
        "order",
        "srpt_preemption",
        "las_preemption",
        "las_threshold_gpu_s",
        "victim_order",
        "easy_backfill",
        "reservation_tenants",
    }
    if unknown:
        raise ConfigError(
            f"{where(path, '[scheduler]')} has unknown keys {shown(sorted(map(str, unknown)), 200)}."
        )
    order = section.get("order", d.order)
    if order not in ("las", "fifo", "srpt"):
        raise ConfigError(
            f'{where(path, "scheduler.order")} must be "las", "srpt" or "fifo", got {shown(order)} '
            '(e.g. order = "srpt").'
        )
    victims = section.get("victim_order", d.victim_order)
    if victims not in ("least_lost", "smallest"):
        raise ConfigError(
            f'{where(path, "scheduler.victim_order")} must be "least_lost" or "smallest", '
            f'got {shown(victims)} (e.g. victim_order = "smallest").'
        )
    easy = flag(section, "easy_backfill", d.easy_backfill, path)
    tenants = flag(section, "reservation_tenants", d.reservation_tenants, path)
    srpt_preemption = flag(section, "srpt_preemption", d.srpt_preemption, path)
    if srpt_preemption and order != "srpt":
        raise ConfigError(
            f"{where(path, 'scheduler.srpt_preemption')} preempts by the remaining time that order "
            '"srpt" ranks jobs by: set order = "srpt" too, or remove srpt_preemption.'
        )
    under = flag(section, "quota_under_head", False, path) if "quota_under_head" in section else None
    if under and easy:
        raise ConfigError(
            f"{where(path, 'scheduler.quota_under_head')} and easy_backfill do not go together (a "
            "head's reservation comes and goes as its tenants start and leave, and they thrash): "
            "remove one of them."
        )
    if tenants and not easy:
        # Tenants start on GPUs a reservation holds, which only EASY backfill holds: alone it
        # would do nothing, silently.
        raise ConfigError(
            f"{where(path, 'scheduler.reservation_tenants')} lets jobs start as tenants on the GPUs a "
            "reservation holds, which only easy_backfill holds: set easy_backfill = true too, or "
            "remove reservation_tenants."
        )
    return SchedulerTimings(
        cycle_s=number(section, "cycle_s", d.cycle_s, path, minimum=0.05),
        grace_s=number(section, "grace_s", d.grace_s, path),
        min_runtime_s=number(section, "min_runtime_s", d.min_runtime_s, path),
        top_class_preempts_young=flag(section, "top_class_preempts_young", d.top_class_preempts_young, path),
        reclaim_preempts_young=flag(section, "reclaim_preempts_young", d.reclaim_preempts_young, path),
        quota_under_head=under,
        holds_yield_to_quota=flag(section, "holds_yield_to_quota", d.holds_yield_to_quota, path),
        hold_freed_for_job=flag(section, "hold_freed_for_job", d.hold_freed_for_job, path),
        quota_keeps_lower_classes=flag(
            section, "quota_keeps_lower_classes", d.quota_keeps_lower_classes, path
        ),
        hold_within_s=number(section, "hold_within_s", d.hold_within_s, path),
        heartbeat_timeout_s=number(section, "heartbeat_timeout_s", d.heartbeat_timeout_s, path, minimum=1),
        retry_backoff_s=number(section, "retry_backoff_s", d.retry_backoff_s, path),
        inventory_sync_s=number(section, "inventory_sync_s", d.inventory_sync_s, path),
        order=order,
        srpt_preemption=srpt_preemption,
        las_preemption=flag(section, "las_preemption", d.las_preemption, path),
        las_threshold_gpu_s=number(section, "las_threshold_gpu_s", d.las_threshold_gpu_s, path, minimum=1),
        victim_order=victims,
        easy_backfill=easy,
        reservation_tenants=tenants,
    )


def flag(section: Mapping[str, Any], key: str, default: bool, path: Path | None) -> bool:
    """A true/false key of the `[scheduler]` section."""
    v = section.get(key, default)
    if not isinstance(v, bool):
        raise ConfigError(
            f"{where(path, f'scheduler.{key}')} must be true or false, got {v!r} (e.g. {key} = true)."
        )
    return v
