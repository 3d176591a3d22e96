"""The things a sweep times: eager PyTorch and ONNX Runtime sessions, on CPU or CUDA.

A runner takes a float32 batch as numpy (N, C, H, W) and does two jobs:
- `prepare(batch)` puts the batch where the model reads it (device memory on CUDA) and returns
  a zero-argument call that runs the model once and *returns only when the result is done*.
  That call is what gets timed: CUDA kernels are asynchronous, so eager CUDA ends with
  `torch.cuda.synchronize()`; ONNX Runtime with io binding ends with `synchronize_outputs()`;
  ONNX Runtime's plain `run` and CPU PyTorch are synchronous on return.
- `predict(batch)` returns every output of the model on the host, in the model's output order
  (the task's `output_names`: logits; or boxes, scores, labels), for the task's gate metric.
  Floating outputs come back as float32; integer ones (a detector's labels) keep their type.

Latency is therefore the compute of one batch already in device memory, as timm's benchmark
measures it; copying a request to the device is the server's cost, not the model's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from visionloop.bench.memory import DeviceFreeMeter, PeakMeter, RssMeter, TorchCudaMeter

if TYPE_CHECKING:
    from visionloop.models.card import ModelCard


class SkippedError(Exception):
    """This configuration cannot run here (no GPU, no CUDA provider, unsupported precision):
    a "skipped" row with this message, not a failure."""


class Runner(Protocol):
    provider: str
    meter: PeakMeter

    def prepare(self, batch: np.ndarray) -> Callable[[], object]: ...

    def predict(self, batch: np.ndarray) -> list[np.ndarray]: ...


def _host(out: np.ndarray) -> np.ndarray:
    """A runner's output as the scorer reads it: floating point as float32, integers as they are."""
    out = np.asarray(out)
    return out.astype(np.float32, copy=False) if np.issubdtype(out.dtype, np.floating) else out


def cuda_available() -> tuple[bool, str]:
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA GPU on this machine (torch.cuda.is_available() is False)"
    return True, ""


def _meter(device: str, *, torch_allocator: bool) -> PeakMeter:
    if device == "cpu":
        return RssMeter()
    return TorchCudaMeter() if torch_allocator else DeviceFreeMeter()


class TorchRunner:
    """Eager PyTorch from the card and final weights, in eval mode under inference_mode: the
    module the task exports (`task.export_module(task.load_model(card, weights))`), so its
    outputs line up one for one with the ONNX model's.

    `weights` is a file, safetensors bytes, or a function that reads them (a registered
    version's `verified_weights_bytes`), called once the memory baseline is taken: the bytes it
    reads and frees count as the model's load, as a file's read does; bytes read before the
    baseline and freed after would hide the model's own memory from the measurement."""

    def __init__(
        self,
        card: ModelCard,
        weights: Path | bytes | Callable[[], bytes],
        *,
        precision: str,
        device: str,
    ) -> None:
        import torch

        if precision == "int8":
            raise SkippedError("int8 is an ONNX Runtime quantized export; eager pytorch runs fp32 or fp16")
        if device == "cpu" and precision == "fp16":
            raise SkippedError("eager fp16 on CPU is emulated and slower than fp32; use onnx fp16 or cuda")
        self.meter = _meter(device, torch_allocator=True)
        self.device = torch.device(device)
        self.dtype = torch.float16 if precision == "fp16" else torch.float32
        from visionloop.tasks import get_task

        task = get_task(card.task)
        source = weights() if callable(weights) else weights
        model = task.export_module(task.load_model(card, source)).eval().to(self.device, self.dtype)
        del source
        self.model = model
        self.provider = "torch-cuda" if device == "cuda" else "torch-cpu"

    def _sync(self) -> None:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)  # kernels are async: wait before reading the clock

    def prepare(self, batch: np.ndarray) -> Callable[[], object]:
        import torch

        x = torch.from_numpy(batch).to(self.device, self.dtype)
        self._sync()

        def call() -> object:
            with torch.inference_mode():
                out = self.model(x)
            self._sync()
            return out

        return call

    def predict(self, batch: np.ndarray) -> list[np.ndarray]:
        import torch

        with torch.inference_mode():
            out = self.model(torch.from_numpy(batch).to(self.device, self.dtype))
        outs = list(out) if isinstance(out, tuple | list) else [out]
        return [_host((o.float() if o.is_floating_point() else o).cpu().numpy()) for o in outs]


_ORT_PROVIDER = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


class OrtRunner:
    """An ONNX Runtime session on one provider; fails rather than silently falling back to CPU.

    With `data`, the session is built from those bytes (an export's, checked against the sha256
    its gate recorded: `read_passing_export`), so the file cannot be swapped between that check
    and the load; `path` then only names the model. Without, ORT reads `path`."""

    def __init__(
        self, path: Path, *, device: str, threads: int | None = None, data: bytes | None = None
    ) -> None:
        import onnxruntime as ort

        wanted = _ORT_PROVIDER[device]
        if wanted not in ort.get_available_providers():
            raise SkippedError(
                f"this ONNX Runtime has no {wanted} (has {', '.join(ort.get_available_providers())}); "
                "install onnxruntime-gpu for cuda"
            )
        self.meter = _meter(device, torch_allocator=False)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3  # ORT warns about unused initialisers etc. on every load
        if threads is not None:
            opts.intra_op_num_threads = threads
        providers = [wanted] if device == "cpu" else [wanted, "CPUExecutionProvider"]
        source = str(path) if data is None else data
        self.session = ort.InferenceSession(source, sess_options=opts, providers=providers)
        got = self.session.get_providers()
        if not got or got[0] != wanted:
            raise RuntimeError(
                f"ONNX Runtime did not enable {wanted} (got {got}); check the CUDA/cuDNN install"
            )
        self.provider = wanted
        self.device = device
        inp = self.session.get_inputs()[0]
        self.input_name: str = inp.name
        # Every output, in the model's order (a detector has three).
        self.output_names: list[str] = [o.name for o in self.session.get_outputs()]
        # An fp16 ONNX file from elsewhere may take fp16 inputs (ours keep fp32 IO).
        self.input_dtype: Any = np.float16 if inp.type == "tensor(float16)" else np.float32

    def prepare(self, batch: np.ndarray) -> Callable[[], object]:
        x = np.ascontiguousarray(batch, dtype=self.input_dtype)
        if self.device == "cpu":
            feed = {self.input_name: x}
            return lambda: self.session.run(self.output_names, feed)
        import onnxruntime as ort

        # io binding: the input lives in device memory and the output stays there, so a call
        # times the model, not two PCIe copies; synchronize_outputs waits for the stream.
        value = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
        binding = self.session.io_binding()
        binding.bind_ortvalue_input(self.input_name, value)
        for name in self.output_names:
            binding.bind_output(name, "cuda", 0)

        def call() -> object:
            self.session.run_with_iobinding(binding)
            binding.synchronize_outputs()
            return value  # keeps the device input alive as long as the call

        return call

    def predict(self, batch: np.ndarray) -> list[np.ndarray]:
        x = np.ascontiguousarray(batch, dtype=self.input_dtype)
        return [_host(o) for o in self.session.run(self.output_names, {self.input_name: x})]
