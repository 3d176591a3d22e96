"""Hostile input on a real server: every kind of client mistake gets a 4xx with the protocol's
{"error": "..."} body naming the problem, never a 5xx, and the server answers correctly
afterwards. Then schemathesis fuzzes the whole OpenAPI document: no 5xx anywhere."""

from __future__ import annotations

import gzip
import io
import json
import select
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from _servekit import NAME, ServeKit, infer_body, metric, ort_logits, serve_kit
from visionloop.serve.server import BackgroundServer

__all__ = ["serve_kit"]

LIMIT = 200_000


@pytest.fixture(scope="module")
def server(serve_kit: ServeKit, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    tmp = tmp_path_factory.mktemp("hostile")
    with serve_kit.server(serve_kit.source(), tmp, max_body_bytes=LIMIT, max_batch_size=4) as s:
        yield s


def _tensor(**over: Any) -> dict[str, Any]:
    t: dict[str, Any] = {"name": "input", "shape": [1, 3, 16, 16], "datatype": "FP32", "data": [0.0] * 768}
    t.update(over)
    return t


def _binary(
    json_doc: dict[str, Any], payload: bytes, header: str | None = None
) -> tuple[bytes, dict[str, str]]:
    head = json.dumps(json_doc).encode()
    return head + payload, {
        "Inference-Header-Content-Length": header if header is not None else str(len(head))
    }


ZEROS = np.zeros((1, 3, 16, 16), np.float32).tobytes()
BIN = {
    "inputs": [
        {
            "name": "input",
            "shape": [1, 3, 16, 16],
            "datatype": "FP32",
            "parameters": {"binary_data_size": 3072},
        }
    ]
}


def _png(size: tuple[int, int], mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, "PNG")
    return buf.getvalue()


def _infer_cases() -> list[tuple[str, bytes, dict[str, str], int, str]]:
    j = lambda doc: json.dumps(doc).encode()  # noqa: E731
    big = _tensor(shape=[4, 3, 16, 16], data=[123456.789] * 30_000)  # ~330 kB of JSON
    cases = [
        ("malformed json", b'{"inputs": [', {}, 400, "not valid JSON"),
        ("json array", b"[1, 2]", {}, 400, "must be a JSON object"),
        ("no inputs", j({"outputs": []}), {}, 400, 'needs "inputs"'),
        ("unknown input", j({"inputs": [_tensor(name="pixels")]}), {}, 400, "no input 'pixels'"),
        ("wrong spatial shape", j({"inputs": [_tensor(shape=[1, 3, 15, 16])]}), {}, 400, "does not fit"),
        ("wrong rank", j({"inputs": [_tensor(shape=[3, 16, 16])]}), {}, 400, "list of 4 whole numbers"),
        (
            "shape not numbers",
            j({"inputs": [_tensor(shape=["a", 3, 16, 16])]}),
            {},
            400,
            "list of 4 whole numbers",
        ),
        (
            "batch too big",
            j({"inputs": [_tensor(shape=[5, 3, 16, 16], data=[0.0] * 3840)]}),
            {},
            400,
            "1 to 4",
        ),
        ("zero batch", j({"inputs": [_tensor(shape=[0, 3, 16, 16], data=[])]}), {}, 400, "1 to 4"),
        ("wrong datatype", j({"inputs": [_tensor(datatype="INT64")]}), {}, 400, "must have datatype FP32"),
        ("too few values", j({"inputs": [_tensor(data=[0.0] * 10)]}), {}, 400, "data has 10 values"),
        (
            "not numbers",
            j({"inputs": [_tensor(data=["x"] * 768)]}),
            {},
            400,
            "input 'input' declares FP32 but element 0 is a string ('x'), not a number",
        ),
        ("ragged data", j({"inputs": [_tensor(data=[[0.0], [0.0, 1.0]])]}), {}, 400, "not a list of FP32"),
        ("no data", j({"inputs": [_tensor(data=None)]}), {}, 400, 'needs "data"'),
        ("duplicate input", j({"inputs": [_tensor(), _tensor()]}), {}, 400, "given twice"),
        (
            "unknown output",
            j({"inputs": [_tensor()], "outputs": [{"name": "probs"}]}),
            {},
            400,
            "no output 'probs'",
        ),
        (
            "bad classification",
            j({"inputs": [_tensor()], "outputs": [{"name": "logits", "parameters": {"classification": -1}}]}),
            {},
            400,
            "classification",
        ),
        ("bad id", j({"id": 5, "inputs": [_tensor()]}), {}, 400, "id must be a string"),
        ("oversized body", j({"inputs": [big]}), {}, 413, "more than the server's limit"),
        ("gzip bomb", gzip.compress(b" " * (LIMIT * 20)), {"Content-Encoding": "gzip"}, 413, "limit"),
        ("broken gzip", b"not gzip at all", {"Content-Encoding": "gzip"}, 400, "not valid gzip"),
        ("unknown encoding", b"{}", {"Content-Encoding": "br"}, 415, "not supported"),
        ("header length not a number", *_binary(BIN, ZEROS, "abc"), 400, "whole number"),
        ("header length past the body", *_binary(BIN, ZEROS, "999999"), 400, "body has"),
        ("header length zero", *_binary(BIN, ZEROS, "0"), 400, "body has"),
        ("header length cuts the json", *_binary(BIN, ZEROS, "10"), 400, "not valid JSON"),
        (
            "binary size mismatch",
            *_binary({"inputs": [{**BIN["inputs"][0], "parameters": {"binary_data_size": 100}}]}, ZEROS),
            400,
            "does not match",
        ),
        ("binary data truncated", *_binary(BIN, ZEROS[:1000]), 400, "body ends"),
        ("bytes after the binary data", *_binary(BIN, ZEROS + b"xx"), 400, "after the last binary input"),
        ("binary size without header", j(BIN), {}, 400, "no Inference-Header-Content-Length"),
    ]
    return cases


def _classify_cases() -> list[tuple[str, bytes, dict[str, str], int, str]]:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "PNG")
    good = buf.getvalue()  # noise: cut in half, the pixel data (not the header) is missing
    return [
        ("not an image", b"definitely not an image", {"Content-Type": "image/png"}, 415, "not an image"),
        ("empty body", b"", {"Content-Type": "image/png"}, 400, "body is empty"),
        ("truncated png", good[: len(good) // 2], {"Content-Type": "image/png"}, 400, "cannot be decoded"),
        ("pixel bomb", _png((8200, 8200), "1"), {"Content-Type": "image/png"}, 413, "more than the"),
        (
            "multipart without a file",
            b'--b\r\nContent-Disposition: form-data; name="x"\r\n\r\nhi\r\n--b--\r\n',
            {"Content-Type": "multipart/form-data; boundary=b"},
            400,
            "no file part",
        ),
        (
            "multipart with a bad boundary",
            b"garbage",
            {"Content-Type": "multipart/form-data; boundary=zz"},
            400,
            "multipart",
        ),
    ]


@pytest.mark.parametrize("case", _infer_cases(), ids=lambda c: c[0])
def test_bad_inference_requests_get_4xx(
    server: BackgroundServer, case: tuple[str, bytes, dict[str, str], int, str]
) -> None:
    _, body, headers, status, words = case
    r = httpx.post(
        f"{server.url}/v2/models/{NAME}/infer",
        content=body,
        headers={"Content-Type": "application/json", **headers},
    )
    assert r.status_code == status, r.text
    assert words in r.json()["error"]


@pytest.mark.parametrize("case", _classify_cases(), ids=lambda c: c[0])
def test_bad_images_get_4xx(
    server: BackgroundServer, case: tuple[str, bytes, dict[str, str], int, str]
) -> None:
    _, body, headers, status, words = case
    r = httpx.post(f"{server.url}/v2/models/{NAME}/classify", content=body, headers=headers)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]


def test_unknown_models_versions_routes_and_streamed_oversize(server: BackgroundServer) -> None:
    body = infer_body(np.zeros((1, 3, 16, 16), np.float32))
    checks = [
        (httpx.post(f"{server.url}/v2/models/nope/infer", json=body), 404, "no model 'nope'"),
        (
            httpx.post(f"{server.url}/v2/models/{NAME}/versions/9/infer", json=body),
            404,
            "version 9 of digits is not loaded",
        ),
        (httpx.post(f"{server.url}/v2/models/{NAME}/versions/x1/infer", json=body), 400, "whole number"),
        (httpx.get(f"{server.url}/v2/models/{NAME}/versions/2"), 404, "not loaded"),
        (httpx.get(f"{server.url}/v2/nowhere"), 404, "no such endpoint"),
        (httpx.get(f"{server.url}/v2/models/{NAME}/infer"), 405, "Method Not Allowed"),
        (httpx.post(f"{server.url}/v2/models/{NAME}/classify?top_k=0", content=_png((20, 20))), 400, "top_k"),
        # No Content-Length: the limit holds while the body streams in.
        (httpx.post(f"{server.url}/v2/models/{NAME}/infer", content=iter([b"x" * 65536] * 8)), 413, "limit"),
    ]
    for r, status, words in checks:
        assert r.status_code == status, r.text
        assert words in r.json()["error"]


def test_server_still_answers_correctly_after_abuse(serve_kit: ServeKit, server: BackgroundServer) -> None:
    for case in _infer_cases()[:5]:
        httpx.post(f"{server.url}/v2/models/{NAME}/infer", content=case[1])
    # Clients that promise a body and leave halfway: not a server error (no 500 counted below).
    for route in ("infer", "infer", "classify"):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            head = f"POST /v2/models/{NAME}/{route} HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n"
            sock.sendall(head.encode() + b"{" * 100)
    x = serve_kit.batch(2, seed=10)
    r = httpx.post(f"{server.url}/v2/models/{NAME}/infer", json=infer_body(x))
    assert r.status_code == 200
    np.testing.assert_allclose(
        np.array(r.json()["outputs"][0]["data"]).reshape(2, 10),
        ort_logits(serve_kit.v1, x),
        rtol=1e-5,
        atol=1e-5,
    )
    text = httpx.get(f"{server.url}/metrics").text
    assert metric(text, "visionloop_serve_errors_total", model=NAME, code="400") >= 5
    assert metric(text, "visionloop_serve_errors_total", code="500") == 0


def test_request_heads_without_end_or_trickled_are_cut_off(
    serve_kit: ServeKit, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Before any key is read: headers without end (before, every byte was kept: 190 MiB sent
    grew the server by 200 MiB, with no answer) get a 431 once past 64 KiB; a head trickled
    byte by byte, or never sent (before, held open for ever), a 408 at the deadline. A client
    that keeps its connection and pauses between requests is not cut off."""
    tmp = tmp_path_factory.mktemp("heads")
    with serve_kit.server(serve_kit.source(), tmp, head_timeout_s=1.0) as s:
        line = b"X-Pad: " + b"a" * 8000 + b"\r\n"
        sent = 0
        with socket.create_connection(("127.0.0.1", s.port), timeout=30) as sock:
            sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n")
            try:
                while sent < 64 * 2**20 and not select.select([sock], [], [], 0)[0]:
                    sock.sendall(line)
                    sent += len(line)
            except (BrokenPipeError, ConnectionResetError):
                pass
            answer = _read_all(sock)
        assert sent < 16 * 2**20, f"{sent} bytes of headers were read"  # the rest: socket buffers
        assert answer == b"" or (answer.startswith(b"HTTP/1.1 431") and b"over 65536 bytes" in answer), answer
        with (
            socket.create_connection(("127.0.0.1", s.port), timeout=10) as silent,
            socket.create_connection(("127.0.0.1", s.port), timeout=10) as trickler,
        ):
            _trickle(trickler, b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 100)
            for sock in (silent, trickler):
                answer = _read_all(sock)
                assert answer.startswith(b"HTTP/1.1 408"), answer
                assert b"no complete request head within 1 s" in answer
        # A body promised and never sent, or trickled: 408 once the deadline passes (before,
        # held for ever, with up to max_body_bytes buffered).
        route = f"POST /v2/models/{NAME}/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        with (
            socket.create_connection(("127.0.0.1", s.port), timeout=20) as mute,
            socket.create_connection(("127.0.0.1", s.port), timeout=20) as slow,
        ):
            mute.sendall(route.encode() + b"Content-Length: 1000\r\n\r\n")
            slow.sendall(route.encode() + b"Content-Length: 100000\r\n\r\n")
            _trickle(slow, b" " * 400)
            for sock in (mute, slow):
                answer = _read_all(sock)
                assert answer.startswith(b"HTTP/1.1 408"), answer
                assert b"the body came slower than 64 KiB/s after its first 1 s" in answer
        with httpx.Client(base_url=s.url) as c:
            assert c.get("/v2/health/ready").status_code == 200
            time.sleep(1.5)
            assert c.get("/v2/health/ready").status_code == 200
            x = serve_kit.batch(2, seed=3)
            r = c.post(f"/v2/models/{NAME}/infer", json=infer_body(x))
            assert r.status_code == 200  # a whole body sent at once is served as before


def _trickle(sock: socket.socket, data: bytes) -> None:
    """Send `data` a byte every 50 ms (20 bytes/s) until the server answers or hangs up."""
    try:
        for byte in data:
            sock.sendall(bytes([byte]))
            time.sleep(0.05)
            if select.select([sock], [], [], 0)[0]:
                return
    except (BrokenPipeError, ConnectionResetError):
        pass


def _read_all(sock: socket.socket) -> bytes:
    answer = b""
    try:
        while chunk := sock.recv(4096):
            answer += chunk
    except ConnectionResetError:
        pass
    return answer


def test_schemathesis_finds_no_server_error(server: BackgroundServer, tmp_path: Path) -> None:
    # Path parameters pinned to the served model, so the generated bodies reach the handlers.
    config = tmp_path / "schemathesis.toml"
    config.write_text(f'[parameters]\n"path.name" = "{NAME}"\n"path.version" = "1"\n')
    p = subprocess.run(
        [
            str(Path(sys.executable).parent / "schemathesis"),
            "--config-file",
            str(config),
            "run",
            f"{server.url}/openapi.json",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            "15",
            "--seed",
            "1",
            "--phases",
            "coverage,fuzzing",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    # Every operation the server documents was exercised, and none failed.
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    operations = sum(len(methods) for methods in paths.values())
    assert operations >= 16  # health, metadata, infer, classify, routing, metrics, ...
    assert f"{operations} passed" in p.stdout and "failed" not in p.stdout.split("SUMMARY")[-1]
    text = httpx.get(f"{server.url}/metrics").text
    assert metric(text, "visionloop_serve_errors_total", code="500") == 0


def test_binary_protocol_helpers_agree_with_tritonclient_layout() -> None:
    # The BYTES layout the classification extension uses: 4-byte little-endian length, then bytes.
    from visionloop.serve.response import _bytes_tensor

    arr = np.array([[b"0.5:1:a", b"xy"]], dtype=object)
    assert _bytes_tensor(arr) == struct.pack("<I", 7) + b"0.5:1:a" + struct.pack("<I", 2) + b"xy"
