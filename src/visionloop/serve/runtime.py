"""One ONNX Runtime session per served model version, and the tensor metadata it declares.

Sessions run in a worker thread (ORT releases the GIL while it computes), so the event loop
keeps parsing requests and forming the next batch while a batch runs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from visionloop.core.errors import VisionloopError

log = logging.getLogger(__name__)

# KServe v2 datatype ↔ numpy; ORT's element type strings ↔ KServe v2.
DATATYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
_ORT_TYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
}


class ModelLoadError(VisionloopError):
    """An ONNX file cannot be loaded or does not have a servable signature."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # KServe v2 name, e.g. FP32
    shape: tuple[int, ...]  # -1 for a dynamic dimension; the first is the batch

    @property
    def dtype(self) -> np.dtype[Any]:
        return DATATYPES[self.datatype]

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def _spec(arg: Any) -> TensorSpec:
    datatype = _ORT_TYPES.get(arg.type)
    if datatype is None:
        raise ModelLoadError(f"tensor {arg.name!r} has type {arg.type}, which the server cannot serve")
    shape = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in arg.shape)
    return TensorSpec(arg.name, datatype, shape)


def cuda_available() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers()


class OnnxModel:
    """An ORT inference session with a batch-first signature.

    With `data`, the session is built from those bytes and `path` only names the model in
    messages: a registry export's bytes, read once and checked against the sha256 its gate
    recorded (`ResolvedVersion.load`, `registry.export_record.read_passing_export`), so no
    other file can take its place between the check and the load. Without, ORT reads `path`
    itself (an ONNX file given directly, outside the registry)."""

    def __init__(
        self, path: Path, *, device: str = "cpu", intra_op_threads: int = 0, data: bytes | None = None
    ) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if intra_op_threads:
            opts.intra_op_num_threads = intra_op_threads
        # ORT's pool threads spin after each run by default; on a CPU shared with the event
        # loop that parses the next requests, the spinning takes the cores the loop needs.
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = ["CPUExecutionProvider"]
        if device == "cuda":
            if cuda_available():
                providers.insert(0, "CUDAExecutionProvider")
            else:
                log.warning("device cuda asked, but this onnxruntime has no CUDA provider: serving on CPU")
        try:
            source = str(path) if data is None else data
            self.session = ort.InferenceSession(source, sess_options=opts, providers=providers)
        except Exception as e:  # ORT raises its own exception types for unreadable or invalid files
            raise ModelLoadError(f"ONNX Runtime cannot load {path}: {e}. Re-export the model.") from e
        self.path = Path(path)
        self.providers: list[str] = list(self.session.get_providers())
        self.inputs = [_spec(a) for a in self.session.get_inputs()]
        self.outputs = [_spec(a) for a in self.session.get_outputs()]
        for t in (*self.inputs, *self.outputs):
            if not t.shape or t.shape[0] != -1:
                raise ModelLoadError(
                    f"{path}: tensor {t.name!r} has shape {list(t.shape)}; the server batches requests and "
                    "needs a dynamic first (batch) dimension. Export with a dynamic batch axis."
                )
        self._output_names = [t.name for t in self.outputs]

    def run(self, feeds: dict[str, npt.NDArray[Any]]) -> dict[str, npt.NDArray[Any]]:
        results = self.session.run(self._output_names, feeds)
        return dict(zip(self._output_names, results, strict=True))

    def warm_up(self) -> None:
        """One batch-1 inference of zeros, so the first request does not pay ORT's set-up."""
        feeds = {
            t.name: np.zeros(tuple(1 if d < 0 else d for d in t.shape), dtype=t.dtype) for t in self.inputs
        }
        self.run(feeds)
