"""PyTorch → ONNX (fp32), and the fp16 and int8 conversions of that graph.

Exporter choice: torch 2.14's `torch.onnx.export` defaults to the dynamo exporter. Both it and
the TorchScript exporter (`dynamo=False`) give a correct dynamic batch axis for small_cnn and
torchvision's CNNs (resnet18, mobilenet_v3_small checked to 1e-6 at batch 1 and 7), but the
TorchScript one does it 3-4x faster (resnet18: ~2 s against ~7 s on 2 cores) and from a plain
`dynamic_axes` mapping, without dynamo's shape constraints specialising a batch of 1. So
TorchScript is the default, and `exporter="dynamo"` is there for architectures it cannot trace.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from visionloop.export.report import ExportError

log = logging.getLogger(__name__)

INPUT_NAME = "input"
# What a bare `export_fp32` call names its one output; `export_model` names the outputs after
# the task (`Task.output_names`).
OUTPUT_NAME = "logits"
OPSET = 17
Exporter = Literal["torchscript", "dynamo"]


def export_fp32(
    model: nn.Module,
    input_size: tuple[int, int, int],
    out: Path,
    *,
    exporter: Exporter = "torchscript",
    output_names: Sequence[str] = (OUTPUT_NAME,),
) -> None:
    """Write `model` (eval mode) as ONNX with input `input` (N, C, H, W) and one output per
    name in `output_names` (what the model returns, in order), N dynamic on each."""
    names = list(output_names)
    model.eval()
    # A batch of 2, not 1: a tracer must not be able to treat the batch size as a constant.
    example = torch.zeros(2, *input_size)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the exporters' deprecation and tracer notices
            if exporter == "dynamo":
                batch = torch.export.Dim("batch", min=1, max=65536)
                program = torch.onnx.export(
                    model,
                    (example,),
                    None,
                    dynamo=True,
                    input_names=[INPUT_NAME],
                    output_names=names,
                    dynamic_shapes=({0: batch},),
                    opset_version=max(OPSET, 18),
                )
                if program is None:
                    raise ExportError("the dynamo exporter returned no program")
                program.save(str(out))
            else:
                torch.onnx.export(
                    model,
                    (example,),
                    str(out),
                    dynamo=False,
                    input_names=[INPUT_NAME],
                    output_names=names,
                    dynamic_axes={INPUT_NAME: {0: "batch"}, **{n: {0: "batch"} for n in names}},
                    opset_version=OPSET,
                    do_constant_folding=True,
                )
    except ExportError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        other = "dynamo" if exporter == "torchscript" else "torchscript"
        raise ExportError(
            f"the {exporter} ONNX exporter could not export this model ({first}). "
            f"Try the other exporter (--exporter {other})."
        ) from e


def to_fp16(src: Path, out: Path) -> None:
    """fp16 weights and compute; inputs and outputs stay fp32 (keep_io_types), so clients send
    and receive the same tensors as for fp32."""
    import onnx
    from onnxconverter_common import float16

    model = onnx.load(str(src))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # one "truncated to 1e-07" warning per tiny weight
            converted = float16.convert_float_to_float16(model, keep_io_types=True)
    except Exception as e:  # onnxconverter-common fails on some graphs with a bare AttributeError
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ExportError(
            f"the fp16 conversion (onnxconverter-common) failed on this model's graph ({type(e).__name__}: "
            f"{first}). Export fp32, or int8 through its gate, instead."
        ) from e
    _fix_float_types(converted, {o.name for o in model.graph.output if o.type.tensor_type.elem_type == 1})
    onnx.save(converted, str(out))


def _fix_float_types(model: Any, float_outputs: set[str]) -> None:
    """Two slips of onnxconverter-common's conversion on a detector's graph, mended in place:
    a Cast to float inside the converted graph (`mask.to(heat.dtype)`) keeps `to=FLOAT` while
    its output is retyped float16 (ONNX Runtime refuses the file); and an output fed by TopK
    (`scores`) comes out float16 despite keep_io_types. The first casts to float16; the second
    casts back to float, so clients get the fp32 model's output types."""
    from onnx import TensorProto

    graph = model.graph
    for output in graph.output:
        if output.name in float_outputs:
            output.type.tensor_type.elem_type = TensorProto.FLOAT
    types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.output]}
    for node in graph.node:
        if node.op_type != "Cast":
            continue
        want = TensorProto.FLOAT if node.output[0] in float_outputs else types.get(node.output[0])
        for attr in node.attribute:
            if attr.name == "to" and attr.i in (TensorProto.FLOAT, TensorProto.FLOAT16) and want is not None:
                attr.i = want


class _Calibration:
    """ONNX Runtime's CalibrationDataReader protocol over preprocessed images."""

    def __init__(self, images: torch.Tensor, batch_size: int = 32) -> None:
        self._batches: Iterator[torch.Tensor] = iter(torch.split(images, batch_size))

    def get_next(self) -> dict[str, Any] | None:
        batch = next(self._batches, None)
        return None if batch is None else {INPUT_NAME: batch.numpy()}


def to_int8(src: Path, out: Path, calibration: torch.Tensor, workdir: Path) -> None:
    """Static int8 quantization in QDQ format (what TensorRT and ORT's CPU and GPU providers
    accelerate): weights per channel int8, activations uint8 with ranges calibrated on
    `calibration` images."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared = workdir / "prepared.onnx"
    try:
        # Folds BatchNorm into Conv and infers shapes, so more of the graph gets quantized.
        # In the work folder: when ORT's symbolic shape inference gives up (a detector's Loop),
        # it saves its partial model as "sym_shape_infer_temp.onnx" + data files in the
        # current directory, which would be the user's.
        with contextlib.chdir(workdir):
            quant_pre_process(str(Path(src).resolve()), str(prepared.resolve()), skip_symbolic_shape=False)
    except Exception as e:  # pre-processing is an optimisation; quantize the plain graph instead
        log.warning("int8 pre-processing skipped (%s)", str(e).splitlines()[0] if str(e) else e)
        prepared = src
    try:
        quantize_static(
            str(prepared),
            str(out),
            _Calibration(calibration),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
            # 7-bit weights. On x86 CPUs without VNNI (AVX2 only, like the 2-core EPYC this was
            # measured on) ORT's u8s8 kernels use VPMADDUBSW, whose int16 sums saturate with
            # 8-bit per-channel weights: the trained digits CNN lost 1.7 points of accuracy
            # with 8 bits and 0.3 with 7 (ORT's quantize_static docs recommend this for
            # non-VNNI machines). The cost elsewhere is one bit of weight resolution.
            reduce_range=True,
        )
    except Exception as e:
        raise ExportError(f"int8 quantization failed: {str(e).strip().splitlines()[0][:300]}") from e


def set_metadata(path: Path, props: Mapping[str, str], doc: str) -> bytes:
    """Embed `props` as the model's metadata_props (replacing same-named ones); return the
    serialized model."""
    import onnx

    model = onnx.load(str(path))
    kept = [p for p in model.metadata_props if p.key not in props]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    for key, value in props.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    model.doc_string = doc
    model.producer_name = "visionloop"
    data: bytes = model.SerializeToString()
    return data
