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


# Ops that hold a network's compute (and its weights). Everything that feeds none of them,
# directly or through the subgraph of a Loop or If, is post-processing after the network's
# last layer: a detector's decode (sigmoid, peak picking, TopK, box arithmetic), padding to a
# fixed count, the Casts between. `split_postprocessing` finds it; fp16 and int8 leave it fp32.
COMPUTE_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})


def _subgraphs(node: Any) -> Iterator[Any]:
    for attr in node.attribute:
        if attr.HasField("g"):
            yield attr.g
        yield from attr.graphs


def _computes(node: Any) -> bool:
    return node.op_type in COMPUTE_OPS or any(_computes(n) for g in _subgraphs(node) for n in g.node)


def _free_names(node: Any) -> set[str]:
    """The outer-scope tensors `node` reads: its inputs and what its subgraphs use from outside."""
    names = {i for i in node.input if i}
    for g in _subgraphs(node):
        inner = {i.name for i in g.input} | {t.name for t in g.initializer}
        inner |= {o for n in g.node for o in n.output}
        names |= {name for n in g.node for name in _free_names(n)} - inner
    return names


def split_postprocessing(graph: Any) -> tuple[list[Any], list[Any]]:
    """The top-level nodes of `graph` as (network, post-processing), each in graph order: the
    network is every node that a compute op (COMPUTE_OPS) depends on, compute ops included;
    post-processing is the rest. A classifier ending in its Gemm has none."""
    producer = {o: n for n in graph.node for o in n.output}
    network: set[int] = set()
    stack = [n for n in graph.node if _computes(n)]
    while stack:
        node = stack.pop()
        if id(node) in network:
            continue
        network.add(id(node))
        stack.extend(producer[name] for name in _free_names(node) if name in producer)
    return [n for n in graph.node if id(n) in network], [n for n in graph.node if id(n) not in network]


def to_fp16(src: Path, out: Path) -> None:
    """fp16 weights and compute for the network; inputs, outputs and post-processing stay fp32.

    The network (every node a convolution or matmul depends on, `split_postprocessing`) is
    converted by ONNX Runtime's float16 converter with keep_io_types, so the tensors it hands
    on are fp32; the post-processing after it (a detector's decode) is kept as exported, in
    fp32: box coordinates in fp16 are 0.25 px apart from 256 px on and 0.5 px from 512 px, and
    scores keep three digits, which reorders near ties in TopK. Clients send and receive the
    same tensors as for fp32.

    Converter choice: onnxconverter-common 1.16 stops on the native detector's graph with an
    AttributeError in `remove_unnecessary_cast_node` (a Cast pair whose second Cast feeds
    several nodes is handled as if it fed one); onnxruntime.transformers.float16 is the copy
    ONNX Runtime maintains, and takes the same graphs (classifiers: same logits)."""
    import onnx

    model = onnx.load(str(src))
    network, post = split_postprocessing(model.graph)
    if not network:
        raise Fp16ConversionError("its graph has no convolution or matrix product to run in fp16")
    try:
        converted = _network_to_fp16(model, network, post)
    except Fp16ConversionError:
        raise
    except Exception as e:
        raise Fp16ConversionError(f"ONNX Runtime's float16 converter failed ({_first_line(e)})") from e
    data = converted.SerializeToString()
    import onnxruntime as ort

    try:
        ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    except Exception as e:
        # Measured on torchvision's detectors (SSDlite, Faster R-CNN, FCOS): their network runs
        # in an ONNX Loop over the batch's images, whose body ORT's converter leaves reading
        # tensors it renamed (onnxconverter-common's leaves the Loop's types inconsistent).
        if _runs_in_subgraph(network):
            raise Fp16ConversionError(
                "its network runs inside an ONNX Loop (one image per iteration, as torchvision's "
                "detectors export), whose body ONNX Runtime's float16 converter leaves reading tensors it "
                f"renamed ({_first_line(e)})",
                instead=_LOOP_INSTEAD,
            ) from e
        raise Fp16ConversionError(
            f"the converted graph does not load in ONNX Runtime ({_first_line(e)})"
        ) from e
    Path(out).write_bytes(data)


_FP16_INSTEAD = "Export fp32 instead, or int8 through its gate."
_LOOP_INSTEAD = "Export fp32 instead (int8 does not quantize inside the Loop either)."


class Fp16ConversionError(ExportError):
    """This model's graph has no working fp16 conversion; `reason` says why, `instead` what to
    export instead."""

    def __init__(self, reason: str, *, instead: str = _FP16_INSTEAD) -> None:
        self.reason = reason
        super().__init__(f"no fp16 export of this model: {reason}. {instead}")


def _runs_in_subgraph(network: list[Any]) -> bool:
    """Whether compute ops run inside a Loop, If or Scan of the top-level graph."""
    return any(n.op_type in ("Loop", "If", "Scan") and _computes(n) for n in network)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200]}" if text else type(e).__name__


def _network_to_fp16(model: Any, network: list[Any], post: list[Any]) -> Any:
    """`model` with `network` converted to fp16 (fp32 at its edges) and `post` left fp32."""
    import onnx
    from onnx import TensorProto
    from onnxruntime.transformers.float16 import convert_float_to_float16

    graph = model.graph
    produced = {o for n in network for o in n.output}
    outputs = {o.name for o in graph.output}
    post_reads = {name for n in post for name in _free_names(n)}
    # What the network hands on: tensors the post-processing reads, and outputs it makes itself.
    edges = [o for n in network for o in n.output if o in post_reads or o in outputs]
    types = {v.name: v for v in onnx.shape_inference.infer_shapes(model).graph.value_info}
    types.update({v.name: v for v in graph.output})
    untyped = [e for e in edges if e not in types]
    if untyped:
        raise Fp16ConversionError(
            f"ONNX shape inference gives no type for {', '.join(untyped[:3])}, where its network ends"
        )
    body = onnx.ModelProto()
    body.CopyFrom(model)
    del body.graph.node[:]
    body.graph.node.extend(network)
    del body.graph.output[:]
    body.graph.output.extend(types[e] for e in edges)
    post_only = post_reads - {name for n in network for name in _free_names(n)}
    kept = [t for t in graph.initializer if t.name not in post_only]
    del body.graph.initializer[:]
    body.graph.initializer.extend(kept)
    del body.graph.value_info[:]
    body.graph.value_info.extend(v for v in graph.value_info if v.name in produced)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one "truncated to 1e-07" warning per tiny weight
        half = convert_float_to_float16(body, keep_io_types=True)

    # The post-processing reads the fp32 originals of initializers the network shares with it
    # (the converter may have made the network's copy fp16), under a name of their own.
    originals = {t.name: t for t in graph.initializer}
    converted = {t.name: t for t in half.graph.initializer}
    renamed: dict[str, str] = {}
    for name in sorted(post_reads & set(originals)):
        if name not in converted:
            half.graph.initializer.append(originals[name])
        elif converted[name].data_type != originals[name].data_type:
            copy = TensorProto()
            copy.CopyFrom(originals[name])
            copy.name = renamed[name] = f"{name}__fp32"
            half.graph.initializer.append(copy)
    tail = [_renamed(n, renamed) for n in post]
    half.graph.node.extend(tail)
    half.graph.value_info.extend(v for v in graph.value_info if v.name not in produced)
    del half.graph.output[:]
    half.graph.output.extend(graph.output)
    _sort_topologically(half.graph)
    return half


def _renamed(node: Any, names: Mapping[str, str]) -> Any:
    """A copy of `node` reading names[x] wherever it (or its subgraphs) read x."""
    from onnx import NodeProto

    copy = NodeProto()
    copy.CopyFrom(node)
    if names:
        _rename_inputs(copy, names)
    return copy


def _rename_inputs(node: Any, names: Mapping[str, str]) -> None:
    for i, name in enumerate(node.input):
        node.input[i] = names.get(name, name)
    for g in _subgraphs(node):
        for inner in g.node:
            _rename_inputs(inner, names)


def _sort_topologically(graph: Any) -> None:
    """Reorder `graph.node` so each node comes after the producers of what it reads (the ONNX
    checker and TensorRT's parser require it; ORT's float16 converter appends its Casts at the
    end). Stable: of the nodes ready at each step, the earliest in the old order goes first."""
    import heapq

    nodes = list(graph.node)
    producer = {o: i for i, n in enumerate(nodes) for o in n.output}
    waits = [0] * len(nodes)
    consumers: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        for p in {producer[name] for name in _free_names(node) if name in producer}:
            waits[i] += 1
            consumers[p].append(i)
    ready = [i for i, w in enumerate(waits) if w == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for c in consumers[i]:
            waits[c] -= 1
            if waits[c] == 0:
                heapq.heappush(ready, c)
    if len(order) != len(nodes):
        raise Fp16ConversionError("the converted graph has a cycle")
    del graph.node[:]
    graph.node.extend(nodes[i] for i in order)


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
    `calibration` images. Post-processing after the network (`split_postprocessing`) stays
    fp32: quantized, a detector's decode carries its boxes in 256 steps over the input's range
    (0.4 px at 96 px) and its scores in steps of 1/255, so near peaks tie in the 3x3 max-pool
    and TopK; the native detector of the demo lost 1.21 mAP points that way, and none (-0.08,
    noise) with its decode left fp32."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    prepared = workdir / "prepared.onnx"
    try:
        # Folds BatchNorm into Conv and infers shapes, so more of the graph gets quantized.
        # In the work folder: when ORT's symbolic shape inference gives up (a detector's Loop),
        # it saves its partial model as "sym_shape_infer_temp.onnx" + data files in the
        # current directory, which would be the user's.
        source, target = Path(src).resolve(), prepared.resolve()  # before the chdir
        with contextlib.chdir(workdir):
            quant_pre_process(str(source), str(target), skip_symbolic_shape=False)
    except Exception as e:  # pre-processing is an optimisation; quantize the plain graph instead
        log.warning("int8 pre-processing skipped (%s)", str(e).splitlines()[0] if str(e) else e)
        prepared = src
    import onnx

    network, post = split_postprocessing(onnx.load(str(prepared)).graph)
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
            nodes_to_exclude=[n.name for n in post if n.name],
        )
    except Exception as e:
        raise ExportError(f"int8 quantization failed: {str(e).strip().splitlines()[0][:300]}") from e
    if not _quantized(onnx.load(str(out)).graph):
        # ORT's quantizer only rewrites the top-level graph: a network inside a Loop (torchvision's
        # detectors) comes out as it went in, an fp32 model that an int8 label would misname.
        where = (
            "its network runs inside an ONNX Loop (one image per iteration, as torchvision's detectors "
            "export), which ONNX Runtime's quantizer does not enter"
            if _runs_in_subgraph(network)
            else "no operator of its graph was quantized"
        )
        raise ExportError(f"no int8 export of this model: {where}. Export fp32 instead.")


def _quantized(graph: Any) -> bool:
    """Whether `graph` (or a subgraph of it) holds a quantized operator."""
    return any(
        n.op_type in ("QuantizeLinear", "DynamicQuantizeLinear")
        or n.op_type.startswith("QLinear")
        or any(_quantized(g) for g in _subgraphs(n))
        for n in graph.node
    )


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
