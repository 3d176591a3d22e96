"""A job's `max_runtime` as a user writes it (the job spec, shared with the tune and loop
specs' `job` section), and the reservation switches as cluster.toml gives them."""

from __future__ import annotations

from typing import Any

import pytest

from visionloop.core.durations import format_duration, parse_duration
from visionloop.core.errors import ConfigError
from visionloop.sched.config import parse_cluster_config
from visionloop.sched.policy import PolicyConfig
from visionloop.specs import JobFields, JobSpec

TRAIN = {"epochs": 1, "model": {"arch": "resnet18"}, "data": {"dataset": "/data/digits"}}


@pytest.mark.parametrize(
    ("given", "seconds"),
    [("6h", 21600.0), ("90m", 5400.0), ("2d", 172800.0), ("3600s", 3600.0), (" 1.5H ", 5400.0), (600, 600.0)],
)
def test_max_runtime_takes_a_duration_or_seconds_and_stores_seconds(given: Any, seconds: float) -> None:
    assert JobSpec.model_validate({"train": TRAIN, "max_runtime": given}).max_runtime == seconds
    # The tune and loop specs' `job` section is the same type, and carries it to every job.
    fields = JobFields.model_validate({"max_runtime": given})
    assert (
        JobSpec(train=JobSpec.model_validate({"train": TRAIN}).train, **fields.model_dump()).max_runtime
        == seconds
    )


def test_no_max_runtime_is_none() -> None:
    assert JobSpec.model_validate({"train": TRAIN}).max_runtime is None


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("soon", "'soon' is not a duration; write e.g. 6h, 90m, 2d"),
        ("6", "between 1 minute and 365 days"),  # six seconds: a slip of units
        ("400d", "between 1 minute and 365 days"),
        (-60, "-60 is not a duration"),
        (True, "True is not a duration"),
        (float("inf"), "is not a duration"),
        ("1h30m", "is not a duration"),
    ],
)
def test_a_bad_max_runtime_is_refused_naming_the_field(given: Any, why: str) -> None:
    from visionloop.core.errors import SpecError
    from visionloop.spec_errors import format_validation_error

    with pytest.raises(ValueError) as e:
        JobSpec.model_validate({"train": TRAIN, "max_runtime": given})
    shown = format_validation_error(e.value, JobSpec, "job.yaml")  # type: ignore[arg-type]
    assert "  - max_runtime: " in shown and why in shown and "Example: max_runtime: 6h" in shown, shown
    assert not isinstance(e.value, SpecError)


def test_durations_round_trip_as_people_read_them() -> None:
    assert [format_duration(s) for s in (21600, 5400, 90, 0, 90061)] == [
        "6h",
        "1h 30m",
        "1m 30s",
        "0s",
        "1d 1h 1m 1s",
    ]
    assert parse_duration("15m") == 900.0
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("")


def test_las_preemption_and_its_threshold_come_from_the_scheduler_section() -> None:
    t = parse_cluster_config({}).timings
    assert (t.las_preemption, t.las_threshold_gpu_s) == (True, 3250.0)
    t = parse_cluster_config({"scheduler": {"las_preemption": False, "las_threshold_gpu_s": 7200}}).timings
    assert (t.las_preemption, t.las_threshold_gpu_s) == (False, 7200.0)


def test_reclaim_preempts_young_is_on_unless_the_scheduler_section_says_not() -> None:
    assert parse_cluster_config({}).timings.reclaim_preempts_young is True
    t = parse_cluster_config({"scheduler": {"reclaim_preempts_young": False}}).timings
    assert t.reclaim_preempts_young is False
    with pytest.raises(ConfigError, match=r"scheduler\.reclaim_preempts_young must be true or false"):
        parse_cluster_config({"scheduler": {"reclaim_preempts_young": "yes"}})


def test_quota_under_head_is_on_unless_turned_off_or_with_easy_backfill() -> None:
    assert parse_cluster_config({}).timings.quota_under_head is None  # the policy decides
    assert PolicyConfig().quota_under_head is True
    assert PolicyConfig(easy_backfill=True).quota_under_head is False
    assert PolicyConfig(quota_under_head=False).quota_under_head is False
    assert parse_cluster_config({"scheduler": {"quota_under_head": True}}).timings.quota_under_head is True
    assert parse_cluster_config({"scheduler": {"quota_under_head": False}}).timings.quota_under_head is False
    easy = parse_cluster_config({"scheduler": {"easy_backfill": True}}).timings
    assert easy.quota_under_head is None and easy.easy_backfill is True
    with pytest.raises(ConfigError, match=r"scheduler\.quota_under_head must be true or false"):
        parse_cluster_config({"scheduler": {"quota_under_head": 1}})
    with pytest.raises(ConfigError, match=r"quota_under_head and easy_backfill do not go together"):
        parse_cluster_config({"scheduler": {"quota_under_head": True, "easy_backfill": True}})


def test_holds_yield_to_quota_and_hold_freed_for_job_are_on_unless_turned_off() -> None:
    assert parse_cluster_config({}).timings.holds_yield_to_quota is True
    assert parse_cluster_config({}).timings.hold_freed_for_job is True
    assert PolicyConfig().holds_yield_to_quota is True and PolicyConfig().hold_freed_for_job is True
    off = parse_cluster_config({"scheduler": {"holds_yield_to_quota": False, "hold_freed_for_job": False}})
    assert off.timings.holds_yield_to_quota is False and off.timings.hold_freed_for_job is False
    with pytest.raises(ConfigError, match=r"scheduler\.holds_yield_to_quota must be true or false"):
        parse_cluster_config({"scheduler": {"holds_yield_to_quota": "no"}})
    with pytest.raises(ConfigError, match=r"scheduler\.hold_freed_for_job must be true or false"):
        parse_cluster_config({"scheduler": {"hold_freed_for_job": 0}})


def test_quota_keeps_lower_classes_is_on_unless_turned_off() -> None:
    assert parse_cluster_config({}).timings.quota_keeps_lower_classes is True
    assert PolicyConfig().quota_keeps_lower_classes is True
    off = parse_cluster_config({"scheduler": {"quota_keeps_lower_classes": False}})
    assert off.timings.quota_keeps_lower_classes is False
    with pytest.raises(ConfigError, match=r"scheduler\.quota_keeps_lower_classes must be true or false"):
        parse_cluster_config({"scheduler": {"quota_keeps_lower_classes": "yes"}})
    assert parse_cluster_config({}).timings.hold_within_s == 60.0 == PolicyConfig().hold_within_s
    assert parse_cluster_config({"scheduler": {"hold_within_s": 0}}).timings.hold_within_s == 0.0


def test_the_reservation_switches_come_from_the_scheduler_section() -> None:
    t = parse_cluster_config({}).timings
    assert (t.easy_backfill, t.reservation_tenants, t.victim_order, t.order, t.top_class_preempts_young) == (
        False,
        False,
        "least_lost",
        "las",
        True,
    )
    doc = {
        "scheduler": {
            "easy_backfill": True,
            "reservation_tenants": True,
            "victim_order": "smallest",
            "order": "srpt",
            "top_class_preempts_young": False,
        }
    }
    t = parse_cluster_config(doc).timings
    assert (t.easy_backfill, t.reservation_tenants, t.victim_order, t.order, t.top_class_preempts_young) == (
        True,
        True,
        "smallest",
        "srpt",
        False,
    )


@pytest.mark.parametrize(
    ("scheduler", "message"),
    [
        (
            {"easy_backfill": "yes"},
            "scheduler.easy_backfill must be true or false, got 'yes' (e.g. easy_backfill = true)",
        ),
        ({"easy_backfill": 1}, "scheduler.easy_backfill must be true or false, got 1"),
        (
            {"victim_order": "oldest"},
            'scheduler.victim_order must be "least_lost" or "smallest", got \'oldest\'',
        ),
        (
            {"order": "sjf"},
            'scheduler.order must be "las", "srpt" or "fifo", got \'sjf\' (e.g. order = "srpt")',
        ),
        ({"reservation_tenants": True}, "set easy_backfill = true too, or remove reservation_tenants"),
        (
            {"reservation_tenants": "no", "easy_backfill": True},
            "scheduler.reservation_tenants must be true or false",
        ),
        ({"easy_backfil": True}, "unknown keys ['easy_backfil']"),
        ({"las_preemption": "on"}, "scheduler.las_preemption must be true or false, got 'on'"),
        (
            {"las_threshold_gpu_s": 0},
            "las_threshold_gpu_s must be a finite number >= 1, got 0 (e.g. las_threshold_gpu_s = 3250.0)",
        ),
        ({"las_threshold_gpu_s": "1h"}, "las_threshold_gpu_s must be a finite number >= 1, got '1h'"),
        # TOML's nan passes every comparison and inf stalls a cycle: both refused.
        ({"cycle_s": float("nan")}, "cycle_s must be a finite number >= 0.05, got nan"),
        ({"grace_s": float("inf")}, "grace_s must be a finite number >= 0, got inf"),
        (
            {"top_class_preempts_young": "sometimes"},
            "scheduler.top_class_preempts_young must be true or false, got 'sometimes'",
        ),
    ],
)
def test_bad_reservation_switches_are_refused_naming_the_key(scheduler: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_cluster_config({"scheduler": scheduler})
    assert message in str(e.value)
