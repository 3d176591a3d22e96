"""Nothing a route does holds the inference server's event loop: for each piece of work that
grows with what the server holds or is sent (the metrics text of every series, a reload of
the API keys file, joining the requests of a batch), a real server on loopback is made to
do it slowly, and a health check sent meanwhile must come back before that work ends.

Each test's slow step sets an event when it starts and records when it ends; the health check
is sent once the event is set, so "answered before the slow step ended" is measured against
the slow step itself, never against a wall-clock threshold.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

import visionloop.serve.batcher as batcher_module
import visionloop.serve.keys as keys_module
from _servekit import NAME, ServeKit, infer_body, serve_kit
from _slowkit import SlowStep
from visionloop.serve.config import ServeConfig
from visionloop.serve.keys import KeyRing, KeyStore
from visionloop.serve.server import BackgroundServer

__all__ = ["serve_kit"]


def _health_during(step: SlowStep, url: str) -> bool:
    """Send a health check once `step` has started; whether it came back before the step ended."""
    assert step.started.wait(60), "the slow step never started"
    r = httpx.get(f"{url}/v2/health/live", timeout=60)
    answered_first = not step.ended.is_set()
    assert r.status_code == 200, r.text
    return answered_first


def test_metrics_render_off_the_event_loop(serve_kit: ServeKit, tmp_path: Path) -> None:
    with serve_kit.server(serve_kit.source(), tmp_path) as s:
        metrics = s.app.state.server.metrics
        step = SlowStep(metrics.render)
        metrics.render = step  # the instance's: only this server's /metrics is slow
        answers: dict[str, httpx.Response] = {}
        t = threading.Thread(target=lambda: answers.update(m=httpx.get(f"{s.url}/metrics", timeout=60)))
        t.start()
        answered_first = _health_during(step, s.url)
        t.join(60)
    assert answered_first, "the health check waited for /metrics to render"
    assert answers["m"].status_code == 200
    assert "visionloop_serve_requests" in answers["m"].text


def test_api_keys_reload_off_the_event_loop(
    serve_kit: ServeKit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    main = threading.current_thread()
    home = tmp_path / "home"
    store = KeyStore(home)
    _, first = store.create("first", [NAME])
    ring = KeyRing.for_home(home, poll_s=0.05)
    cfg = ServeConfig(model=NAME, port=0)
    with BackgroundServer(cfg, serve_kit.source(), tmp_path / "p.jsonl", keys=ring) as s:

        def get(key: str) -> httpx.Response:
            return httpx.get(f"{s.url}/v2/models", headers={"Authorization": f"Bearer {key}"}, timeout=60)

        assert get(first).status_code == 200
        # The keys file read as a slow disk (or a network home) reads it.
        # Only the server's reads (the CLI's KeyStore reads the file too, in this thread).
        step = SlowStep(keys_module._read, when=lambda _: threading.current_thread() is not main)
        monkeypatch.setattr(keys_module, "_read", step)
        _, second = store.create("second", [NAME])  # the file changes: the server reloads it
        time.sleep(0.1)  # past poll_s: the next request finds a reload due
        statuses: list[int] = []
        t = threading.Thread(target=lambda: statuses.append(get(first).status_code))
        t.start()
        answered_first = _health_during(step, s.url)
        t.join(60)
        # Once the reload is done, the new key is in.
        deadline = time.monotonic() + 30
        while get(second).status_code != 200:
            assert time.monotonic() < deadline, "the new key was never accepted"
            time.sleep(0.05)
    assert answered_first, "the health check waited for the keys file to be read"
    assert statuses == [200]


def test_a_batch_is_joined_off_the_event_loop(
    serve_kit: ServeKit, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = SlowStep(batcher_module.join_feeds, when=lambda parts: len(parts) > 1)
    monkeypatch.setattr(batcher_module, "join_feeds", step)
    x = serve_kit.batch(2)
    # A long queue delay: the two requests, sent together, make one batch of two.
    with serve_kit.server(
        serve_kit.source(), tmp_path, max_batch_size=8, max_queue_delay_ms=1000, request_timeout_ms=30_000
    ) as s:
        answers: list[httpx.Response] = []

        def infer(row: np.ndarray) -> None:
            body = infer_body(row[None])
            answers.append(httpx.post(f"{s.url}/v2/models/{NAME}/infer", json=body, timeout=60))

        threads = [threading.Thread(target=infer, args=(x[i],)) for i in range(2)]
        for t in threads:
            t.start()
        answered_first = _health_during(step, s.url)
        for t in threads:
            t.join(60)
    assert answered_first, "the health check waited for the batch's inputs to be joined"
    assert [r.status_code for r in answers] == [200, 200], [r.text for r in answers]
