"""The Open Inference Protocol (KServe v2) inference response, with Triton's binary tensor
data and classification extensions: outputs as JSON `data` or, when asked, as raw bytes after
the JSON header; `parameters.classification: K` as the top K "score:index:label" strings. And
what encoding one costs, so the server can keep large ones off its event loop.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from visionloop.serve.protocol import RequestedOutput
from visionloop.serve.runtime import DATATYPES


def _classification(scores: npt.NDArray[Any], k: int, labels: list[str] | None) -> npt.NDArray[np.object_]:
    """Triton's classification extension: per row, the top k as b"score:index[:label]"."""
    flat = scores.reshape(scores.shape[0], -1).astype(np.float32)
    k = min(k, flat.shape[1])
    top = np.argsort(-flat, axis=1, kind="stable")[:, :k]
    out = np.empty((flat.shape[0], k), dtype=object)
    for r in range(flat.shape[0]):
        for c, idx in enumerate(top[r]):
            label = f":{labels[idx]}" if labels and idx < len(labels) else ""
            out[r, c] = f"{flat[r, idx]:f}:{idx}{label}".encode()
    return out


def _bytes_tensor(arr: npt.NDArray[np.object_]) -> bytes:
    return b"".join(struct.pack("<I", len(b)) + b for b in arr.ravel())


_DATATYPE_OF = {v: k for k, v in DATATYPES.items()}

# What encoding costs, per output, in the bytes of a JSON FP32 tensor that cost as much (5.5 ns
# each, orjson writing numpy floats, measured on a dev box): raw bytes after the header are
# copied (~1/100 of that: 4 MiB in 0.2 ms); a classification output sorts every row (about
# twice a JSON tensor of its scores) and formats each of its top-k strings in Python (~0.9 us,
# ~160 such bytes).
_BINARY_DISCOUNT = 64
_CLASS_ENTRY_BYTES = 160


def encode_cost(results: Mapping[str, npt.NDArray[Any]], requested: list[RequestedOutput]) -> int:
    """An estimate of `encode_infer_response`'s work, from the outputs' sizes (nbytes), in
    bytes of a JSON FP32 tensor: the server encodes on the event loop below a threshold and in
    a worker thread above it."""
    total = 0
    for r in requested:
        arr = results[r.name]
        # JSON costs per element whatever its width (an INT8 costs about what an FP32 does).
        as_json = max(arr.nbytes, 4 * arr.size)
        if r.classification:
            rows = arr.shape[0] if arr.ndim else 1
            per_row = arr.size // rows if rows else 0
            total += 2 * as_json + _CLASS_ENTRY_BYTES * rows * min(r.classification, per_row)
        elif r.binary:
            total += arr.nbytes // _BINARY_DISCOUNT
        else:
            total += as_json
    return total


def encode_infer_response(
    model_name: str,
    model_version: int,
    request_id: str | None,
    results: dict[str, npt.NDArray[Any]],
    requested: list[RequestedOutput],
    labels: list[str] | None = None,
) -> tuple[bytes, int | None]:
    """The response body and, when binary outputs follow the JSON, the JSON header length."""
    outs: list[dict[str, Any]] = []
    blobs: list[bytes] = []
    for r in requested:
        arr = results[r.name]
        if r.classification:
            cls = _classification(arr, r.classification, labels)
            shape, datatype = list(cls.shape), "BYTES"
            if r.binary:
                blob = _bytes_tensor(cls)
            else:
                data: Any = [b.decode() for b in cls.ravel()]
        else:
            shape, datatype = list(arr.shape), _DATATYPE_OF[arr.dtype]
            if r.binary:
                blob = np.ascontiguousarray(arr).tobytes()
            else:
                data = arr.ravel()
        o: dict[str, Any] = {"name": r.name, "datatype": datatype, "shape": shape}
        if r.binary:
            o["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            o["data"] = data
        outs.append(o)
    doc: dict[str, Any] = {"model_name": model_name, "model_version": str(model_version), "outputs": outs}
    if request_id is not None:
        doc["id"] = request_id
    header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)
