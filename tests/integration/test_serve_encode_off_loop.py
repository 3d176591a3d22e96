"""A large infer response is encoded off the inference server's event loop; a small one on it.

A model whose output is dense (6 MiB of FP32 per row, as a segmentation map or a detector's raw
tensors are) answers on a real server on loopback, with its encoding made slow: a readiness
check sent while that encoding runs must come back before it ends, for a JSON and for a binary
response. "Before it ends" is measured against the slow step itself (an event set when it
starts, another when it ends), never against a wall-clock threshold. A small output's encoding
stays on the loop (no thread hop for the common case).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

import visionloop.serve.app as app_module
from _servekit import FLAT_CARD
from _slowkit import SlowStep
from visionloop.serve.config import ServeConfig
from visionloop.serve.protocol import RequestedOutput
from visionloop.serve.response import encode_cost, encode_infer_response
from visionloop.serve.server import BackgroundServer
from visionloop.serve.source import StaticSource
from visionloop.serve.state import INLINE_ENCODE_BYTES

NAME = "dense"
IN, SMALL, BIG = "INPUT__0", "small", "big"
REPEATS = 2**17  # BIG: the 12 input values repeated, 12 x 2**17 FP32 = 6 MiB per row


def _dense_model(path: Path) -> None:
    """FP32 [batch, 3, 2, 2] → SMALL [batch, 12] (the input flattened) and BIG [batch, 12 x
    REPEATS] (SMALL tiled)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    repeats = numpy_helper.from_array(np.array([1, REPEATS], dtype=np.int64), "repeats")
    graph = helper.make_graph(
        [
            helper.make_node("Flatten", [IN], [SMALL], axis=1),
            helper.make_node("Tile", [SMALL, "repeats"], [BIG]),
        ],
        "dense",
        [helper.make_tensor_value_info(IN, TensorProto.FLOAT, ["batch", 3, 2, 2])],
        [
            helper.make_tensor_value_info(SMALL, TensorProto.FLOAT, ["batch", 12]),
            helper.make_tensor_value_info(BIG, TensorProto.FLOAT, ["batch", 12 * REPEATS]),
        ],
        [repeats],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    tmp = tmp_path_factory.mktemp("dense")
    _dense_model(tmp / "dense.onnx")
    src = StaticSource()
    src.add(NAME, 1, tmp / "dense.onnx", FLAT_CARD)
    src.set_alias(NAME, "champion", 1)
    cfg = ServeConfig(model=NAME, port=0, prediction_log=False)
    with BackgroundServer(cfg, src) as s:
        yield s


def _asks_for(name: str) -> Callable[..., bool]:
    # encode_infer_response(model_name, model_version, request_id, results, requested, labels)
    return lambda *args: any(r.name == name for r in args[4])


def _infer(s: BackgroundServer, output: str, binary: bool) -> httpx.Response:
    x = np.arange(12, dtype=np.float32).reshape(1, 3, 2, 2)
    body = {
        "inputs": [{"name": IN, "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}],
        "outputs": [{"name": output, "parameters": {"binary_data": binary}}],
    }
    return httpx.post(f"{s.url}/v2/models/{NAME}/infer", json=body, timeout=60)


def _check_big(r: httpx.Response, binary: bool) -> None:
    assert r.status_code == 200, r.text
    want = np.tile(np.arange(12, dtype=np.float32), REPEATS)
    if binary:
        hl = int(r.headers["Inference-Header-Content-Length"])
        header = r.content[:hl]
        assert b'"binary_data_size":%d' % want.nbytes in header
        got = np.frombuffer(r.content[hl:], dtype="<f4")
    else:
        (out,) = r.json()["outputs"]
        assert out["shape"] == [1, 12 * REPEATS]
        got = np.asarray(out["data"], dtype=np.float32)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_a_large_output_is_encoded_off_the_event_loop(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch, binary: bool
) -> None:
    step = SlowStep(encode_infer_response, when=_asks_for(BIG))
    monkeypatch.setattr(app_module, "encode_infer_response", step)
    answers: list[httpx.Response] = []
    t = threading.Thread(target=lambda: answers.append(_infer(server, BIG, binary)))
    t.start()
    assert step.started.wait(60), "the slow encoding never started"
    r = httpx.get(f"{server.url}/v2/health/ready", timeout=60)
    answered_first = not step.ended.is_set()
    t.join(60)
    assert r.status_code == 200, r.text
    assert answered_first, "the readiness check waited for a large response to be encoded"
    assert step.threads[0] is not server.thread  # not uvicorn's (the event loop's) thread
    (answer,) = answers
    _check_big(answer, binary)


def test_a_small_output_is_encoded_on_the_event_loop(
    server: BackgroundServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    step = SlowStep(encode_infer_response, when=lambda *a: False)
    monkeypatch.setattr(app_module, "encode_infer_response", step)
    for binary in (False, True):
        r = _infer(server, SMALL, binary)
        assert r.status_code == 200, r.text
    assert step.threads == [server.thread, server.thread]


def test_encode_cost_weighs_what_encoding_costs() -> None:
    """JSON by elements, raw bytes at a discount, classification by its sort and its strings."""
    a: dict[str, np.ndarray] = {
        "x": np.zeros((1, 16 * 1024), np.float32),
        "i8": np.zeros((1, 16 * 1024), np.int8),
    }
    json_out, binary_out = RequestedOutput("x", False, 0), RequestedOutput("x", True, 0)
    assert encode_cost(a, [json_out]) == 64 * 1024 >= INLINE_ENCODE_BYTES
    assert encode_cost(a, [RequestedOutput("i8", False, 0)]) == 64 * 1024  # per element, not byte
    assert encode_cost(a, [binary_out]) < INLINE_ENCODE_BYTES
    big = {"x": np.zeros((1, 12 * REPEATS), np.float32)}
    assert encode_cost(big, [RequestedOutput("x", True, 0)]) >= INLINE_ENCODE_BYTES
    # 64 rows x 100 classes, top 100 each: a small tensor, thousands of strings formatted.
    scores = {"x": np.zeros((64, 100), np.float32)}
    assert encode_cost(scores, [RequestedOutput("x", False, 100)]) >= INLINE_ENCODE_BYTES
    assert encode_cost(scores, [RequestedOutput("x", False, 1)]) < INLINE_ENCODE_BYTES
