"""The system-metrics sampler on this machine's real CPU, memory and (if any) GPUs."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from visionloop.track.nvml import Nvml
from visionloop.track.system import SystemSampler

Sample = tuple[dict[str, float], int]


def test_tick_logs_only_when_the_step_advanced() -> None:
    logged: list[Sample] = []
    step = 0
    sampler = SystemSampler(lambda m, s: logged.append((m, s)), lambda: step, every_s=60)
    try:
        assert sampler.tick()  # step 0
        assert not sampler.tick()  # still 0: nothing new to put on the axis
        step = 7
        assert sampler.tick()
        step = 3  # a step going backwards is never logged twice
        assert not sampler.tick()
    finally:
        sampler.stop()
    assert [s for _m, s in logged] == [0, 7]
    metrics = logged[-1][0]
    assert metrics["system/process_rss_mib"] > 1.0
    assert 0.0 < metrics["system/memory_used_percent"] <= 100.0
    assert 0.0 <= metrics["system/cpu_percent"] <= 100.0
    assert metrics["system/process_cpu_percent"] >= 0.0


def test_process_cpu_includes_busy_children() -> None:
    logged: list[Sample] = []
    step = 0
    sampler = SystemSampler(lambda m, s: logged.append((m, s)), lambda: step, every_s=60)
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<5: pass"])
    try:
        sampler.tick()  # first sight of the child primes its counter
        time.sleep(0.6)
        step = 1
        sampler.tick()
    finally:
        busy.kill()
        busy.wait()
        sampler.stop()
    # The child spins a whole core; even on a loaded 2-core machine it gets a good share.
    assert logged[-1][0]["system/process_cpu_percent"] >= 10.0


def test_gpu_metrics_match_what_nvml_sees() -> None:
    logged: list[Sample] = []
    sampler = SystemSampler(lambda m, s: logged.append((m, s)), lambda: 1, every_s=60)
    try:
        sampler.tick()
    finally:
        sampler.stop()
    gpu_keys = {k for k in logged[0][0] if k.startswith("system/gpu")}
    with Nvml() as nv:
        n = len(nv.gpus)
    if n == 0:
        assert gpu_keys == set()  # no GPU / no NVML: skipped, not an error
    else:
        for i in range(n):
            assert f"system/gpu{i}/memory_used_mib" in gpu_keys


@pytest.mark.gpu
def test_gpu_memory_is_reported_on_a_gpu_machine() -> None:
    import torch

    x = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")  # 256 MiB held
    logged: list[Sample] = []
    sampler = SystemSampler(lambda m, s: logged.append((m, s)), lambda: 1, every_s=60)
    try:
        sampler.tick()
    finally:
        sampler.stop()
    del x
    m = logged[0][0]
    assert m["system/gpu0/memory_used_mib"] >= 256
    assert 0 < m["system/gpu0/memory_used_percent"] <= 100
    assert 0 <= m["system/gpu0/utilization_percent"] <= 100


def test_thread_samples_at_increasing_steps_and_survives_a_failing_step_fn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logged: list[Sample] = []
    calls = 0

    def step_fn() -> int:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("trainer not ready")
        return calls

    sampler = SystemSampler(lambda m, s: logged.append((m, s)), step_fn, every_s=0.02)
    sampler.start()
    deadline = time.monotonic() + 10
    while len(logged) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    sampler.stop()
    steps = [s for _m, s in logged]
    assert len(steps) >= 4
    assert steps == sorted(set(steps))  # strictly increasing: each step once
    assert "system metrics sample failed" in caplog.text
