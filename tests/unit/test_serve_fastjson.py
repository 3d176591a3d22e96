"""The simdjson shortcut for JSON tensor data answers exactly what the ordinary path does.

Every body below goes through `parse_infer_request` twice, `fast=True` and `fast=False`: the
same tensors (dtype, shape and bits), the same id and outputs, or the same error message. The
flat float bodies must also really take the shortcut (`fastjson.read` returns a document), so
the comparison is not between the ordinary path and itself.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from visionloop.serve import fastjson
from visionloop.serve.protocol import ProtocolError, parse_infer_request
from visionloop.serve.runtime import TensorSpec

IMAGE = TensorSpec("image", "FP32", (-1, 3, 2, 2))
HALF = TensorSpec("half", "FP16", (-1, 2))
WIDE = TensorSpec("wide", "FP64", (-1, 2))
COUNT = TensorSpec("count", "INT64", (-1, 2))
OUT = [TensorSpec("logits", "FP32", (-1, 10))]


def outcome(body: bytes, inputs: list[TensorSpec], fast: bool, header_length: int | None = None) -> Any:
    try:
        req = parse_infer_request(body, header_length, inputs, OUT, 8, fast=fast)
    except ProtocolError as e:
        return ("error", e.status, str(e))
    feeds = {
        k: (v.dtype.str, v.shape, np.ascontiguousarray(v).tobytes()) for k, v in sorted(req.feeds.items())
    }
    return ("ok", req.id, req.rows, feeds, req.outputs)


def same(body: bytes, inputs: list[TensorSpec] | None = None, header_length: int | None = None) -> Any:
    inputs = inputs or [IMAGE]
    fast = outcome(body, inputs, True, header_length)
    assert fast == outcome(body, inputs, False, header_length)
    return fast


def tensor(name: str, shape: list[int], datatype: str, data: Any) -> dict[str, Any]:
    return {"name": name, "shape": shape, "datatype": datatype, "data": data}


def body(*tensors: dict[str, Any], **extra: Any) -> bytes:
    return orjson.dumps({"inputs": list(tensors), **extra})


def floats(n: int, seed: int = 0) -> list[float]:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32).astype(float).tolist()


def test_a_flat_float_image_takes_the_shortcut_and_holds_the_values_sent() -> None:
    values = floats(24)
    b = body(tensor("image", [2, 3, 2, 2], "FP32", values), id="r1")
    doc = fastjson.read(b, {"image": np.dtype(np.float32)})
    assert doc is not None and isinstance(doc["inputs"][0]["data"], fastjson.Floats)
    kind, rid, rows, feeds, _ = same(b)
    assert (kind, rid, rows) == ("ok", "r1", 2)
    assert feeds["image"][1] == (2, 3, 2, 2)
    assert np.frombuffer(feeds["image"][2], np.float32).tolist() == values


@pytest.mark.parametrize(
    "data",
    [
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],  # whole numbers in a float input
        [0.5] * 11 + [-0.0],
        [1e-45] * 12,  # float32's smallest subnormal
        [3.4028234663852886e38] * 12,  # float32's largest
        [18446744073709551615] + [0.0] * 11,  # uint64's largest, a whole number
    ],
)
def test_numbers_the_shortcut_reads_come_out_as_the_ordinary_path_reads_them(data: list[Any]) -> None:
    b = body(tensor("image", [1, 3, 2, 2], "FP32", data))
    assert fastjson.read(b, {"image": np.dtype(np.float32)}) is not None
    assert same(b)[0] == "ok"


BAD_OR_ODD = [
    # not numbers, or numbers that do not fit
    body(tensor("image", [1, 3, 2, 2], "FP32", [True] + [0.0] * 11)),
    body(tensor("image", [1, 3, 2, 2], "FP32", [None] + [0.0] * 11)),
    body(tensor("image", [1, 3, 2, 2], "FP32", ["1"] + [0.0] * 11)),
    body(tensor("image", [1, 3, 2, 2], "FP32", [1e39] + [0.0] * 11)),
    body(tensor("image", [1, 3, 2, 2], "FP32", [{"a": [1.0]}] + [0.0] * 11)),
    b'{"inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32","data":[NaN,0,0,0,0,0,0,0,0,0,0,0]}]}',
    b'{"inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32","data":[1e400,0,0,0,0,0,0,0,0,0,0,0]}]}',
    b'{"inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32",'
    b'"data":[123456789012345678901234567890,0,0,0,0,0,0,0,0,0,0,0]}]}',
    b'{"inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32","data":[01,0,0,0,0,0,0,0,0,0,0,0]}]}',
    b'{"inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32","data":[1.,0,0,0,0,0,0,0,0,0,0,0]}]}',
    b'{"inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32","data":[0,0,0,0,0,0,0,0,0,0,0,0]} x',
    b'{"inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32","data":[-0,0,0,0,0,0,0,0,0,0,0,0]}]}',
    # counts and shapes
    body(tensor("image", [1, 3, 2, 2], "FP32", [0.0] * 11)),
    body(tensor("image", [2, 3, 2, 2], "FP32", [0.0] * 12)),
    body(tensor("image", [9, 3, 2, 2], "FP32", [0.0] * 108)),
    body(tensor("image", [1, 3, 2, 2], "FP32", [])),
    # nested: right, ragged, and mixed with numbers (simdjson would flatten them all)
    body(tensor("image", [1, 3, 2, 2], "FP32", [[[[1.0, 2.0], [3.0, 4.0]]] * 3])),
    body(tensor("image", [1, 3, 2, 2], "FP32", [[[[1.0, 2.0], [3.0]]] * 3 + [[[5.0, 6.0, 7.0]]]])),
    body(tensor("image", [1, 3, 2, 2], "FP32", [[1.0]] + [0.0] * 11)),
    body(tensor("image", [1, 3, 2, 2], "FP32", [[], [1.0] * 12])),
    # strings with brackets, escaped brackets, a "data" key inside a string
    body(tensor("image", [1, 3, 2, 2], "FP32", [0.0] * 12), id='[[["data": [1.0]'),
    b'{"id":"\\u005b","inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32",'
    b'"data":[[0,0,0,0,0,0,0,0,0,0,0],0]}]}',
    b'{"id":"\\u005B[","inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32",'
    b'"data":[0,0,0,0,0,0,0,0,0,0,0,0]}]}',
    # repeated keys: the last one counts, as orjson reads them
    b'{"inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32","data":[1,1,1,1,1,1,1,1,1,1,1,1],'
    b'"data":[2,2,2,2,2,2,2,2,2,2,2,2]}]}',
    b'{"inputs":[{"name":"nope","name":"image","shape":[1,3,2,2],"datatype":"FP32",'
    b'"data":[2,2,2,2,2,2,2,2,2,2,2,2]}]}',
    b'{"inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32","data":[1,1,1,1,1,1,1,1,1,1,1,1]}],'
    b'"inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32","data":[3,3,3,3,3,3,3,3,3,3,3,3]}]}',
    # a NUL in a key: simdjson's lookup of "data\u0000x" finds "data"
    b'{"inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32","data":[1,1,1,1,1,1,1,1,1,1,1,1],'
    b'"data\\u0000x":[[2]]}]}',
    b'{"zz\\u0000":[],"inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32",'
    b'"data":[1,1,1,1,1,1,1,1,1,1,1,1]}]}',
    b'{"inputs\\u0000":[],"inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32",'
    b'"data":[1,1,1,1,1,1,1,1,1,1,1,1]}]}',
    b'{"inputs":[{"name\\u0000":"x","name":"image","shape":[1,3,2,2],"datatype":"FP32",'
    b'"data":[1,1,1,1,1,1,1,1,1,1,1,1]}]}',
    # the wrong name, datatype, a data that is no list, both data and binary
    body(tensor("picture", [1, 3, 2, 2], "FP32", [0.0] * 12)),
    body(tensor("image", [1, 3, 2, 2], "FP16", [0.0] * 12)),
    body(tensor("image", [1, 3, 2, 2], "FP32", 1.0)),
    body(tensor("image", [1, 3, 2, 2], "FP32", [0.0] * 12) | {"parameters": {"binary_data_size": 48}}),
    body(
        tensor("image", [1, 3, 2, 2], "FP32", [0.0] * 12), tensor("image", [1, 3, 2, 2], "FP32", [0.0] * 12)
    ),
    # not an object, not UTF-8, empty
    b"[1.0, 2.0]",
    b'{"id":"\xff","inputs":[]}',
    b"",
    b'{"inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32","data":[0,0,0,0,0,0,0,0,0,0,0,0]}],'
    b'"outputs":[{"name":"logits","parameters":{"classification":3}}]}',
    b'{"inputs":[{"name":"image","shape":[1,3,2,2],"datatype":"FP32","data":[0,0,0,0,0,0,0,0,0,0,0,0]}],'
    b'"outputs":[{"name":"nope"}]}',
]


@pytest.mark.parametrize("b", BAD_OR_ODD, ids=range(len(BAD_OR_ODD)))
def test_odd_and_hostile_bodies_get_the_ordinary_answer(b: bytes) -> None:
    same(b)


def test_other_datatypes_and_several_inputs() -> None:
    several = [IMAGE, HALF, WIDE, COUNT]
    good = body(
        tensor("image", [1, 3, 2, 2], "FP32", floats(12)),
        tensor("half", [1, 2], "FP16", [65504.0, -6e-8]),
        tensor("wide", [1, 2], "FP64", [1e300, 5e-324]),
        tensor("count", [1, 2], "INT64", [-(2**63), 2**63 - 1]),
    )
    assert same(good, several)[0] == "ok"
    # an integer input is read the ordinary way; the float ones alone take the shortcut
    assert fastjson.read(good, {"image": np.dtype(np.float32)}) is None
    floats_only = body(
        tensor("image", [1, 3, 2, 2], "FP32", floats(12)), tensor("half", [1, 2], "FP16", [1.0, 2.0])
    )
    assert fastjson.read(floats_only, {"image": np.dtype(np.float32), "half": np.dtype(np.float16)})
    for spec, data, answer in (
        (HALF, [65520.0, 0.0], "error"),  # past float16's largest
        (HALF, [70000, 0], "error"),
        (HALF, [65504, -65504.0], "ok"),
        (WIDE, [1.7976931348623157e308, 0], "ok"),
    ):
        result = same(body(tensor(spec.name, [1, 2], spec.datatype, data)), [spec])
        assert result[0] == answer, result


def test_binary_inputs_beside_json_ones() -> None:
    header = orjson.dumps(
        {
            "inputs": [
                {
                    "name": "image",
                    "shape": [1, 3, 2, 2],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 48},
                },
                tensor("half", [1, 2], "FP16", [1.0, 2.0]),
            ]
        }
    )
    raw = np.arange(12, dtype=np.float32).tobytes()
    result = same(header + raw, [IMAGE, HALF], header_length=len(header))
    assert result[0] == "ok" and np.frombuffer(result[3]["image"][2], np.float32).tolist() == list(range(12))


def test_a_python_json_body_with_spaces_and_the_stdlib_float_repr() -> None:
    b = json.dumps({"inputs": [tensor("image", [1, 3, 2, 2], "FP32", floats(12, seed=3))]}, indent=2).encode()
    assert fastjson.read(b, {"image": np.dtype(np.float32)}) is not None
    assert same(b)[0] == "ok"


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    data=st.lists(
        st.floats(width=32, allow_nan=False) | st.integers(-(2**40), 2**40) | json_values, max_size=14
    ),
    shape=st.sampled_from([[1, 3, 2, 2], [1, 12], [2, 3, 2, 2], [1, 3, 2]]),
    extra=st.dictionaries(st.sampled_from(["id", "parameters", "outputs", "x["]), json_values, max_size=2),
)
def test_generated_bodies_get_the_same_answer_both_ways(
    data: list[Any], shape: list[int], extra: Any
) -> None:
    try:
        b = orjson.dumps({"inputs": [tensor("image", shape, "FP32", data)], **extra})
    except orjson.JSONEncodeError:  # an integer past 64 bits: orjson will not write it
        b = json.dumps({"inputs": [tensor("image", shape, "FP32", data)], **extra}).encode()
    same(b)
