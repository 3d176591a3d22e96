"""Dynamic batching, the bounded queue and request timeouts on a real server: concurrent
requests share batches (seen in the metrics) and each still gets its own answer; a full queue
answers 503 with Retry-After; a request past its timeout answers 504; the server goes on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import numpy as np

from _servekit import NAME, ServeKit, infer_body, metric, ort_logits, serve_kit

__all__ = ["serve_kit"]


async def _post_all(url: str, bodies: list[dict[str, object]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(limits=limits, timeout=120) as c:
        return await asyncio.gather(*(c.post(url, json=b) for b in bodies))


def test_concurrent_requests_form_batches_and_get_their_own_answers(
    serve_kit: ServeKit, tmp_path: Path
) -> None:
    x = serve_kit.batch(64, seed=4)
    with serve_kit.server(serve_kit.source(), tmp_path, max_batch_size=8, max_queue_delay_ms=20.0) as s:
        rs = asyncio.run(
            _post_all(f"{s.url}/v2/models/{NAME}/infer", [infer_body(x[i : i + 1]) for i in range(64)])
        )
        text = httpx.get(f"{s.url}/metrics").text
    assert [r.status_code for r in rs] == [200] * 64
    got = np.stack([np.array(r.json()["outputs"][0]["data"], dtype=np.float32) for r in rs])
    np.testing.assert_allclose(got, ort_logits(serve_kit.v1, x), rtol=1e-5, atol=1e-5)
    lab = {"model": NAME, "version": "1"}
    rows = metric(text, "visionloop_serve_batch_size_sum", **lab)
    batches = metric(text, "visionloop_serve_batch_size_count", **lab)
    assert rows == 64  # every request's row ran exactly once (the warm-up runs outside the batcher)
    assert batches < 64, f"{batches} batches for 64 concurrent requests: no batching happened"
    # No batch is larger than max_batch_size: the le=8 bucket holds every batch.
    assert metric(text, "visionloop_serve_batch_size_bucket", **lab, le="8.0") == batches


def test_full_queue_answers_503_with_retry_after_and_server_recovers(
    serve_kit: ServeKit, tmp_path: Path
) -> None:
    x = serve_kit.batch(24, seed=5)
    with serve_kit.server(
        serve_kit.slow_source(),
        tmp_path,
        model="slow",
        max_batch_size=1,
        max_queue_delay_ms=0.0,
        queue_capacity=2,
        intra_op_threads=1,
        request_timeout_ms=120_000,
    ) as s:
        url = f"{s.url}/v2/models/slow/infer"
        rs = asyncio.run(_post_all(url, [infer_body(x[i : i + 1]) for i in range(24)]))
        codes = [r.status_code for r in rs]
        full = [r for r in rs if r.status_code == 503]
        assert set(codes) == {200, 503}, codes
        for r in full:
            assert r.headers["Retry-After"].isdigit() and int(r.headers["Retry-After"]) >= 1
            assert "queue of slow/1 is full" in r.json()["error"]
        ref = ort_logits(serve_kit.slow, x)
        for i, r in enumerate(rs):
            if r.status_code == 200:
                np.testing.assert_allclose(r.json()["outputs"][0]["data"], ref[i], rtol=1e-4, atol=1e-5)
        # Afterwards the server answers again, and the refusals are counted.
        again = httpx.post(url, json=infer_body(x[:1]), timeout=60)
        assert again.status_code == 200
        text = httpx.get(f"{s.url}/metrics").text
        assert metric(text, "visionloop_serve_rejected_total", model="slow", reason="queue_full") == len(full)
        assert metric(text, "visionloop_serve_errors_total", model="slow", code="503") == len(full)


def test_request_timeout_answers_504_and_server_goes_on(serve_kit: ServeKit, tmp_path: Path) -> None:
    x = serve_kit.batch(4, seed=6)
    # One slow-model inference is ~1.7 GFLOP: far longer than a 2 ms timeout on any CPU.
    with serve_kit.server(
        serve_kit.slow_source(),
        tmp_path,
        model="slow",
        max_batch_size=1,
        intra_op_threads=1,
        request_timeout_ms=2,
    ) as s:
        rs = asyncio.run(
            _post_all(f"{s.url}/v2/models/slow/infer", [infer_body(x[i : i + 1]) for i in range(4)])
        )
        assert [r.status_code for r in rs] == [504] * 4
        assert all("timed out after 2 ms" in r.json()["error"] for r in rs)
        assert httpx.get(f"{s.url}/v2/health/ready").status_code == 200
        text = httpx.get(f"{s.url}/metrics").text
        assert metric(text, "visionloop_serve_rejected_total", model="slow", reason="timeout") == 4
