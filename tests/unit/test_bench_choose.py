"""choose_config on hand-built sweep results: the fastest servable point under the budget."""

from __future__ import annotations

import math

import pytest

from visionloop.bench import (
    BatchPoint,
    BenchError,
    BenchResult,
    ConfigResult,
    choose,
    choose_config,
    sweep_settings,
)


def _point(batch: int, p99: float, ips: float) -> BatchPoint:
    return BatchPoint(
        batch_size=batch,
        iterations=10,
        mean_ms=p99 * 0.8,
        p50_ms=p99 * 0.7,
        p90_ms=p99 * 0.9,
        p99_ms=p99,
        max_ms=p99 * 1.1,
        throughput_ips=ips,
        peak_memory_bytes=1 << 20,
    )


def _config(fmt: str, precision: str, points: list[BatchPoint], status: str = "ok") -> ConfigResult:
    return ConfigResult(
        format=fmt,
        precision=precision,
        device="cpu",
        status=status,
        reason=None if status == "ok" else "why",
        points=points,
    )


def _result(*configs: ConfigResult, name: str | None = "digits", version: int | None = 3) -> BenchResult:
    return BenchResult(
        model=f"{name}/{version}" if name else "/runs/x",
        name=name,
        version=version,
        arch="small_cnn",
        input_size=(3, 16, 16),
        settings=sweep_settings(),
        configs=list(configs),
    )


@pytest.fixture
def sweep() -> BenchResult:
    return _result(
        # eager PyTorch is the fastest of all, but the server serves ONNX: never chosen
        _config("pytorch", "fp32", [_point(1, 1.0, 5000), _point(32, 8.0, 90000)]),
        _config("onnx", "fp32", [_point(1, 2.0, 500), _point(8, 9.0, 900), _point(32, 30.0, 1100)]),
        _config("onnx", "int8", [_point(1, 1.5, 700), _point(8, 6.0, 1300), _point(32, 22.0, 1500)]),
        # a failed row's numbers (if any) are not trusted
        _config("onnx", "fp16", [_point(8, 1.0, 99999)], status="failed"),
    )


def test_fastest_point_within_budget_wins(sweep: BenchResult) -> None:
    config = choose_config(sweep, 10.0)
    assert config is not None
    # within 10 ms: onnx fp32 bs1 (500/s), bs8 (900/s); int8 bs1 (700/s), bs8 (1300/s)
    assert (config.format, config.precision, config.device, config.max_batch_size) == (
        "onnx",
        "int8",
        "cpu",
        8,
    )
    assert config.max_queue_delay_ms == pytest.approx(4.0)  # 10 - p99 6.0
    assert config.model == "digits/3"  # the measured version, pinned


def test_bigger_budget_picks_the_bigger_batch(sweep: BenchResult) -> None:
    config = choose_config(sweep, 25.0)
    assert config is not None
    assert (config.precision, config.max_batch_size) == ("int8", 32)
    assert config.max_queue_delay_ms == pytest.approx(3.0)


def test_budget_equal_to_p99_fits_with_no_queue_delay(sweep: BenchResult) -> None:
    config = choose_config(sweep, 22.0)
    assert config is not None
    assert config.max_batch_size == 32 and config.max_queue_delay_ms == 0.0


def test_queue_delay_is_floored_so_delay_plus_p99_stays_in_budget() -> None:
    result = _result(_config("onnx", "fp32", [_point(4, 3.3337, 100)]))
    config = choose_config(result, 10.0)
    assert config is not None
    assert config.max_queue_delay_ms == 6.666  # 6.6663 floored to microseconds, not rounded up
    assert config.max_queue_delay_ms + 3.3337 <= 10.0


def test_nothing_fits_gives_none_and_names_the_closest(sweep: BenchResult) -> None:
    assert choose_config(sweep, 1.0) is None
    choice = choose(sweep, 1.0)
    assert choice.best is None and choice.fitting == 0
    assert choice.closest is not None
    assert (choice.closest.config.precision, choice.closest.point.batch_size) == ("int8", 1)
    text = choice.explain()
    assert "nothing meets the 1 ms budget" in text
    assert "the closest is onnx int8 cpu at batch 1: p99 1.50 ms" in text


def test_explain_says_why_the_choice(sweep: BenchResult) -> None:
    text = choose(sweep, 10.0).explain()
    assert text.startswith("chose onnx int8 cpu at batch 8: p99 6.00 ms, 1,300 images/s")
    assert "the highest throughput of the 4 servable point(s)" in text
    assert "max queue delay 4.00 ms = budget 10 - p99 6.00 ms" in text


def test_no_onnx_rows_means_nothing_to_serve() -> None:
    result = _result(_config("pytorch", "fp32", [_point(1, 1.0, 5000)]))
    choice = choose(result, 100.0)
    assert choice.best is None and choice.closest is None
    assert "no ONNX configuration was measured" in choice.explain()
    assert choose_config(result, 100.0) is None


def test_a_folder_result_cannot_become_a_serving_config() -> None:
    result = _result(_config("onnx", "fp32", [_point(1, 1.0, 5000)]), name=None, version=None)
    with pytest.raises(BenchError, match=r"not a registered model.*bench NAME/VERSION"):
        choose_config(result, 10.0)


@pytest.mark.parametrize("budget", [0.0, -5.0, math.nan])
def test_budget_must_be_positive(sweep: BenchResult, budget: float) -> None:
    with pytest.raises(ValueError, match="must be > 0 ms"):
        choose(sweep, budget)


def test_result_round_trips_through_json(sweep: BenchResult, tmp_path: object) -> None:
    from pathlib import Path

    path = sweep.save(Path(str(tmp_path)) / "bench.json")
    again = BenchResult.load(path)
    assert again == sweep
    assert again.configs[3].status_text == "failed: why"
    assert again.configs[1].peak_memory_bytes == 1 << 20
