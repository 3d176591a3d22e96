"""Reading the inference server's metrics the way `alerts check` does, on the text a real
ServeMetrics renders: the names it parses are the server's, counters per model, server errors
apart from client errors, a restart, and the p99 as Prometheus' histogram_quantile has it."""

from __future__ import annotations

import math

import pytest

from visionloop.alerts.prometheus import ESTIMATED_ACCURACY
from visionloop.alerts.scrape import ModelCounters, Reading, parse, quantile, traffic
from visionloop.serve.metrics import ServeMetrics


def _render(m: ServeMetrics) -> str:
    return m.render().decode()


def test_the_names_parsed_are_the_ones_the_server_and_the_monitor_export() -> None:
    m = ServeMetrics()
    m.requests.labels("digits", "1", "infer").inc(3)
    m.requests.labels("digits", "2", "classify").inc(2)  # versions and endpoints add up
    m.errors.labels("digits", "503").inc(1)
    m.errors.labels("digits", "400").inc(4)
    m.errors.labels("_unknown", "404").inc(1)
    for s in (0.003, 0.02, 0.02, 0.7):
        m.latency.labels("digits", "1").observe(s)
    m.latency.labels("digits", "2").observe(0.02)
    r = parse("http://s", _render(m), at=10.0)
    d = r.models["digits"]
    assert (d.requests, d.errors, d.server_errors) == (5.0, 5.0, 1.0)
    assert d.buckets[0.005] == 1.0 and d.buckets[0.025] == 4.0 and d.buckets[1.0] == 5.0
    assert d.buckets[math.inf] == 5.0
    assert r.models["_unknown"].errors == 1.0 and r.models["_unknown"].server_errors == 0.0

    from visionloop.monitor.service import Gauges

    gauges = Gauges()
    gauges.accuracy.labels("digits", "1").set(0.9)
    from prometheus_client import generate_latest

    assert (
        f'{ESTIMATED_ACCURACY}{{model="digits",version="1"}} 0.9' in generate_latest(gauges.registry).decode()
    )


def test_traffic_between_readings_and_after_a_restart() -> None:
    inf = math.inf
    before = Reading("u", 0.0, {"m": ModelCounters(100, 10, 4, {0.1: 90, inf: 100})})
    after = Reading("u", 60.0, {"m": ModelCounters(150, 20, 9, {0.1: 120, inf: 150})})
    (t,) = traffic(before, after)
    assert (t.seconds, t.requests, t.server_errors) == (60.0, 60.0, 5.0)
    assert t.error_ratio == pytest.approx(5 / 60)
    # 50 new latencies, 30 under 0.1 s: rank 49.5 lies in (0.1, +Inf): the largest finite bound.
    assert t.p99_s == 0.1
    restarted = Reading("u", 120.0, {"m": ModelCounters(8, 2, 2, {0.1: 8, inf: 8})})
    (t,) = traffic(after, restarted)
    assert (t.requests, t.server_errors) == (10.0, 2.0) and t.p99_s == pytest.approx(0.1 * 7.92 / 8)


def test_quantile_interpolates_inside_the_bucket_like_histogram_quantile() -> None:
    inf = math.inf
    # 100 observations: 50 in (0, 0.01], 40 in (0.01, 0.05], 10 in (0.05, 0.1].
    b = {0.01: 50.0, 0.05: 90.0, 0.1: 100.0, inf: 100.0}
    assert quantile(0.5, b) == pytest.approx(0.01)
    assert quantile(0.7, b) == pytest.approx(0.01 + 0.04 * 20 / 40)
    assert quantile(0.99, b) == pytest.approx(0.05 + 0.05 * 9 / 10)
    assert quantile(0.99, {0.1: 0.0, inf: 0.0}) is None
    assert quantile(0.99, {0.1: 5.0}) is None  # no +Inf bucket: not a histogram
