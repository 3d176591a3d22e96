"""Latency percentiles, throughput and the sweep's option checks, on known numbers."""

from __future__ import annotations

import numpy as np
import pytest

from visionloop.bench import BenchError, percentile, summarize, sweep_settings, throughput
from visionloop.bench.evalset import spread_positions
from visionloop.bench.sweep import fill_batch, time_calls


def test_percentiles_interpolate_between_ranks_like_numpy() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 7.0, 6.0, 9.0, 8.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 10.0
    assert percentile(values, 50) == 5.5  # halfway between 5 and 6
    assert percentile(values, 90) == pytest.approx(9.1)  # rank 8.1: 9 + 0.1 * (10 - 9)
    for q in (1, 25, 50, 90, 99):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([7.0], 99) == 7.0


def test_percentile_rejects_nothing_and_out_of_range() -> None:
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"0\.\.100"):
        percentile([1.0], 101)


def test_throughput_counts_every_image_over_all_time() -> None:
    # 4 calls of batch 8 taking 0.1 + 0.1 + 0.1 + 0.2 s: 32 images in 0.5 s.
    assert throughput(8, [0.1, 0.1, 0.1, 0.2]) == pytest.approx(64.0)
    with pytest.raises(ValueError, match="positive total"):
        throughput(8, [0.0])


def test_summarize_reports_milliseconds() -> None:
    timings = [0.010] * 98 + [0.020, 0.100]  # 100 calls: one slow outlier, one slower
    s = summarize(4, timings)
    assert s.batch_size == 4 and s.iterations == 100
    assert s.p50_ms == pytest.approx(10.0)
    assert s.p90_ms == pytest.approx(10.0)
    # rank 98.01 of 0..99: 20 + 0.01 * (100 - 20)
    assert s.p99_ms == pytest.approx(20.8)
    assert s.max_ms == pytest.approx(100.0)
    assert s.mean_ms == pytest.approx((0.98 + 0.02 + 0.1) * 1000 / 100)
    assert s.throughput_ips == pytest.approx(400 / 1.1)


def test_time_calls_honours_iterations_and_warmup() -> None:
    calls = []
    timings = time_calls(lambda: calls.append(1), warmup=3, iterations=7, duration_s=100.0, min_iterations=1)
    assert len(timings) == 7 and len(calls) == 10
    assert all(t >= 0 for t in timings)


def test_time_calls_by_duration_runs_at_least_the_minimum() -> None:
    calls = []
    timings = time_calls(
        lambda: calls.append(1), warmup=0, iterations=None, duration_s=1e-9, min_iterations=5
    )
    assert len(timings) == 5 == len(calls)


def test_fill_batch_cycles_through_inputs() -> None:
    inputs = np.arange(3 * 2, dtype=np.float32).reshape(3, 2)
    batch = fill_batch(inputs, 5)
    assert batch.shape == (5, 2)
    assert batch[:, 0].tolist() == [0.0, 2.0, 4.0, 0.0, 2.0]
    assert batch.flags["C_CONTIGUOUS"]


def test_spread_positions_cover_the_whole_split() -> None:
    assert spread_positions(5, None) == [0, 1, 2, 3, 4]
    assert spread_positions(5, 10) == [0, 1, 2, 3, 4]
    picked = spread_positions(1000, 10)
    assert len(picked) == 10 and picked[0] == 0 and picked[-1] == 999
    assert picked == sorted(picked)


def test_sweep_settings_parse_lists_and_defaults() -> None:
    s = sweep_settings(
        formats="onnx, pytorch", precisions="int8,fp32,int8", batch_sizes="32,1,8", devices="cpu"
    )
    assert s.formats == ("onnx", "pytorch")
    assert s.precisions == ("int8", "fp32")  # order kept, repeat dropped
    assert s.batch_sizes == (1, 8, 32)
    d = sweep_settings()
    assert d.formats == ("pytorch", "onnx") and d.batch_sizes == (1, 8, 32) and d.devices == ("cpu",)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"formats": "onnx,tensorrt"},
            r"--formats: unknown value\(s\) 'tensorrt'; choose from pytorch, onnx",
        ),
        ({"precisions": "bf16"}, r"--precisions: unknown value\(s\) 'bf16'"),
        ({"devices": "tpu"}, r"--device: unknown value\(s\) 'tpu'; choose from cpu, cuda"),
        ({"formats": ""}, "--formats needs at least one value"),
        ({"batch_sizes": "1,0"}, "--batch-sizes: 0 is not a batch size"),
        ({"batch_sizes": "-4"}, "--batch-sizes: -4 is not a batch size"),
        ({"batch_sizes": "eight"}, "--batch-sizes: 'eight' is not a whole number"),
        ({"iterations": 0}, "--iterations must be >= 1"),
        ({"duration_s": 0.0}, "--duration must be > 0"),
        ({"warmup": -1}, "--warmup must be >= 0"),
        ({"max_eval_images": 0}, "--eval-images must be >= 1"),
        ({"threads": 0}, "--threads must be >= 1"),
    ],
)
def test_bad_options_name_the_option_and_a_valid_example(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(BenchError, match=message) as info:
        sweep_settings(**kwargs)  # type: ignore[arg-type]
    assert "e.g." in str(info.value)
    assert info.value.exit_code == 2
