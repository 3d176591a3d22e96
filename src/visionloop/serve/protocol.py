"""The Open Inference Protocol (KServe v2) inference request, with Triton's binary tensor data
extension, as `tritonclient.http` speaks it. The response is `serve.response`'s.

A request body is JSON, or — when the `Inference-Header-Content-Length: N` header is present —
N bytes of JSON followed by the raw bytes of every input whose `parameters.binary_data_size`
is set, in input order. Outputs come back as JSON `data` or, when asked (`binary_data` on an
output or `binary_data_output` on the request), as raw bytes after the JSON header. The
classification extension (`parameters.classification: K` on an output) returns the top K as
"score:index:label" strings.

Every check here turns a client's mistake into a `ProtocolError` (4xx) naming the problem; a
request that passes has tensors of exactly the model's shape and datatype, holding exactly the
values sent: JSON `data` of a datatype holds only that datatype's JSON values (true/false for
BOOL; whole numbers in range, never floats or booleans, for the integer types; finite numbers
that fit, never booleans, for FP16/FP32/FP64), and binary data holds only finite floats and
0/1 bools. Nothing is rounded, truncated, wrapped or overflowed to infinity on the way in.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from visionloop.serve import fastjson
from visionloop.serve.runtime import DATATYPES, TensorSpec

HEADER_LENGTH = "inference-header-content-length"


class ProtocolError(Exception):
    """A client error: answered with `status` and the body {"error": message}."""

    def __init__(self, message: str, status: int = 400, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool
    classification: int  # 0 = the tensor itself


@dataclass(frozen=True)
class InferRequest:
    id: str | None
    feeds: dict[str, npt.NDArray[Any]]
    rows: int
    outputs: list[RequestedOutput]
    image: Mapping[str, float] | None = None  # an image request's statistics, for the prediction log


def _obj(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"{what} must be a JSON object, got {type(value).__name__}")
    return value


def _params(d: dict[str, Any], what: str) -> dict[str, Any]:
    p = d.get("parameters")
    return {} if p is None else _obj(p, f"{what}.parameters")


def parse_header_length(value: str | None, body_len: int) -> int | None:
    if value is None:
        return None
    try:
        n = int(value)
    except ValueError:
        raise ProtocolError(
            f"Inference-Header-Content-Length must be a whole number, got {value!r}"
        ) from None
    if not 0 < n <= body_len:
        raise ProtocolError(
            f"Inference-Header-Content-Length is {n}, but the body has {body_len} bytes; it must give the "
            "length of the JSON header at the start of the body"
        )
    return n


def parse_infer_request(
    body: bytes,
    header_length: int | None,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    max_rows: int,
    fast: bool = True,
) -> InferRequest:
    """The request in `body` checked against the model's tensors. `fast` reads the float
    inputs' JSON data through simdjson (serve/fastjson.py) where it can: the same request, the
    same errors, ~4× less time on a 224 px JSON image; False only to compare the two paths."""
    header = body if header_length is None else body[:header_length]
    if fast:
        floats = {t.name: t.dtype for t in inputs if t.dtype.kind == "f"}
        doc = fastjson.read(header, floats) if floats else None
        if doc is not None:
            return _parse_doc(doc, body, header_length, inputs, outputs, max_rows)
    try:
        doc = orjson.loads(header)
    except orjson.JSONDecodeError as e:
        not_json = ProtocolError(f"the request body is not valid JSON: {e}")
        lenient = _lenient_json(header, e)
        if lenient is None:
            raise not_json from None
        # The same checks on what the body says: a ProtocolError naming the input whose data
        # holds NaN, Infinity or an overflowing number. Passing them proves nothing: the body
        # is still not JSON.
        _parse_doc(lenient, body, header_length, inputs, outputs, max_rows)
        raise not_json from None
    return _parse_doc(doc, body, header_length, inputs, outputs, max_rows)


# NaN, Infinity and -Infinity are not JSON, but Python's json.dumps writes them (allow_nan is
# its default): to name the input holding one, the error path reads them as these strings,
# which no JSON number or ordinary string is, and _bad_value reads them back as floats.
_NONFINITE = {"\x00nan": math.nan, "\x00+inf": math.inf, "\x00-inf": -math.inf}
_NUMBER = re.compile(r"-?[0-9][0-9.eE+-]*")
# Numbers too large for a double (1e400), rewritten one at a time: each costs one more parse.
_MAX_HUGE_NUMBERS = 3


def _lenient_json(header: bytes, error: orjson.JSONDecodeError) -> Any:
    """The header read with NaN, Infinity, -Infinity and numbers too large for a double as
    markers (see _NONFINITE), when orjson refused it over such a value; else None. Only to
    name the input that holds the value, never served. Costs orjson parses of the header: one
    for any number of NaN and Infinity literals, one more per number past a double (at most
    _MAX_HUGE_NUMBERS), so the error path stays bounded as a good request's parse is."""
    if "infinity" not in error.msg and b"NaN" not in header and b"Infinity" not in header:
        return None
    try:
        text = header.decode("utf-8")
    except UnicodeDecodeError:
        return None
    # (inside a string, a replaced literal breaks the JSON: then there is no better message)
    text = text.replace("-Infinity", '"\\u0000-inf"').replace("Infinity", '"\\u0000+inf"')
    text = text.replace("NaN", '"\\u0000nan"')
    for _ in range(_MAX_HUGE_NUMBERS + 1):
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError as e:
            number = _NUMBER.match(text, e.pos) if "infinity" in e.msg else None
            if number is None:
                return None
            marker = '"\\u0000-inf"' if number.group().startswith("-") else '"\\u0000+inf"'
            text = text[: number.start()] + marker + text[number.end() :]
    return None


def _parse_doc(
    doc: Any,
    body: bytes,
    header_length: int | None,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    max_rows: int,
) -> InferRequest:
    doc = _obj(doc, "the inference request")
    rid = doc.get("id")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError(f"id must be a string, got {rid!r}")
    req_params = _params(doc, "the request")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise ProtocolError(
            'the request needs "inputs": a list of tensors, e.g. {"inputs": [{"name": "'
            f'{inputs[0].name}", "shape": {_example_shape(inputs[0])}, "datatype": "{inputs[0].datatype}", '
            '"data": [...]}]}'
        )
    by_name = {t.name: t for t in inputs}
    feeds: dict[str, npt.NDArray[Any]] = {}
    rows: int | None = None
    offset = header_length or 0
    for i, raw in enumerate(raw_inputs):
        t = _obj(raw, f"inputs[{i}]")
        name = t.get("name")
        spec = by_name.get(name) if isinstance(name, str) else None
        if spec is None or not isinstance(name, str):
            raise ProtocolError(
                f"inputs[{i}]: the model has no input {name!r}; its inputs are {sorted(by_name)}"
            )
        if name in feeds:
            raise ProtocolError(f"input {name!r} is given twice")
        shape = _check_shape(t.get("shape"), spec, max_rows)
        datatype = t.get("datatype")
        if datatype != spec.datatype:
            raise ProtocolError(f"input {name!r} must have datatype {spec.datatype}, got {datatype!r}")
        count = math.prod(shape)
        size = _params(t, f"input {name!r}").get("binary_data_size")
        if size is not None:
            if header_length is None:
                raise ProtocolError(
                    f"input {name!r} has binary_data_size but the request has no "
                    "Inference-Header-Content-Length header"
                )
            if t.get("data") is not None:
                raise ProtocolError(
                    f"input {name!r} has both binary_data_size and data; send its values one way"
                )
            if not isinstance(size, int) or isinstance(size, bool) or size != count * spec.dtype.itemsize:
                raise ProtocolError(
                    f"input {name!r} declares {spec.datatype} in shape {list(shape)}, "
                    f"{count * spec.dtype.itemsize} bytes, but its binary_data_size {size!r} does not match"
                )
            if offset + size > len(body):
                raise ProtocolError(
                    f"input {name!r}: the body ends {offset + size - len(body)} bytes before its "
                    "binary data does"
                )
            arr = np.frombuffer(body, dtype=spec.dtype, count=count, offset=offset)
            _check_binary(arr, spec)
            arr = arr.reshape(shape)
            offset += size
        else:
            arr = _from_json(t.get("data"), spec, shape)
        feeds[name] = arr
        if rows is not None and shape[0] != rows:
            raise ProtocolError(
                f"all inputs must have the same batch size; {name!r} has {shape[0]}, not {rows}"
            )
        rows = shape[0]
    if offset != len(body) and header_length is not None:
        raise ProtocolError(
            f"the body has {len(body) - offset} bytes after the last binary input; the JSON header's "
            "binary_data_size values must add up to the bytes after it"
        )
    missing = sorted(set(by_name) - set(feeds))
    if missing:
        raise ProtocolError(f"inputs {missing} are missing; the model needs {sorted(by_name)}")
    assert rows is not None
    return InferRequest(rid, feeds, rows, _requested_outputs(doc, req_params, outputs))


def _example_shape(spec: TensorSpec) -> list[int]:
    return [1, *(d if d > 0 else 1 for d in spec.shape[1:])]


def _check_shape(shape: Any, spec: TensorSpec, max_rows: int) -> tuple[int, ...]:
    if (
        not isinstance(shape, list)
        or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
        or len(shape) != len(spec.shape)
    ):
        raise ProtocolError(
            f"input {spec.name!r}: shape must be a list of {len(spec.shape)} whole numbers like "
            f"{_example_shape(spec)} (batch first), got {shape!r}"
        )
    if not 1 <= shape[0] <= max_rows:
        raise ProtocolError(
            f"input {spec.name!r}: the batch dimension must be 1 to {max_rows}, got {shape[0]}"
        )
    for got, want in zip(shape[1:], spec.shape[1:], strict=True):
        if (want >= 0 and got != want) or got < 1 or got > 65536:
            raise ProtocolError(
                f"input {spec.name!r}: shape {shape} does not fit the model's {list(spec.shape)} "
                "(-1 is the batch dimension)"
            )
    return tuple(shape)


# JSON `data` is checked and converted this many values at a time: each slice is one short C
# call (about 0.3 ms), so a parse running in a worker thread lets the event loop in between.
_SLICE = 65536

# The Python types of the JSON values each datatype takes: JSON true/false for BOOL, whole
# numbers (never 3.0 or true) for the integer types, numbers (never true) for the floats.
_JSON_TYPES: dict[str, frozenset[type]] = {
    dt: frozenset({bool} if d.kind == "b" else {int} if d.kind in "iu" else {int, float})
    for dt, d in DATATYPES.items()
}


def _takes(spec: TensorSpec) -> str:
    """What `spec`'s datatype takes, for error messages."""
    d = spec.dtype
    if d.kind == "b":
        return "true or false"
    if d.kind in "iu":
        info = np.iinfo(d)
        return f"whole numbers from {info.min} to {info.max}"
    return f"finite numbers from -{float(np.finfo(d).max):g} to {float(np.finfo(d).max):g}"


def _show(value: Any) -> str:
    """A JSON value as an error message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({'true' if value else 'false'})"
    if isinstance(value, str):
        text = value if len(value) <= 20 else value[:20] + "..."
        return f"a string ({text!r})"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return repr(value)


def _bad_value(spec: TensorSpec, index: int, value: Any) -> ProtocolError:
    """The error for element `index` of an input's JSON data, which is `value`."""
    dt, d = spec.datatype, spec.dtype
    if type(value) is str and value in _NONFINITE:  # a NaN or Infinity literal (_lenient_json)
        value = _NONFINITE[value]
    if d.kind in "iu" and type(value) is float and math.isfinite(value):
        info = np.iinfo(d)
        if not value.is_integer():
            why = ", not a whole number"
        elif info.min <= value <= info.max and abs(value) < 2**63:
            # (orjson reads an integer literal past 64 bits as a float: those are out of range)
            why = f", written as a float (send {int(value)})"
        else:
            why = f", outside {dt}'s range"
    elif type(value) in _JSON_TYPES[dt]:  # a value of the right kind that does not fit
        if type(value) is float and not math.isfinite(value):
            why = ", not a finite number"
        elif d.kind in "iu":
            why = f", outside {dt}'s range"
        else:
            why = f", too large for {dt}"
    else:
        why = ", not " + (
            "true or false" if d.kind == "b" else "a whole number" if d.kind in "iu" else "a number"
        )
    return ProtocolError(
        f"input {spec.name!r} declares {dt} but element {index} is {_show(value)}{why}; {dt} takes "
        f"{_takes(spec)}, as one flat list in row-major order or nested exactly as the shape"
    )


def _from_json(data: Any, spec: TensorSpec, shape: tuple[int, ...]) -> npt.NDArray[Any]:
    """A JSON list → the tensor: flat in row-major order, or nested exactly as `shape` is.
    Structure, types and length are checked before numpy sees the list (np.asarray on 23 MB
    of nested lists took 4.4 s holding the GIL), in slices, so a worker thread running this
    lets the event loop in between. Range and finiteness are checked on the converted array
    (numpy refuses an out-of-range integer; a float that overflows its datatype becomes an
    infinity, found by one vectorised pass), so a good request pays no Python loop per value;
    a bad one pays one over the slice that holds its first bad value."""
    if isinstance(data, fastjson.Floats):  # flat, numbers only, cast and finite: count it
        if len(data.values) != math.prod(shape):
            raise ProtocolError(
                f"input {spec.name!r}: data has {len(data.values)} values, shape {list(shape)} "
                f"needs {math.prod(shape)}"
            )
        return data.values.reshape(shape)
    if not isinstance(data, list):
        raise ProtocolError(
            f'input {spec.name!r} declares {spec.datatype}: it needs "data" (a list of {_takes(spec)}) '
            "or binary data"
        )
    data = _flatten(data, spec, shape)
    allowed = _JSON_TYPES[spec.datatype]
    for i in range(0, len(data), _SLICE):
        chunk = data[i : i + _SLICE]
        if not set(map(type, chunk)) <= allowed:
            j = next(j for j, v in enumerate(chunk) if type(v) not in allowed)
            raise _bad_value(spec, i + j, chunk[j])
    count = math.prod(shape)
    if len(data) != count:
        raise ProtocolError(
            f"input {spec.name!r}: data has {len(data)} values, shape {list(shape)} needs {count}"
        )
    arr = np.empty(count, dtype=spec.dtype)
    # An FP32 value past float32's range becomes inf here (found below), not a warning.
    with np.errstate(over="ignore"):
        for i in range(0, count, _SLICE):
            chunk = data[i : i + _SLICE]
            try:
                arr[i : i + _SLICE] = chunk
            except (ValueError, TypeError, OverflowError):
                # An integer outside the datatype's range (or, for a float datatype, an int
                # past float64's): find which, in this slice only.
                j = _first_unconvertible(chunk, spec.dtype)
                raise _bad_value(spec, i + j, chunk[j]) from None
    if spec.dtype.kind == "f":
        finite = np.isfinite(arr)
        if not finite.all():
            k = int(np.argmin(finite))
            raise _bad_value(spec, k, data[k])
    return arr.reshape(shape)


def _first_unconvertible(chunk: list[Any], dtype: np.dtype[Any]) -> int:
    one = np.empty(1, dtype=dtype)
    for j, v in enumerate(chunk):
        try:
            one[0] = v
        except (ValueError, TypeError, OverflowError):
            return j
    return 0  # not reached: numpy refused one of them


def _check_binary(arr: npt.NDArray[Any], spec: TensorSpec) -> None:
    """Binary data of any bytes is a valid integer tensor; a float tensor must be finite (JSON
    could not even carry NaN or Infinity, and a model fed one answers NaN) and a BOOL tensor
    must hold bytes 0 and 1 only (other bytes are no bool: numpy and ONNX Runtime give them no
    defined meaning)."""
    kind = spec.dtype.kind
    if kind == "f":
        finite = np.isfinite(arr)
        if not finite.all():
            k = int(np.argmin(finite))
            raise ProtocolError(
                f"input {spec.name!r} declares {spec.datatype} but element {k} of its binary data is "
                f"{_show(float(arr[k]))}; {spec.datatype} takes {_takes(spec)}"
            )
    elif kind == "b":
        raw = arr.view(np.uint8)
        if (raw > 1).any():
            k = int(np.argmax(raw > 1))
            raise ProtocolError(
                f"input {spec.name!r} declares BOOL but byte {k} of its binary data is {int(raw[k])}; "
                "BOOL takes one byte per value, 0 (false) or 1 (true)"
            )


def _flatten(data: list[Any], spec: TensorSpec, shape: tuple[int, ...]) -> list[Any]:
    """Nested `data` flattened one level at a time, each level checked to be exactly
    prod(shape[:k]) lists of shape[k] values; flat `data` as it is."""
    values = data
    for k in range(1, len(shape)):
        if not values or type(values[0]) is not list:
            break
        rows, width = math.prod(shape[:k]), shape[k]
        if len(values) != rows or any(
            set(map(type, values[i : i + _SLICE])) != {list}
            or set(map(len, values[i : i + _SLICE])) != {width}
            for i in range(0, rows, _SLICE)
        ):
            what = "values" if spec.dtype.kind == "b" else "numbers"
            raise ProtocolError(
                f"input {spec.name!r} declares {spec.datatype} in shape {list(shape)}, but its data is not "
                f"a list of {spec.datatype} {what} in that shape: nested lists must match the shape exactly "
                f"(level {k} should be {rows} lists of {width}); or send one flat list in row-major order"
            )
        flat: list[Any] = []
        for i in range(0, rows, _SLICE):
            flat.extend(itertools.chain.from_iterable(values[i : i + _SLICE]))
        values = flat
    return values


def _requested_outputs(
    doc: dict[str, Any], req_params: dict[str, Any], outputs: list[TensorSpec]
) -> list[RequestedOutput]:
    binary_default = req_params.get("binary_data_output") is True
    raw = doc.get("outputs")
    if raw is None:
        return [RequestedOutput(t.name, binary_default, 0) for t in outputs]
    if not isinstance(raw, list):
        raise ProtocolError('"outputs" must be a list of {"name": ...} objects')
    known = {t.name for t in outputs}
    result: list[RequestedOutput] = []
    for i, r in enumerate(raw):
        o = _obj(r, f"outputs[{i}]")
        name = o.get("name")
        if name not in known:
            raise ProtocolError(
                f"outputs[{i}]: the model has no output {name!r}; its outputs are {sorted(known)}"
            )
        if any(x.name == name for x in result):
            raise ProtocolError(f"output {name!r} is asked for twice")
        p = _params(o, f"output {name!r}")
        binary = p.get("binary_data", binary_default)
        k = p.get("classification", 0)
        if not isinstance(binary, bool):
            raise ProtocolError(f"output {name!r}: binary_data must be true or false")
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ProtocolError(f"output {name!r}: classification must be a whole number >= 0, got {k!r}")
        result.append(RequestedOutput(name, binary, k))
    return result
