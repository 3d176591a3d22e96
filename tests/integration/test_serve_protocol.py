"""The server's contract on a real uvicorn server on loopback: KServe v2 REST through
tritonclient.http (binary and JSON), raw HTTP, the image endpoint with real PNG and JPEG
files, metrics and the prediction log. Every answer is compared with the same ONNX file run
in-process."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from PIL import Image

from _servekit import NAME, ServeKit, infer_body, metric, ort_logits, serve_kit
from visionloop.serve.server import BackgroundServer

__all__ = ["serve_kit"]


@pytest.fixture(scope="module")
def server(serve_kit: ServeKit, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    tmp = tmp_path_factory.mktemp("serve")
    with serve_kit.server(serve_kit.source(), tmp, max_batch_size=8, max_queue_delay_ms=2.0) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: BackgroundServer) -> Iterator[triton.InferenceServerClient]:
    c = triton.InferenceServerClient(server.url.removeprefix("http://"))
    yield c
    c.close()


def test_health_and_metadata(server: BackgroundServer, client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(NAME)
    assert client.is_model_ready(NAME, "1")
    assert not client.is_model_ready("nope")
    assert client.get_server_metadata()["extensions"] == ["binary_tensor_data", "classification"]
    meta = client.get_model_metadata(NAME)
    assert meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 16, 16]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]
    assert meta["parameters"]["classes"] == [str(i) for i in range(10)]
    assert client.get_model_metadata(NAME, "1") == meta
    r = httpx.get(f"{server.url}/v2/models")
    assert r.json() == {
        "models": [
            {"name": NAME, "follows": "champion", "versions": [{"version": "1", "roles": ["primary"]}]}
        ]
    }


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_infer_matches_onnxruntime(
    serve_kit: ServeKit, client: triton.InferenceServerClient, binary: bool
) -> None:
    x = serve_kit.batch(4)
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    res = client.infer(
        NAME, [inp], outputs=[triton.InferRequestedOutput("logits", binary_data=binary)], request_id="r1"
    )
    got = res.as_numpy("logits")
    np.testing.assert_allclose(got, ort_logits(serve_kit.v1, x), rtol=1e-5, atol=1e-5)
    resp = res.get_response()
    assert resp["model_name"] == NAME and resp["model_version"] == "1" and resp["id"] == "r1"
    # The request-level default (no outputs named) is binary, as tritonclient asks.
    res = client.infer(NAME, [inp], model_version="1")
    np.testing.assert_allclose(res.as_numpy("logits"), got, rtol=1e-6)


def test_tritonclient_gzip_request_and_classification_extension(
    serve_kit: ServeKit, client: triton.InferenceServerClient
) -> None:
    x = serve_kit.batch(3, seed=1)
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    res = client.infer(
        NAME,
        [inp],
        outputs=[triton.InferRequestedOutput("logits", class_count=3)],
        request_compression_algorithm="gzip",
    )
    ref = ort_logits(serve_kit.v1, x)
    top = res.as_numpy("logits")
    assert top.shape == (3, 3)
    for row, ref_row in zip(top, ref, strict=True):
        idx = [int(s.decode().split(":")[1]) for s in row]
        assert idx == list(np.argsort(-ref_row, kind="stable")[:3])
        score, _, label = row[0].decode().split(":")
        assert float(score) == pytest.approx(ref_row.max(), abs=1e-5) and label == str(idx[0])


def test_raw_json_with_nested_data(serve_kit: ServeKit, server: BackgroundServer) -> None:
    x = serve_kit.batch(2, seed=2)
    body = {
        "id": "nested",
        "inputs": [{"name": "input", "shape": [2, 3, 16, 16], "datatype": "FP32", "data": x.tolist()}],
    }
    r = httpx.post(f"{server.url}/v2/models/{NAME}/infer", json=body)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert (
        doc["id"] == "nested"
        and doc["outputs"][0]["shape"] == [2, 10]
        and doc["outputs"][0]["datatype"] == "FP32"
    )
    np.testing.assert_allclose(
        np.array(doc["outputs"][0]["data"]).reshape(2, 10), ort_logits(serve_kit.v1, x), rtol=1e-5, atol=1e-5
    )


def _encode(path: Path, fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.open(path).convert("RGB").resize((40, 40)).save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_image_endpoint_matches_card_preprocessing(
    serve_kit: ServeKit, server: BackgroundServer, fmt: str
) -> None:
    files = sorted(serve_kit.images.rglob("*.png"))[::97][:6]
    transform = serve_kit.card.eval_preprocess().to_transform()
    correct = 0
    for path in files:
        data = _encode(path, fmt)
        ref = ort_logits(
            serve_kit.v1, transform(Image.open(io.BytesIO(data))).numpy()[None].astype(np.float32)
        )[0]
        probs = np.exp(ref - ref.max()) / np.exp(ref - ref.max()).sum()
        if fmt == "PNG":  # raw body
            r = httpx.post(
                f"{server.url}/v2/models/{NAME}/classify?top_k=3",
                content=data,
                headers={"Content-Type": "image/png"},
            )
        else:  # a multipart form, as `curl -F file=@x.jpg` sends it
            r = httpx.post(
                f"{server.url}/v2/models/{NAME}/versions/1/classify?top_k=3",
                files={"file": ("x.jpg", data, "image/jpeg")},
            )
        assert r.status_code == 200, r.text
        preds = r.json()["predictions"]
        assert [p["index"] for p in preds] == list(np.argsort(-probs, kind="stable")[:3])
        assert [p["score"] for p in preds] == pytest.approx(list(np.sort(probs)[::-1][:3]), abs=1e-5)
        assert preds[0]["label"] == serve_kit.card.class_names[preds[0]["index"]]
        correct += preds[0]["label"] == path.parent.name
    # A real trained model on its own digits: most are right (the exact count is the model's).
    assert correct >= len(files) - 2


def test_metrics_and_prediction_log(serve_kit: ServeKit, server: BackgroundServer) -> None:
    before = httpx.get(f"{server.url}/metrics").text
    x = serve_kit.batch(5, seed=3)
    for i in range(5):
        r = httpx.post(f"{server.url}/v2/models/{NAME}/infer", json=infer_body(x[i : i + 1]))
        assert r.status_code == 200
    httpx.post(f"{server.url}/v2/models/nope/infer", json=infer_body(x[:1]))
    after = httpx.get(f"{server.url}/metrics").text
    lab = {"model": NAME, "version": "1"}
    assert (
        metric(after, "visionloop_serve_requests_total", **lab, endpoint="infer")
        - metric(before, "visionloop_serve_requests_total", **lab, endpoint="infer")
        == 5
    )
    assert (
        metric(after, "visionloop_serve_request_seconds_count", **lab)
        - metric(before, "visionloop_serve_request_seconds_count", **lab)
        == 5
    )
    assert (
        metric(after, "visionloop_serve_queue_seconds_count", **lab)
        - metric(before, "visionloop_serve_queue_seconds_count", **lab)
        == 5
    )
    assert metric(after, "visionloop_serve_compute_seconds_count", **lab) > 0
    assert metric(after, "visionloop_serve_errors_total", model="_unknown", code="404") >= 1
    assert metric(after, "visionloop_serve_model_loaded", **lab, role="primary") == 1
    server.app.state.server.predlog.flush()
    records = [json.loads(line) for line in (server.app.state.server.predlog.path).read_text().splitlines()]
    ref = ort_logits(serve_kit.v1, x)
    last = records[-5:]
    assert [r["top_class"] for r in last] == [str(int(i)) for i in ref.argmax(1)]
    for rec, row in zip(last, ref, strict=True):
        assert (
            rec["model"] == NAME
            and rec["version"] == 1
            and rec["role"] == "primary"
            and rec["latency_ms"] > 0
        )
        assert rec["confidence"] == pytest.approx(
            float(np.exp(row.max() - np.logaddexp.reduce(row))), abs=1e-5
        )
