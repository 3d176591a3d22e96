"""Latency and throughput sweeps over a model's formats, precisions, devices and batch sizes,
and the serving config that meets a latency budget.

    from visionloop.bench import resolve_target, run_sweep, sweep_settings, choose_config
    result = run_sweep(resolve_target("digits/1"), sweep_settings(batch_sizes="1,8,32"))
    config = choose_config(result, budget_ms=20.0)   # a ServeConfig, or None
"""

from visionloop.bench.choose import Choice, choose, choose_config
from visionloop.bench.output import default_out_dir, write_result, write_serving_config
from visionloop.bench.result import (
    BatchPoint,
    BenchError,
    BenchResult,
    ConfigResult,
    SweepSettings,
    sweep_settings,
)
from visionloop.bench.stats import LatencyStats, percentile, summarize, throughput
from visionloop.bench.sweep import run_sweep
from visionloop.bench.table import result_table
from visionloop.bench.target import BenchTarget, resolve_target, target_from_dir, target_from_version

__all__ = [
    "BatchPoint",
    "BenchError",
    "BenchResult",
    "BenchTarget",
    "Choice",
    "ConfigResult",
    "LatencyStats",
    "SweepSettings",
    "choose",
    "choose_config",
    "default_out_dir",
    "percentile",
    "resolve_target",
    "result_table",
    "run_sweep",
    "summarize",
    "sweep_settings",
    "target_from_dir",
    "target_from_version",
    "throughput",
    "write_result",
    "write_serving_config",
]
