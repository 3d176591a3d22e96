"""Alerts end to end on real parts: a webhook receiver and a /metrics endpoint on loopback
(http.server in a thread) fed by the inference server's real ServeMetrics, a real SQLite job
store with jobs moved through its API, real monitor window logs, a real MLflow store for GPU
utilisation, a checkpoint set aside by the real checkpoint manager, and the CLI as a user runs
it. Every expected number is worked out by hand in the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

import _warmcli
from visionloop.alerts import AlertConfig, CheckResult, alert_log, parse_config, run_check
from visionloop.cli.main import app
from visionloop.core.settings import load_settings
from visionloop.monitor.history import WindowRecord, append_window
from visionloop.sched.states import JobState
from visionloop.sched.store import Job, Store
from visionloop.sched.view import Gpu
from visionloop.serve.metrics import ServeMetrics
from visionloop.specs import JobSpec

H = 3600.0
D = 24 * H
T0 = 1_790_000_000.0  # a fixed "now" for the tests whose stores take any clock


# ----------------------------------------------------------------------------- loopback


@dataclass
class Loopback:
    """A webhook receiver (POST: records the JSON) and a /metrics endpoint (GET: renders a
    real ServeMetrics). `mode` decides the webhook's answer: ok, fail (HTTP 500), hang."""

    url: str = ""
    mode: str = "ok"
    metrics_status: int = 200
    posts: list[dict[str, Any]] = field(default_factory=list)  # every POST received
    accepted: list[dict[str, Any]] = field(default_factory=list)  # those answered 200
    metrics: ServeMetrics = field(default_factory=ServeMetrics)
    release: threading.Event = field(default_factory=threading.Event)

    def alerts(self) -> list[tuple[str, str, str]]:
        """(status, key, id) of every alert in the accepted messages, in order."""
        out = []
        for p in self.accepted:
            for a in p["attachments"]:
                status = "resolved" if a["title"].startswith("Resolved") else "firing"
                footer = a["footer"]  # "visionloop alert <id> (<key>)"
                alert_id, key = footer.split()[2], footer.split("(", 1)[1].rstrip(")")
                out.append((status, key, alert_id))
        return out


@pytest.fixture
def loop() -> Iterator[Loopback]:
    state = Loopback()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            body = state.metrics.render() if self.path == "/metrics" else b""
            self.send_response(state.metrics_status if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state.posts.append(doc)
            if state.mode == "hang":
                state.release.wait(10)
                return
            code = 500 if state.mode == "fail" else 200
            if code == 200:
                state.accepted.append(doc)
            body = b"ok" if code == 200 else b"internal error"
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield state
    state.release.set()
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def _no_outside_webhook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VISIONLOOP_ALERTS_WEBHOOK", raising=False)
    monkeypatch.delenv("VISIONLOOP_ALERTS_SERVE_KEY", raising=False)
    monkeypatch.delenv("VISIONLOOP_DB_URL", raising=False)


def config(loop: Loopback | None = None, **doc: Any) -> AlertConfig:
    if loop is not None:
        doc.setdefault("delivery", {}).update(
            {"webhook_url": f"{loop.url}/hook", "timeout_s": 0.3, "retries": 1, "backoff_s": 0.05}
        )
    return parse_config(doc, "test config")


def check(cfg: AlertConfig, now: float = T0) -> CheckResult:
    return run_check(cfg, load_settings(), now=now)


def fired(result: CheckResult) -> dict[str, float | None]:
    return {n.key: n.value for n in result.changes if n.status == "firing"}


def resolved(result: CheckResult) -> list[str]:
    return sorted(n.key for n in result.changes if n.status == "resolved")


# ----------------------------------------------------------------------------- monitor windows


def window(
    model: str, i: int, drift: bool, acc: float | None = 0.9, version: int = 1, status: str = "ok"
) -> None:
    append_window(
        load_settings().home,
        WindowRecord(
            model=model,
            version=version,
            start=T0 - 10 * H + i * H,
            end=T0 - 10 * H + i * H + H - 1,
            requests=500,
            tested=250 if status == "ok" else 3,
            status=status,
            drift=drift,
            p_value=1e-5 if drift else 0.4,
            alpha=0.05,
            flagged=("ks_bbsd",) if drift else (),
            moved=("ks_bbsd: p(7)",) if drift else (),
            estimated_accuracy=acc,
        ),
    )


def test_drift_fires_on_three_judged_windows_in_a_row_and_resolves_on_a_clean_one(loop: Loopback) -> None:
    cfg = config(loop)
    for i, d in enumerate([False, True, True]):
        window("digits", i, d)
    # A run of three across versions is not a run: v2 is new, its predecessor's drift says nothing.
    window("pets", 0, True, version=1)
    window("pets", 1, True, version=1)
    window("pets", 2, True, version=2)
    r = check(cfg)
    assert fired(r) == {} and loop.posts == []
    # A window too small to judge neither breaks nor extends the run; the next drifted one does.
    window("digits", 3, False, status="too_few_samples")
    assert fired(check(cfg, T0 + 60)) == {}
    window("digits", 4, True)
    r = check(cfg, T0 + 120)
    assert fired(r) == {"drift:digits": 3.0}
    (alert,) = r.open
    assert (
        alert.subject == "model digits v1"
        and "last 3 windows" in alert.summary
        and "ks_bbsd: p(7)" in alert.summary
    )
    assert [a[:2] for a in loop.alerts()] == [("firing", "drift:digits")]
    # Still drifting: nothing new is delivered (deduplicated).
    window("digits", 5, True)
    r = check(cfg, T0 + 180)
    assert r.changes == () and len(r.open) == 1 and len(loop.posts) == 1
    window("digits", 6, False)
    r = check(cfg, T0 + 240)
    assert resolved(r) == ["drift:digits"] and r.open == ()
    statuses = loop.alerts()
    assert [s[:2] for s in statuses] == [("firing", "drift:digits"), ("resolved", "drift:digits")]
    assert statuses[0][2] == statuses[1][2]  # the resolution carries the firing's id
    assert "[RESOLVED] drift: model digits v1" in loop.accepted[1]["text"]


def test_a_rule_with_a_longer_run_configured_waits_for_it() -> None:
    for i in range(3):
        window("digits", i, True)
    assert fired(check(config(rules={"drift": {"windows": 4}}))) == {}
    assert fired(check(config(rules={"drift": {"windows": 3}}), T0 + 1)) == {"drift:digits": 3.0}


def test_estimated_accuracy_under_the_floor_fires_per_model_floors_apply() -> None:
    window("digits", 0, False, acc=0.75)  # under the default floor 0.8
    window("pets", 0, False, acc=0.85)  # under its own floor 0.9
    window("cats", 0, False, acc=0.85)  # over the default floor
    window("dogs", 0, False, acc=None)  # no estimate: nothing to judge
    cfg = config(rules={"accuracy": {"models": {"pets": 0.9}}})
    r = check(cfg)
    assert fired(r) == {"accuracy:digits": 0.75, "accuracy:pets": 0.85}
    thresholds = {a.key: a.threshold for a in r.open}
    assert thresholds == {"accuracy:digits": 0.8, "accuracy:pets": 0.9}
    window("digits", 1, False, acc=0.82)
    r = check(cfg, T0 + 60)
    assert resolved(r) == ["accuracy:digits"] and [a.key for a in r.open] == ["accuracy:pets"]
    # Disabling the rule resolves what it left open.
    r = check(config(rules={"accuracy": {"enabled": False}}), T0 + 120)
    assert resolved(r) == ["accuracy:pets"] and r.open == ()
    assert r.changes[0].summary.startswith("rule disabled")


# ----------------------------------------------------------------------------- the server's metrics


def _traffic(m: ServeMetrics, ok: int, seconds: float, **errors: int) -> None:
    for _ in range(ok):
        m.requests.labels("digits", "1", "infer").inc()
        m.latency.labels("digits", "1").observe(seconds)
    for code, n in errors.items():
        m.errors.labels("digits", code.removeprefix("e")).inc(n)


def test_error_rate_and_p99_latency_between_two_scrapes_of_the_real_metrics(loop: Loopback) -> None:
    cfg = config(loop, sources={"serve_urls": [loop.url]})
    m = loop.metrics
    _traffic(m, 50, 0.01)
    r = check(cfg)
    assert r.changes == () and r.problems == ()  # the first reading is the baseline
    # 200 answered at 20 ms, 1 server error: 1/201 = 0.5% <= 1%; p99 within the 25 ms bucket.
    _traffic(m, 200, 0.02, e500=1)
    r = check(cfg, T0 + 60)
    assert r.changes == () and r.problems == ()
    # 100 answered (95 at 20 ms, 5 at 300 ms), 10 server errors and 30 client errors (400s are
    # the caller's fault: they count as answered, not as server errors): 10 / 140 = 7.14%.
    # p99: rank 0.99 x 100 = 99 falls in (0.25, 0.5] holding 5: 0.25 + 0.25 x (99 - 95) / 5 = 0.45 s.
    _traffic(m, 95, 0.02, e500=4, e503=6, e400=30)
    _traffic(m, 5, 0.3)
    r = check(cfg, T0 + 120)
    got = fired(r)
    key_e, key_l = f"error_rate:{loop.url}:digits", f"latency_p99:{loop.url}:digits"
    assert set(got) == {key_e, key_l}
    assert got[key_e] == pytest.approx(100 * 10 / 140)
    assert got[key_l] == pytest.approx(450.0)
    summaries = {a.key: a.summary for a in r.open}
    assert "10 of 140 requests in 60 s" in summaries[key_e]
    assert "p99 latency 450.0 ms > budget 100 ms" in summaries[key_l]
    # The server stops answering /metrics: unknown, not cleared; the check says why.
    loop.metrics_status = 503
    r = check(cfg, T0 + 180)
    assert r.changes == () and len(r.open) == 2
    assert any("answered HTTP 503" in p for p in r.problems)
    # Back, healthy: 100 at 10 ms and no errors since the last good reading: both resolve.
    loop.metrics_status = 200
    _traffic(m, 100, 0.01)
    r = check(cfg, T0 + 240)
    assert resolved(r) == sorted([key_e, key_l]) and r.open == ()
    assert [a[:2] for a in loop.alerts()] == [
        ("firing", key_e),
        ("firing", key_l),
        ("resolved", key_e),
        ("resolved", key_l),
    ]


def test_a_tight_budget_or_a_lower_error_ceiling_fires_on_the_same_traffic(loop: Loopback) -> None:
    cfg = config(
        sources={"serve_urls": [loop.url]},
        rules={"latency_p99": {"budget_ms": 15}, "error_rate": {"max_percent": 0.4, "min_requests": 10}},
    )
    check(cfg)
    # All 200 latencies in (0.01, 0.025]: rank 0.99 x 200 = 198 -> 0.01 + 0.015 x 198 / 200 = 24.85 ms.
    _traffic(loop.metrics, 200, 0.02, e500=1)
    got = fired(check(cfg, T0 + 60))
    assert got[f"latency_p99:{loop.url}:digits"] == pytest.approx(24.85)
    assert got[f"error_rate:{loop.url}:digits"] == pytest.approx(100 / 201)


# ----------------------------------------------------------------------------- the job store


@pytest.fixture
def store() -> Iterator[Store]:
    """The job store where `alerts check` looks by default: the home's state.db."""
    settings = load_settings()
    settings.ensure()
    with Store.open(f"sqlite:///{settings.home / 'state.db'}", runs_dir=settings.runs_dir) as s:
        s.upsert_team("vision", 4, 0, now=T0 - 30 * D)
        yield s


def submit(store: Store, now: float, *, gpus: int = 0, priority: str = "normal", rank: int = 50) -> Job:
    doc = {
        "name": f"{priority}-{gpus}",
        "priority": priority,
        "resources": {"gpus": gpus},
        "train": {"epochs": 1, "model": {"arch": "resnet18"}, "data": {"dataset": "/data/digits"}},
    }
    return store.submit(
        doc,
        JobSpec.model_validate(doc),
        team="vision",
        priority_rank=rank,
        run_dir=None,
        idempotency_key=None,
        now=now,
    )


def finish(
    store: Store,
    job: Job,
    start: float,
    end: float | None,
    outcome: str = "succeeded",
    gpus: list[Gpu] | None = None,
) -> None:
    att = store.start_attempt(job.id, "local", gpus or [], now=start)
    if end is not None:
        state = JobState.SUCCEEDED if outcome == "succeeded" else JobState.FAILED
        store.end_attempt(
            job.id, att.number, outcome, 0 if outcome == "succeeded" else 1, end, state, f"test: {outcome}"
        )


def test_queue_wait_by_priority_class_and_resolution_when_the_job_starts(store: Store) -> None:
    a = submit(store, T0 - 3 * H)  # normal, 180 min > 120
    submit(store, T0 - 1 * H)  # normal, 60 min: fine
    c = submit(store, T0 - 10 * 60, priority="high", rank=100)  # high, 10 min > 5
    submit(store, T0 - 3 * 60, priority="high", rank=100)  # high, 3 min: fine
    r = check(config())
    assert fired(r) == {
        f"queue_wait:job-{a.id}": pytest.approx(180.0),
        f"queue_wait:job-{c.id}": pytest.approx(10.0),
    }
    limits = {x.key: x.threshold for x in r.open}
    assert limits == {f"queue_wait:job-{a.id}": 120.0, f"queue_wait:job-{c.id}": 5.0}
    assert r.webhook is False and r.pending == 0  # no webhook: the log is the record
    store.start_attempt(a.id, "local", [], now=T0 + 10)
    r = check(config(), T0 + 60)
    assert resolved(r) == [f"queue_wait:job-{a.id}"] and [x.key for x in r.open] == [f"queue_wait:job-{c.id}"]
    # A longer limit for high priority clears the other one.
    r = check(config(rules={"queue_wait": {"high_priority_minutes": 30}}), T0 + 120)
    assert resolved(r) == [f"queue_wait:job-{c.id}"]
    events = [(e["event"], e["key"]) for e in alert_log(load_settings().home).read()]
    assert events == [
        ("firing", f"queue_wait:job-{a.id}"),
        ("firing", f"queue_wait:job-{c.id}"),
        ("resolved", f"queue_wait:job-{a.id}"),
        ("resolved", f"queue_wait:job-{c.id}"),
    ]


def test_job_failure_rate_over_the_last_day(store: Store) -> None:
    # Two days ago, 5 failures: outside the window, they must not count (else 6/25 = 24%).
    for _ in range(5):
        finish(store, submit(store, T0 - 3 * D), T0 - 2.5 * D, T0 - 2 * D, "failed")
    for i in range(19):
        finish(store, submit(store, T0 - 5 * H), T0 - 4 * H, T0 - 3 * H + i)
    failed = submit(store, T0 - 5 * H)
    finish(store, failed, T0 - 4 * H, T0 - 2 * H, "failed")
    assert fired(check(config())) == {}  # 1 / 20 = 5.0%: not above 5%
    second = submit(store, T0 - H)
    finish(store, second, T0 - H, T0 - 60, "failed")
    r = check(config(), T0 + 1)
    assert fired(r) == {"job_failure_rate": pytest.approx(100 * 2 / 21)}
    assert f"2 of 21: job {failed.id}, {second.id}" in r.open[0].summary
    # A day later the window holds none of them: resolved.
    assert resolved(check(config(), T0 + 1.5 * D)) == ["job_failure_rate"]


def test_daily_cost_over_twice_the_trailing_seven_day_median(store: Store) -> None:
    home = load_settings().home
    (home / "prices.toml").write_text('[gpus."T"]\nowned = 1.0\non_demand = 3.0\nspot = 2.0\n')
    (home / "cluster.toml").write_text('prices = "prices.toml"\n')
    gpu = [Gpu("own/0", "own", "T", "owned")]
    # Trailing days k = 2..7 (k days before now, 24 h each): 1 GPU-hour each.
    for k in range(2, 8):
        lo = T0 - (k + 1) * D
        finish(store, submit(store, lo, gpus=1), lo + 2 * H, lo + 3 * H, gpus=gpu)
    # Day 1: half an hour inside, and half of an hour that straddles into the last day.
    finish(store, submit(store, T0 - 2 * D, gpus=1), T0 - 2 * D + H, T0 - 2 * D + 1.5 * H, gpus=gpu)
    finish(store, submit(store, T0 - 2 * D, gpus=1), T0 - D - 0.5 * H, T0 - D + 0.5 * H, gpus=gpu)
    # Median 1.0 USD; the last day holds 0.5 USD: quiet.
    assert fired(check(config())) == {}
    job = submit(store, T0 - 3 * H, gpus=1)
    att = store.start_attempt(job.id, "local", gpu, now=T0 - 2 * H)  # still running: 2 h so far
    r = check(config())
    assert fired(r) == {"daily_cost": pytest.approx(2.5)}
    assert r.open[0].threshold == pytest.approx(2.0)
    assert "2.50 USD > 2 x the 7-day median 1.00 USD" in r.open[0].summary
    # A factor of 3 does not fire on the same ledger (2.5 <= 3.0): the threshold is the config's.
    r = check(config(rules={"daily_cost": {"factor": 3.0}}), T0 + 1)
    assert resolved(r) == ["daily_cost"]
    # Ended after half an hour instead: 1.0 USD.
    store.end_attempt(job.id, att.number, "succeeded", 0, T0 - 1.5 * H, JobState.SUCCEEDED, "done")
    assert fired(check(config(), T0 + 2)) == {}


def test_gpu_utilisation_from_the_trainers_system_metrics_in_mlflow(
    store: Store, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from mlflow.entities import Metric

    from _mlflowkit import copy_migrated_store
    from visionloop.track import store as track_store
    from visionloop.train.rundir import RunDir

    settings = load_settings()
    copy_migrated_store(tmp_path_factory, settings.home)
    client = track_store.client(settings)
    experiment = client.create_experiment("alerts")
    now = time.time()
    gpus = iter(Gpu(f"local/{i}", "local", "fake", "owned") for i in range(8))

    def job(started_min_ago: float, samples: dict[int, list[float]], ages_s: list[float]) -> Job:
        j = submit(store, now - 2 * H, gpus=2)
        store.start_attempt(j.id, "local", [next(gpus), next(gpus)], now=now - 60 * started_min_ago)
        run = client.create_run(experiment)
        metrics = [
            Metric(f"system/gpu{g}/utilization_percent", v, int(1000 * (now - age)), step)
            for g, values in samples.items()
            for step, (v, age) in enumerate(zip(values, ages_s, strict=True))
        ]
        client.log_batch(run.info.run_id, metrics=metrics)
        RunDir(j.run_dir).update_meta(mlflow_run_id=run.info.run_id)
        return j

    ages = [25 * 60.0, 15 * 60.0, 5 * 60.0]  # readings within the last 30 minutes
    idle = job(40, {0: [20, 30, 10], 1: [30, 20, 40]}, ages)  # mean 25% < 50%
    job(40, {0: [80, 90, 70], 1: [85, 75, 80]}, ages)  # busy: 80%
    job(10, {0: [5, 5, 5], 1: [5, 5, 5]}, ages)  # idle, but started 10 min ago: warming up
    job(40, {0: [5, 5, 5], 1: [5, 5, 5]}, [3 * H, 2.5 * H, 2 * H])  # no reading in the window: unknown
    r = check(config(), now)
    assert fired(r) == {f"gpu_utilisation:job-{idle.id}": pytest.approx(25.0)}
    assert (
        "GPU utilisation 25% < 50% averaged over the last 30 min on 2 GPU(s) (6 readings)"
        in r.open[0].summary
    )
    # Once the job ends it is not running any more: resolved.
    store.end_attempt(idle.id, 1, "succeeded", 0, now + 1, JobState.SUCCEEDED, "done")
    assert resolved(check(config(), now + 2)) == [f"gpu_utilisation:job-{idle.id}"]


def test_a_checkpoint_the_real_manager_set_aside_fires_until_the_file_is_removed(store: Store) -> None:
    from visionloop.core.errors import CheckpointError
    from visionloop.train.checkpoint import CheckpointManager

    broken = submit(store, T0 - H)
    fine = submit(store, T0 - H)
    old = submit(store, T0 - 4 * D)
    finish(store, old, T0 - 4 * D, T0 - 3 * D)  # finished 3 days ago: not scanned
    for j in (broken, old):
        folder = j.run_dir / "checkpoints"
        folder.mkdir(parents=True)
        (folder / "step-000000010.ckpt").write_bytes(b"not a checkpoint: cut short by a full disk")
        manager = CheckpointManager(folder, keep_last=2, keep_best=0)
        with pytest.raises(CheckpointError, match="no valid checkpoint"):
            manager.load_latest()  # what a resuming trainer does: it sets the file aside
        manager.close()
    (fine.run_dir / "checkpoints").mkdir(parents=True)
    r = check(config())
    key = f"checkpoint_restore:job-{broken.id}:step-000000010.ckpt.corrupt"
    assert list(fired(r)) == [key]
    assert r.open[0].severity == "critical" and "step-000000010.ckpt failed verification" in r.open[0].summary
    assert fired(check(config(), T0 + 60)) == {}  # deduplicated
    (broken.run_dir / "checkpoints" / "step-000000010.ckpt.corrupt").unlink()
    assert resolved(check(config(), T0 + 120)) == [key]


# ----------------------------------------------------------------------------- delivery


def test_a_failing_receiver_loses_nothing_and_gets_the_alert_on_the_next_check(loop: Loopback) -> None:
    window("digits", 0, False, acc=0.5)
    loop.mode = "fail"
    r = check(config(loop))
    assert list(fired(r)) == ["accuracy:digits"] and r.delivered == 0 and r.pending == 1
    assert len(loop.posts) == 2  # one try and one retry
    assert any("HTTP 500" in p for p in r.problems)
    log = list(alert_log(load_settings().home).read())
    assert [e["event"] for e in log] == ["firing", "delivery_failed"]
    assert log[1]["pending"] == [log[0]["id"]] and "HTTP 500" in log[1]["error"]
    loop.mode = "ok"
    r = check(config(loop), T0 + 60)
    assert r.changes == () and r.delivered == 1 and r.pending == 0
    assert loop.alerts() == [("firing", "accuracy:digits", log[0]["id"])]
    r = check(config(loop), T0 + 120)
    assert r.delivered == 0 and len(loop.accepted) == 1


def test_a_receiver_that_hangs_does_not_hang_the_check(loop: Loopback) -> None:
    window("digits", 0, False, acc=0.5)
    loop.mode = "hang"
    started = time.monotonic()
    r = check(config(loop))  # timeout 0.3 s, 1 retry after 0.05 s
    took = time.monotonic() - started
    assert took < 3.0, took
    assert r.pending == 1 and r.delivered == 0 and len(loop.posts) == 2
    assert any("ReadTimeout" in p for p in r.problems)
    loop.mode = "ok"
    r = check(config(loop), T0 + 60)
    assert r.delivered == 1 and [a[:2] for a in loop.alerts()] == [("firing", "accuracy:digits")]


def test_state_survives_a_restart_nothing_is_delivered_twice(loop: Loopback, tmp_path: Path) -> None:
    """Each check runs in a process of its own (`visionloop alerts check`), as cron would."""
    window("digits", 0, False, acc=0.5)
    env = {**os.environ, "VISIONLOOP_ALERTS_WEBHOOK": f"{loop.url}/hook"}

    def cli_check() -> subprocess.CompletedProcess[str]:
        return _warmcli.run(["alerts", "check", "--json"], env=env, timeout=120)

    first = cli_check()
    assert first.returncode == 0, first.stderr
    doc = json.loads(first.stdout)
    assert [c["key"] for c in doc["changes"]] == ["accuracy:digits"] and doc["delivered"] == 1
    again = json.loads(cli_check().stdout)
    assert again["changes"] == [] and again["delivered"] == 0 and len(again["open"]) == 1
    assert len(loop.posts) == 1
    window("digits", 1, False, acc=0.95)
    last = json.loads(cli_check().stdout)
    assert [(c["status"], c["key"]) for c in last["changes"]] == [("resolved", "accuracy:digits")]
    assert [a[2] for a in loop.alerts()] == [doc["changes"][0]["id"]] * 2
    assert "[RESOLVED] accuracy: model digits v1" in loop.accepted[1]["text"]


# ----------------------------------------------------------------------------- the CLI


def test_alerts_list_shows_what_fires_and_the_history() -> None:
    runner = CliRunner()
    empty = runner.invoke(app, ["alerts", "list"])
    assert empty.exit_code == 0 and "no alerts firing" in empty.output
    window("digits", 0, False, acc=0.61)
    window("pets", 0, True)
    window("pets", 1, True)
    window("pets", 2, True)
    check(config())
    shown = runner.invoke(app, ["alerts", "list"])
    assert shown.exit_code == 0, shown.output
    assert "2 alert(s) firing" in shown.output
    assert "estimated accuracy 0.610 < floor 0.800" in shown.output and "model pets v1" in shown.output
    listed = json.loads(runner.invoke(app, ["alerts", "list", "--json"]).output)
    assert sorted((a["key"], a["value"]) for a in listed) == [("accuracy:digits", 0.61), ("drift:pets", 3.0)]
    window("digits", 1, False, acc=0.9)
    check(config(), T0 + 60)
    assert [a["key"] for a in json.loads(runner.invoke(app, ["alerts", "list", "--json"]).output)] == [
        "drift:pets"
    ]
    history = json.loads(runner.invoke(app, ["alerts", "list", "--all", "--json"]).output)
    assert [(e["event"], e["key"]) for e in history] == [
        ("firing", "drift:pets"),
        ("firing", "accuracy:digits"),
        ("resolved", "accuracy:digits"),
    ]
    table = runner.invoke(app, ["alerts", "list", "--all"])
    assert table.exit_code == 0 and table.output.count("resolved") == 1 and table.output.count("firing") == 2


def test_init_writes_the_defaults_and_rules_writes_prometheus_rules(tmp_path: Path) -> None:
    runner = CliRunner()
    path = tmp_path / "alerts.toml"
    made = runner.invoke(app, ["alerts", "init", "--config", str(path)])
    assert made.exit_code == 0, made.output
    assert path.stat().st_mode & 0o777 == 0o600
    from visionloop.alerts import load_config

    loaded = load_config(path, tmp_path)
    assert (loaded.rules, loaded.sources, loaded.delivery) == (
        AlertConfig().rules,
        AlertConfig().sources,
        AlertConfig().delivery,
    )
    again = runner.invoke(app, ["alerts", "init", "--config", str(path)])
    assert again.exit_code != 0 and "--force" in str(again.exception)

    path.write_text(
        '[rules.error_rate]\nmax_percent = 2.5\n[rules.latency_p99]\nbudget_ms = 250\nseverity = "critical"\n'
        "[rules.accuracy]\nfloor = 0.7\nmodels = { pets = 0.9 }\n[rules.drift]\nenabled = false\n"
    )
    out = tmp_path / "visionloop-rules.yml"
    shown = runner.invoke(app, ["alerts", "rules", "--config", str(path), "--prometheus", str(out), "--json"])
    assert shown.exit_code == 0, shown.output
    effective = json.loads(shown.stdout)
    assert effective["error_rate"]["max_percent"] == 2.5 and effective["drift"]["enabled"] is False
    text = out.read_text()
    not_here = [line for line in text.splitlines() if line.startswith("#   ")]
    assert not_here == ["#   gpu_utilisation, queue_wait, job_failure_rate, daily_cost, checkpoint_restore"]
    doc = yaml.safe_load(text)
    by_name = {r["alert"]: r for g in doc["groups"] for r in g["rules"]}
    err_rule = by_name["VisionloopServeErrorRate"]
    assert (
        ") > 0.025\n" in err_rule["expr"]
        and 'visionloop_serve_errors_total{code=~"5.."}[5m]' in err_rule["expr"]
    )
    assert err_rule["expr"].rstrip().endswith(">= 20") and err_rule["labels"] == {
        "severity": "critical",
        "visionloop_rule": "error_rate",
    }
    lat = by_name["VisionloopServeLatencyP99"]
    quantile = (
        "histogram_quantile(0.99, sum by (model, le) (rate(visionloop_serve_request_seconds_bucket[5m])))"
    )
    assert f"{quantile} > 0.25" in lat["expr"]
    assert lat["labels"]["severity"] == "critical" and lat["for"] == "5m"
    accuracy = sorted(
        r["expr"] for g in doc["groups"] for r in g["rules"] if r["alert"] == "VisionloopEstimatedAccuracyLow"
    )
    assert accuracy == [
        'visionloop_estimated_accuracy{model!~"pets"} < 0.7',
        'visionloop_estimated_accuracy{model="pets"} < 0.9',
    ]


def test_a_malformed_config_fails_naming_the_key_as_the_user_sees_it(tmp_path: Path) -> None:
    bad = tmp_path / "alerts.toml"
    bad.write_text("[rules.queue_wait]\nmax_minute = 240\n")
    run = subprocess.run(
        [sys.executable, "-m", "visionloop", "alerts", "check", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 1
    assert "[rules.queue_wait] has no key 'max_minute' (did you mean max_minutes?)" in run.stderr
    assert "Traceback" not in run.stderr


def test_follow_checks_again_and_again_delivering_each_change_once(loop: Loopback) -> None:
    from visionloop.alerts.check import follow
    from visionloop.core.errors import ConfigError

    window("digits", 0, False, acc=0.5)
    results: list[CheckResult] = []
    loads = iter(["ok", "broken", "ok"])

    class StopError(Exception):
        pass

    def load() -> AlertConfig:
        if next(loads) == "broken":  # an edit saved half-way: reported, and the loop goes on
            raise ConfigError("alerts.toml: [rules.drift] has no key 'windws'")
        return config(loop)

    def on_result(r: CheckResult) -> None:
        results.append(r)
        if len(results) == 3:
            raise StopError

    with pytest.raises(StopError):
        follow(load, 0.01, on_result)
    assert [len(r.changes) for r in results] == [1, 0, 0]
    assert results[1].problems == ("check failed: alerts.toml: [rules.drift] has no key 'windws'",)
    assert [a[:2] for a in loop.alerts()] == [("firing", "accuracy:digits")]


def test_every_takes_a_duration_and_says_how_to_write_one() -> None:
    from visionloop.cli.alerts import parse_every

    assert (parse_every("60"), parse_every("30s"), parse_every("5m"), parse_every("1h")) == (
        60,
        30,
        300,
        3600,
    )
    bad = CliRunner().invoke(
        app, ["alerts", "check", "--follow", "--every", "5 minutes"], env={"COLUMNS": "300"}
    )
    assert bad.exit_code == 2 and "write e.g. 60s, 5m or 1h" in bad.output
