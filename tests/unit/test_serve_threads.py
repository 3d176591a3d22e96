"""How the server sizes ONNX Runtime's thread pools on CPU (see BENCHMARKS.md: two sessions
each given every core cost 15-20% of throughput)."""

from __future__ import annotations

import os

from visionloop.serve.config import ServeConfig
from visionloop.serve.repository import cpu_threads_per_batch

CORES = len(os.sched_getaffinity(0))


def test_the_cores_are_shared_out_between_concurrent_batches() -> None:
    assert cpu_threads_per_batch(ServeConfig(model="m", batch_concurrency=1)) == CORES
    threads = cpu_threads_per_batch(ServeConfig(model="m", batch_concurrency=2))
    assert threads == max(1, CORES // 2) and threads * 2 <= max(CORES, 2)
    assert cpu_threads_per_batch(ServeConfig(model="m", batch_concurrency=64)) == 1  # never 0 threads


def test_an_explicit_thread_count_wins() -> None:
    assert cpu_threads_per_batch(ServeConfig(model="m", batch_concurrency=2, intra_op_threads=7)) == 7
