"""Routing by alias on a real server: a canary takes its share of bare-name traffic; a shadow
sees a copy but never changes an answer (its agreement is counted); promotion and rollback
under concurrent load fail no request. Every answer is checked against the ONNX file of the
version that says it answered."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import numpy as np

from _servekit import NAME, ServeKit, infer_body, metric, ort_logits, serve_kit

__all__ = ["serve_kit"]


def _logits(r: httpx.Response) -> np.ndarray:
    return np.array(r.json()["outputs"][0]["data"], dtype=np.float32)


def test_canary_takes_its_share_within_a_binomial_bound(serve_kit: ServeKit, tmp_path: Path) -> None:
    n, p = 400, 0.2
    x = serve_kit.batch(40, seed=7)
    refs = {1: ort_logits(serve_kit.v1, x), 2: ort_logits(serve_kit.v2, x)}
    src = serve_kit.source(champion=1, challenger=2)
    with serve_kit.server(src, tmp_path, canary_percent=100 * p) as s:

        async def run() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                sem = asyncio.Semaphore(16)

                async def one(i: int) -> httpx.Response:
                    async with sem:
                        return await c.post(
                            f"/v2/models/{NAME}/infer", json=infer_body(x[i % 40 : i % 40 + 1])
                        )

                return await asyncio.gather(*(one(i) for i in range(n)))

        rs = asyncio.run(run())
        text = httpx.get(f"{s.url}/metrics").text
    assert all(r.status_code == 200 for r in rs)
    versions = [int(r.json()["model_version"]) for r in rs]
    canary = versions.count(2)
    bound = 4.5 * math.sqrt(n * p * (1 - p))  # 4.5 sigma: a false failure about once in 150,000 runs
    assert abs(canary - n * p) <= bound, (
        f"{canary} of {n} went to the canary, expected {n * p:.0f} ± {bound:.0f}"
    )
    for i, (r, v) in enumerate(zip(rs, versions, strict=True)):
        np.testing.assert_allclose(_logits(r), refs[v][i % 40], rtol=1e-5, atol=1e-5)
    assert metric(text, "visionloop_serve_requests_total", model=NAME, version="2") == canary
    assert metric(text, "visionloop_serve_model_loaded", model=NAME, version="2", role="challenger") == 1


def test_shadow_never_changes_an_answer_and_counts_agreement(serve_kit: ServeKit, tmp_path: Path) -> None:
    n = 48
    x = serve_kit.batch(n, seed=8)
    ref1, ref2 = ort_logits(serve_kit.v1, x), ort_logits(serve_kit.v2, x)
    agree = int((ref1.argmax(1) == ref2.argmax(1)).sum())
    assert 0 < agree < n, "the kit's two versions should disagree on some images"
    with serve_kit.server(serve_kit.source(champion=1, challenger=2), tmp_path, shadow_percent=100) as s:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            rs = [c.post(f"/v2/models/{NAME}/infer", json=infer_body(x[i : i + 1])) for i in range(n)]
            compared = 0.0
            deadline = time.monotonic() + 60
            while compared < n and time.monotonic() < deadline:  # shadow answers arrive after the reply
                text = c.get("/metrics").text
                compared = metric(text, "visionloop_serve_shadow_comparisons_total", model=NAME)
                time.sleep(0.05)
        predlog = s.app.state.server.predlog
        predlog.flush()
        records = [json.loads(line) for line in predlog.path.read_text().splitlines()]
    assert [r.status_code for r in rs] == [200] * n
    assert {r.json()["model_version"] for r in rs} == {"1"}
    np.testing.assert_allclose(np.stack([_logits(r) for r in rs]), ref1, rtol=1e-5, atol=1e-5)
    lab = {"model": NAME, "champion_version": "1", "challenger_version": "2"}
    assert metric(text, "visionloop_serve_shadow_comparisons_total", **lab, agree="true") == agree
    assert metric(text, "visionloop_serve_shadow_comparisons_total", **lab, agree="false") == n - agree
    assert metric(text, "visionloop_serve_requests_total", model=NAME, version="2") == 0
    shadow = [r for r in records if r["role"] == "shadow"]
    assert len(shadow) == n and sum(r["agrees"] for r in shadow) == agree
    assert all(r["version"] == 2 for r in shadow)


def test_promote_and_rollback_under_load_fail_no_request(serve_kit: ServeKit, tmp_path: Path) -> None:
    x = serve_kit.batch(32, seed=9)
    refs = {1: ort_logits(serve_kit.v1, x), 2: ort_logits(serve_kit.v2, x)}
    src = serve_kit.source(champion=1)
    answers: list[tuple[int, int, httpx.Response]] = []  # (phase, input index, response)
    phase = 0

    with serve_kit.server(src, tmp_path, alias_poll_s=0.1, max_queue_delay_ms=2.0) as s:

        async def run() -> None:
            nonlocal phase
            stop = asyncio.Event()
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:

                async def worker(w: int) -> None:
                    i = w
                    while not stop.is_set():
                        r = await c.post(f"/v2/models/{NAME}/infer", json=infer_body(x[i % 32 : i % 32 + 1]))
                        answers.append((phase, i % 32, r))
                        i += 8

                async def until(cond: Callable[[], bool]) -> None:
                    deadline = time.monotonic() + 60
                    while not cond():
                        assert time.monotonic() < deadline, "the server did not follow the alias"
                        await asyncio.sleep(0.02)

                def seen(version: int, in_phase: int) -> Callable[[], bool]:
                    return lambda: (
                        sum(
                            1
                            for p, _, r in answers
                            if p == in_phase and r.json().get("model_version") == str(version)
                        )
                        >= 20
                    )

                workers: list[Awaitable[None]] = [worker(w) for w in range(8)]
                tasks = [asyncio.ensure_future(t) for t in workers]
                await until(seen(1, 0))
                phase = 1
                src.set_alias(NAME, "challenger", 2)  # loaded beside v1, takes no traffic (no canary)
                await until(lambda: 2 in s.app.state.server.repo.get(NAME).loaded())
                await until(seen(1, 1))
                phase = 2
                src.set_alias(NAME, "champion", 2)  # promote the challenger
                src.delete_alias(NAME, "challenger")
                await until(seen(2, 2))
                phase = 3
                src.set_alias(NAME, "champion", 1)  # roll back
                await until(seen(1, 3))
                stop.set()
                await asyncio.gather(*tasks)

        asyncio.run(run())
        text = httpx.get(f"{s.url}/metrics").text
        loaded = s.app.state.server.repo.get(NAME).loaded()

    assert [r.status_code for _, _, r in answers if r.status_code != 200] == []
    for _, i, r in answers:
        np.testing.assert_allclose(_logits(r), refs[int(r.json()["model_version"])][i], rtol=1e-5, atol=1e-5)
    by_phase = {p: {r.json()["model_version"] for q, _, r in answers if q == p} for p in range(4)}
    assert by_phase[0] == {"1"} and by_phase[1] == {"1"}
    assert "2" in by_phase[2] and "1" in by_phase[3]
    assert list(loaded) == [1]
    assert metric(text, "visionloop_serve_alias_switches_total", model=NAME, role="primary") == 2
    assert metric(text, "visionloop_serve_model_loaded", model=NAME, version="2") == 0
    assert metric(text, "visionloop_serve_model_loaded", model=NAME, version="1", role="primary") == 1
