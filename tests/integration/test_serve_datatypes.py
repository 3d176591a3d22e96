"""Every datatype the server takes, with hostile values, on a real server on loopback.

One identity model per KServe v2 datatype (input INPUT__0 [batch, 4] → output OUTPUT__0, the
same values): boundary values come back exactly, and each value that does not belong in its
datatype (strings, null, objects, lists nested wrongly, booleans in numbers, numbers in BOOL,
floats in integers, integers out of range, NaN/Infinity literals, numbers that overflow FP16 or
FP32; binary data of the wrong length, NaN bytes, BOOL bytes other than 0/1) gets a 400 that
names the input, the datatype and the element: never a 200 with altered values, never a 500.

A model that answers NaN or an infinity for finite inputs gets a 500 that says so, counted as
an error (and per version as non_finite_output), never a 200 and never a prediction logged.
"""

from __future__ import annotations

import io
import json
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from _servekit import FLAT_CARD, metric
from visionloop.serve.config import ServeConfig
from visionloop.serve.runtime import DATATYPES
from visionloop.serve.server import BackgroundServer
from visionloop.serve.source import StaticSource

IN, OUT = "INPUT__0", "OUTPUT__0"
INTEGERS = [dt for dt, d in DATATYPES.items() if d.kind in "iu"]
FLOATS = [dt for dt, d in DATATYPES.items() if d.kind == "f"]
NONFINITE = "nonfinite"  # FP32 [batch, 3, 2, 2] → log(x) flattened: -inf at 0, NaN below
SHADOWED = "shadowed"  # v1 flattens its input (champion); v2 is NONFINITE's graph (shadow)


def _model_name(datatype: str) -> str:
    return f"id-{datatype.lower()}"


def _identity(path: Path, datatype: str) -> None:
    import onnx
    from onnx import helper

    elem = helper.np_dtype_to_tensor_dtype(DATATYPES[datatype])
    graph = helper.make_graph(
        [helper.make_node("Identity", [IN], [OUT])],
        f"identity_{datatype.lower()}",
        [helper.make_tensor_value_info(IN, elem, ["batch", 4])],
        [helper.make_tensor_value_info(OUT, elem, ["batch", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def _image_model(path: Path, log: bool) -> None:
    """FP32 [batch, 3, 2, 2] → [batch, 12]: the pixels flattened, or their logarithm."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Flatten", [IN], ["flat" if log else OUT], axis=1)]
    if log:
        nodes.append(helper.make_node("Log", ["flat"], [OUT]))
    graph = helper.make_graph(
        nodes,
        "log" if log else "flatten",
        [helper.make_tensor_value_info(IN, TensorProto.FLOAT, ["batch", 3, 2, 2])],
        [helper.make_tensor_value_info(OUT, TensorProto.FLOAT, ["batch", 12])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    tmp = tmp_path_factory.mktemp("datatypes")
    src = StaticSource()
    for dt in DATATYPES:
        _identity(tmp / f"{dt}.onnx", dt)
        src.add(_model_name(dt), 1, tmp / f"{dt}.onnx", FLAT_CARD)
        src.set_alias(_model_name(dt), "champion", 1)
    _image_model(tmp / "log.onnx", log=True)
    _image_model(tmp / "flatten.onnx", log=False)
    src.add(NONFINITE, 1, tmp / "log.onnx", FLAT_CARD)
    src.set_alias(NONFINITE, "champion", 1)
    src.add(SHADOWED, 1, tmp / "flatten.onnx", FLAT_CARD)
    src.add(SHADOWED, 2, tmp / "log.onnx", FLAT_CARD)
    src.set_alias(SHADOWED, "champion", 1)
    src.set_alias(SHADOWED, "challenger", 2)
    names = [_model_name(dt) for dt in DATATYPES]
    cfg = ServeConfig(
        model=names[0],
        models=[*names[1:], NONFINITE, SHADOWED],
        port=0,
        max_batch_size=8,
        max_queue_delay_ms=20.0,
        shadow_percent=100.0,
    )
    with BackgroundServer(cfg, src, tmp / "predictions.jsonl") as s:
        yield s


def _post(server: BackgroundServer, model: str, body: bytes, headers: dict[str, str] | None = None) -> Any:
    return httpx.post(
        f"{server.url}/v2/models/{model}/infer",
        content=body,
        headers={"Content-Type": "application/json", **(headers or {})},
        timeout=60,
    )


def _json_body(datatype: str, data_text: str, shape: str = "[1, 4]") -> bytes:
    """A request with `data_text` spliced in verbatim (so NaN, 1e400 and the like reach the
    server as written, as a client that does not write strict JSON sends them)."""
    head = json.dumps({"name": IN, "shape": json.loads(shape), "datatype": datatype})
    return ('{"inputs": [' + head[:-1] + ', "data": ' + data_text + "}]}").encode()


def _binary_body(
    datatype: str,
    payload: bytes,
    shape: list[int] | None = None,
    size: Any = None,
    binary_output: bool = False,
    **extra: Any,
) -> tuple[bytes, dict[str, str]]:
    tensor = {
        "name": IN,
        "shape": shape or [1, 4],
        "datatype": datatype,
        "parameters": {"binary_data_size": len(payload) if size is None else size},
        **extra,
    }
    doc: dict[str, Any] = {"inputs": [tensor]}
    if binary_output:
        doc["parameters"] = {"binary_data_output": True}
    head = json.dumps(doc).encode()
    return head + payload, {"Inference-Header-Content-Length": str(len(head))}


# ---------------------------------------------------------------------- values that pass


def _boundaries(datatype: str) -> list[Any]:
    d = DATATYPES[datatype]
    if d.kind == "b":
        return [True, False, False, True]
    if d.kind in "iu":
        info = np.iinfo(d)
        return [int(info.min), int(info.max), 0, 1]
    top = float(np.finfo(d).max)
    return [-top, top, 0.5, -0.0]


@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_boundary_values_come_back_exactly(server: BackgroundServer, datatype: str) -> None:
    values = _boundaries(datatype)
    r = _post(server, _model_name(datatype), _json_body(datatype, json.dumps([values])))
    assert r.status_code == 200, r.text
    out = r.json()["outputs"][0]
    assert out["datatype"] == datatype and out["shape"] == [1, 4]
    d = DATATYPES[datatype]
    if d.kind != "f":
        assert out["data"] == values  # exactly, 2**64 - 1 and -2**63 included
    np.testing.assert_array_equal(np.array(out["data"], dtype=d), np.array(values, dtype=d))
    # The same values as binary data, answered as binary data: byte for byte.
    raw = np.array([values], dtype=d).tobytes()
    r = _post(server, _model_name(datatype), *_binary_body(datatype, raw, binary_output=True))
    assert r.status_code == 200, r.text
    assert r.content[int(r.headers["Inference-Header-Content-Length"]) :] == raw


# ---------------------------------------------------------------------- JSON values refused


def _hostile_json(datatype: str) -> list[tuple[str, str, str]]:
    """(case id, the element's JSON text, what the error says about it): each put at
    element 2 of a [1, 4] tensor whose other elements are valid."""
    d = DATATYPES[datatype]
    whole = "a whole number" if d.kind in "iu" else "true or false" if d.kind == "b" else "a number"
    cases = [
        ("string", '"x"', f"is a string ('x'), not {whole}"),
        ("numeric string", '"1"', f"is a string ('1'), not {whole}"),
        ("null", "null", f"is null, not {whole}"),
        ("object", '{"v": 1}', f"is an object, not {whole}"),
        ("list too deep", "[0]", f"is a list, not {whole}"),
        ("NaN literal", "NaN", "is NaN, not "),
        ("Infinity literal", "Infinity", "is Infinity, not "),
        ("-Infinity literal", "-Infinity", "is -Infinity, not "),
        ("number past a double", "1e400", "is Infinity, not "),
        ("integer past a double", "9" * 400, "is Infinity, not "),
    ]
    if d.kind == "b":
        cases += [
            ("one", "1", "is 1, not true or false"),
            ("zero", "0", "is 0, not true or false"),
            ("float", "0.5", "is 0.5, not true or false"),
        ]
        return cases
    cases.append(("boolean", "true", f"is a boolean (true), not {whole}"))
    if d.kind in "iu":
        info = np.iinfo(d)
        cases += [
            ("max + 1", str(int(info.max) + 1), f"outside {datatype}'s range"),
            ("min - 1", str(int(info.min) - 1), f"outside {datatype}'s range"),
            ("2**70", str(2**70), f"outside {datatype}'s range"),
            ("-2**70", str(-(2**70)), f"outside {datatype}'s range"),
            ("float", "1.5", "is 1.5, not a whole number"),
            ("whole float", "3.0", "is 3.0, written as a float (send 3)"),
            ("exponent", "1e2", "is 100.0, written as a float (send 100)"),
        ]
        if datatype in ("UINT8", "INT8"):
            cases.append(("300", "300", f"is 300, outside {datatype}'s range"))
        if d.kind == "u":
            cases.append(("-1", "-1", f"is -1, outside {datatype}'s range"))
    else:
        cases += {
            "FP16": [
                ("overflows", "65520", "is 65520, too large for FP16"),
                ("overflows negative", "-65520.0", "is -65520.0, too large for FP16"),
                ("2**70", str(2**70), "is 1.1805916207174113e+21, too large for FP16"),
            ],
            "FP32": [
                ("overflows", "1e39", "is 1e+39, too large for FP32"),
                ("overflows negative", "-1e39", "is -1e+39, too large for FP32"),
            ],
            "FP64": [
                ("overflows", "1e309", "is Infinity, not a finite number"),
                ("overflows negative", "-1e309", "is -Infinity, not a finite number"),
            ],
        }[datatype]
    return cases


JSON_CASES = [(dt, *case) for dt in DATATYPES for case in _hostile_json(dt)]


@pytest.mark.parametrize("case", JSON_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_hostile_json_values_get_400_naming_the_input(
    server: BackgroundServer, case: tuple[str, str, str, str]
) -> None:
    datatype, _, element, said = case
    fill = "false" if datatype == "BOOL" else "0"
    r = _post(server, _model_name(datatype), _json_body(datatype, f"[{fill}, {fill}, {element}, {fill}]"))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error.startswith(f"input '{IN}' declares {datatype} but element 2 "), error
    assert said in error, error


@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_nested_data_of_the_wrong_shape_gets_400(server: BackgroundServer, datatype: str) -> None:
    v = "true" if datatype == "BOOL" else "1"
    for data, level in (
        (f"[[{v}, {v}], [{v}, {v}]]", "level 1 should be 1 lists of 4"),
        (f"[[{v}, {v}, {v}]]", "level 1 should be 1 lists of 4"),
        (f"[[{v}, {v}, {v}, {v}], [{v}, {v}, {v}, {v}]]", "level 1 should be 1 lists of 4"),
        (f"[[{v}, {v}, {v}, {v}], {v}]", "level 1 should be 2 lists of 4"),
    ):
        shape = "[2, 4]" if level.startswith("level 1 should be 2") else "[1, 4]"
        r = _post(server, _model_name(datatype), _json_body(datatype, data, shape))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error.startswith(f"input '{IN}' declares {datatype} in shape {shape}"), error
        assert level in error, error
    # Flat, but too few or too many values.
    for n in (3, 5):
        r = _post(
            server,
            _model_name(datatype),
            _json_body(datatype, json.dumps([True if datatype == "BOOL" else 1] * n)),
        )
        assert r.status_code == 400 and f"input '{IN}': data has {n} values" in r.json()["error"]


@pytest.mark.parametrize("datatype", list(DATATYPES))
def test_bytes_and_other_datatypes_than_the_models_get_400(server: BackgroundServer, datatype: str) -> None:
    for declared, data in (
        ("BYTES", '["a", "b", "c", "d"]'),
        ("FP32" if datatype != "FP32" else "INT32", "[0, 0, 0, 0]"),
    ):
        r = _post(server, _model_name(datatype), _json_body(declared, data))
        assert r.status_code == 400, r.text
        assert f"input '{IN}' must have datatype {datatype}, got '{declared}'" in r.json()["error"]
    body, headers = _binary_body("BYTES", struct.pack("<I", 1) + b"a")
    r = _post(server, _model_name(datatype), body, headers)
    assert r.status_code == 400
    assert f"input '{IN}' must have datatype {datatype}, got 'BYTES'" in r.json()["error"]


# ---------------------------------------------------------------------- binary data refused


def _hostile_binary(datatype: str) -> list[tuple[str, bytes, dict[str, str], str]]:
    d = DATATYPES[datatype]
    n = 4 * d.itemsize
    good = np.zeros((1, 4), dtype=d).tobytes()
    size_error = f"input '{IN}' declares {datatype} in shape [1, 4], {n} bytes, but its binary_data_size"
    cases = [
        ("one byte short", *_binary_body(datatype, good[:-1]), f"{size_error} {n - 1} does not match"),
        ("one byte long", *_binary_body(datatype, good + b"\0"), f"{size_error} {n + 1} does not match"),
        (
            "shape of two rows, data of one",
            *_binary_body(datatype, good, shape=[2, 4]),
            f"input '{IN}' declares {datatype} in shape [2, 4], {2 * n} bytes, but its binary_data_size {n}",
        ),
        ("size as a string", *_binary_body(datatype, good, size=str(n)), f"binary_data_size '{n}' does not"),
        (
            "size as a float",
            *_binary_body(datatype, good, size=float(n)),
            f"binary_data_size {float(n)} does",
        ),
        ("size true", *_binary_body(datatype, good, size=True), "binary_data_size True does not match"),
        ("size negative", *_binary_body(datatype, good, size=-n), f"binary_data_size {-n} does not match"),
        ("body short", *_binary_body(datatype, good[:-2], size=n), f"input '{IN}': the body ends 2 bytes"),
        ("bytes after", *_binary_body(datatype, good + b"xy", size=n), "2 bytes after the last binary input"),
        (
            "data and binary",
            *_binary_body(datatype, good, data=[0, 0, 0, 0]),
            f"input '{IN}' has both binary_data_size and data",
        ),
    ]
    if d.kind == "f":
        for bad, said in ((np.nan, "NaN"), (np.inf, "Infinity"), (-np.inf, "-Infinity")):
            raw = np.array([[0, bad, 0, 0]], dtype=d).tobytes()
            cases.append(
                (
                    said,
                    *_binary_body(datatype, raw),
                    f"input '{IN}' declares {datatype} but element 1 of its binary data is {said}",
                )
            )
    if d.kind == "b":
        cases.append(
            (
                "byte 2",
                *_binary_body(datatype, b"\x01\x02\x00\x01"),
                f"input '{IN}' declares BOOL but byte 1 of its binary data is 2",
            )
        )
    return cases


BINARY_CASES = [(dt, *case) for dt in DATATYPES for case in _hostile_binary(dt)]


@pytest.mark.parametrize("case", BINARY_CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_hostile_binary_data_gets_400_naming_the_input(
    server: BackgroundServer, case: tuple[str, str, bytes, dict[str, str], str]
) -> None:
    datatype, _, body, headers, said = case
    r = _post(server, _model_name(datatype), body, headers)
    assert r.status_code == 400, r.text
    assert said in r.json()["error"], r.json()["error"]


def test_nonfinite_literals_in_large_and_odd_bodies(server: BackgroundServer) -> None:
    from visionloop.serve.state import INLINE_PARSE_BYTES

    model = _model_name("FP32")
    # Past the inline limit (parsed in a worker thread), several literals: the first is named.
    pad = " " * INLINE_PARSE_BYTES
    body = _json_body("FP32", f"[0, {pad}Infinity, NaN, -Infinity]")
    assert len(body) > INLINE_PARSE_BYTES
    r = _post(server, model, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith(f"input '{IN}' declares FP32 but element 1 is Infinity, not a finite")
    # Two inputs' worth of checks happen in order: an unknown input is named first.
    r = _post(
        server, model, b'{"inputs": [{"name": "nope", "shape": [1, 4], "datatype": "FP32", "data": [NaN]}]}'
    )
    assert r.status_code == 400 and "no input 'nope'" in r.json()["error"], r.text
    # NaN outside any tensor, or inside a string: still not JSON (never served).
    inputs = '"inputs": [{"name": "%s", "shape": [1, 4], "datatype": "FP32", "data": %s}]'
    for text in (
        '{"id": "NaN", ' + inputs % (IN, "[0, 0, NaN, 0]") + "}",
        '{"id": NaN, ' + inputs % (IN, "[0, 0, 0, 0]") + "}",
        '{"x": NaN, ' + inputs % (IN, "[0, 0, 0, 0]") + "}",
        # More numbers past a double than the error path rewrites (3): the plain JSON error.
        "{" + inputs % (IN, "[1e400, 1e400, 1e400, 1e400]") + "}",
        "{" + inputs % (IN, "[0, 0, NaN, 0]"),  # cut short
    ):
        r = _post(server, model, text.encode())
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error.startswith("the request body is not valid JSON: "), error
    # Three numbers past a double are each read as Infinity: the first is named.
    body = _json_body("FP32", "[0, 1e400, -1e999, 1e400]")
    r = _post(server, model, body)
    assert r.status_code == 400
    assert r.json()["error"].startswith(f"input '{IN}' declares FP32 but element 1 is Infinity, not a finite")


def test_no_hostile_value_was_a_server_error(server: BackgroundServer) -> None:
    text = httpx.get(f"{server.url}/metrics").text
    for dt in DATATYPES:
        assert metric(text, "visionloop_serve_errors_total", model=_model_name(dt), code="500") == 0


# ---------------------------------------------------------------------- non-finite outputs


def _nonfinite_error(model: str) -> str:
    return f"inference failed: {model}/1 produced NaN or infinity in output ['{OUT}'] for this request"


def _pixels(*rows: float) -> bytes:
    return json.dumps(
        {
            "inputs": [
                {
                    "name": IN,
                    "shape": [len(rows), 3, 2, 2],
                    "datatype": "FP32",
                    "data": [v for v in rows for _ in range(12)],
                }
            ]
        }
    ).encode()


def test_a_nonfinite_output_is_a_500_counted_as_an_error_and_never_logged(server: BackgroundServer) -> None:
    state = server.app.state.server
    before = httpx.get(f"{server.url}/metrics").text
    ok = _post(server, NONFINITE, _pixels(1.0))
    assert ok.status_code == 200, ok.text
    assert ok.json()["outputs"][0]["data"] == [0.0] * 12
    answers: dict[str, httpx.Response] = {}

    def send(key: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        answers[key] = _post(server, NONFINITE, body, headers)

    # At once, so they may share a batch: only the requests whose own rows are bad fail.
    binary_out = json.dumps(
        {
            "inputs": [{"name": IN, "shape": [1, 3, 2, 2], "datatype": "FP32", "data": [-1.0] * 12}],
            "outputs": [{"name": OUT, "parameters": {"binary_data": True}}],
        }
    ).encode()
    jobs = {
        "-inf": (_pixels(0.0),),
        "nan": (_pixels(-1.0),),
        "one row of two": (_pixels(1.0, -1.0),),
        "binary answer": (binary_out,),
        "classification": (
            json.dumps(
                {
                    "inputs": [{"name": IN, "shape": [1, 3, 2, 2], "datatype": "FP32", "data": [0.0] * 12}],
                    "outputs": [{"name": OUT, "parameters": {"classification": 3}}],
                }
            ).encode(),
        ),
        "good": (_pixels(np.e),),
    }
    threads = [threading.Thread(target=send, args=(k, *v)) for k, v in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert answers["good"].status_code == 200, answers["good"].text
    np.testing.assert_allclose(answers["good"].json()["outputs"][0]["data"], [1.0] * 12, rtol=1e-6)
    for key in ("-inf", "nan", "one row of two", "binary answer", "classification"):
        r = answers[key]
        assert r.status_code == 500, (key, r.status_code, r.text)
        assert r.headers["content-type"] == "application/json"
        error = r.json()["error"]
        assert error.startswith(_nonfinite_error(NONFINITE)), error
        assert "a non-finite answer is never sent (error id " in error
    # The image endpoint: a black image is log(0) = -inf everywhere.
    png = io.BytesIO()
    Image.new("RGB", (2, 2)).save(png, "PNG")
    r = httpx.post(f"{server.url}/v2/models/{NONFINITE}/classify", content=png.getvalue(), timeout=60)
    assert r.status_code == 500 and r.json()["error"].startswith(_nonfinite_error(NONFINITE)), r.text
    white = io.BytesIO()
    Image.new("RGB", (2, 2), (255, 255, 255)).save(white, "PNG")
    r = httpx.post(f"{server.url}/v2/models/{NONFINITE}/classify", content=white.getvalue(), timeout=60)
    assert r.status_code == 200, r.text

    after = httpx.get(f"{server.url}/metrics").text

    def grew(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("visionloop_serve_errors_total", model=NONFINITE, code="500") == 6
    assert (
        grew("visionloop_serve_rejected_total", model=NONFINITE, version="1", reason="non_finite_output") == 6
    )
    assert grew("visionloop_serve_requests_total", model=NONFINITE) == 3  # ok, good, white
    # The prediction log holds the three answers and nothing of the six failures.
    state.predlog.flush()
    records = [json.loads(line) for line in state.predlog.path.read_text().splitlines()]
    mine = [rec for rec in records if rec["model"] == NONFINITE]
    assert len(mine) == 3, mine
    assert all(rec["confidence"] is not None for rec in mine)


def test_a_challenger_answering_nan_in_the_shadow_is_counted_not_answered(server: BackgroundServer) -> None:
    before = httpx.get(f"{server.url}/metrics").text
    r = _post(server, SHADOWED, _pixels(0.0))  # champion: zeros; challenger: log(0) = -inf
    assert r.status_code == 200, r.text
    assert r.json()["model_version"] == "1" and r.json()["outputs"][0]["data"] == [0.0] * 12
    state = server.app.state.server
    for _ in range(200):  # the shadow comparison runs after the answer
        text = httpx.get(f"{server.url}/metrics").text
        if metric(text, "visionloop_serve_rejected_total", model=SHADOWED, version="2") > metric(
            before, "visionloop_serve_rejected_total", model=SHADOWED, version="2"
        ):
            break
        threading.Event().wait(0.05)
    assert (
        metric(
            text, "visionloop_serve_rejected_total", model=SHADOWED, version="2", reason="non_finite_output"
        )
        - metric(
            before, "visionloop_serve_rejected_total", model=SHADOWED, version="2", reason="non_finite_output"
        )
        == 1
    )
    assert metric(text, "visionloop_serve_shadow_dropped_total", model=SHADOWED) >= 1
    assert metric(text, "visionloop_serve_shadow_comparisons_total", model=SHADOWED) == 0
    state.predlog.flush()
    records = [json.loads(line) for line in state.predlog.path.read_text().splitlines()]
    assert [rec["version"] for rec in records if rec["model"] == SHADOWED] == [1]
