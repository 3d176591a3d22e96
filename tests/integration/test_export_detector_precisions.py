"""fp16 and int8 of a detector: a tiny native detector, trained a few seconds on generated
scenes, converts, loads in ONNX Runtime with the fp32 model's input and output types, and
agrees with eager PyTorch within the detection task's limits; its decode (sigmoid, peaks,
TopK, box arithmetic) stays fp32 in both. A torchvision detector, whose network runs inside an
ONNX Loop, is refused at fp16 and int8 with the reason, and a refused int8 export says what
to export instead."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from visionloop.export import ExportError, convert
from visionloop.export.api import _instead_of_int8
from visionloop.tasks import get_task
from visionloop.tasks.detection.archs import build_detector
from visionloop.tasks.detection.evaluate import DetectionComparison
from visionloop.tasks.detection.export import export_module

SIZE = 64
CLASSES = ["red", "green"]
OUTPUTS = ("boxes", "scores", "labels")


def _scenes(n: int, seed: int) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]]]:
    """Dim noise with one to three bright rectangles, red (class 0) or green (class 1)."""
    g = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi, (1,), generator=g))

    images, targets = [], []
    for _ in range(n):
        image = torch.rand(3, SIZE, SIZE, generator=g) * 0.3
        boxes, labels = [], []
        for _ in range(randint(1, 4)):
            w, h = randint(10, 24), randint(10, 24)
            x, y, c = randint(0, SIZE - w), randint(0, SIZE - h), randint(0, 2)
            image[c, y : y + h, x : x + w] = 0.9
            boxes.append([x, y, x + w, y + h])
            labels.append(c)
        images.append(image)
        targets.append({"boxes": torch.tensor(boxes, dtype=torch.float32), "labels": torch.tensor(labels)})
    return torch.stack(images), targets


@pytest.fixture(scope="module")
def detector() -> Iterator[nn.Module]:
    """The export module of a small native detector trained 150 steps (a few seconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine's two cores are shared; one thread is fastest here
    try:
        torch.manual_seed(0)
        model = build_detector(
            "native_detector", len(CLASSES), image_size=SIZE, widths=(8, 16, 24, 32), neck=16
        )
        images, targets = _scenes(64, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        model.train()
        order = torch.Generator().manual_seed(1)
        for _ in range(150):
            pick = torch.randint(0, len(images), (8,), generator=order).tolist()
            # The model takes torchvision's 1-based labels (0 is background).
            batch = [{"boxes": targets[i]["boxes"], "labels": targets[i]["labels"] + 1} for i in pick]
            losses = model(list(images[pick]), batch)
            optimizer.zero_grad()
            sum(losses.values()).backward()
            optimizer.step()
        yield export_module(model.eval())
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fp32_file(detector: nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("det-precisions") / "fp32.onnx"
    convert.export_fp32(detector, (3, SIZE, SIZE), path, output_names=OUTPUTS)
    return path


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _compare(detector: nn.Module, path: Path) -> DetectionComparison:
    """The detection task's comparison of `path` with the eager module on unseen scenes."""
    images, targets = _scenes(32, seed=1)
    comparison = DetectionComparison(CLASSES)
    with torch.no_grad():
        reference = list(detector(images))
    got = _session(path).run(list(OUTPUTS), {"input": images.numpy()})
    comparison.update(reference, [torch.from_numpy(g) for g in got], targets)
    return comparison


def _post_names(fp32_file: Path) -> set[str]:
    _, post = convert.split_postprocessing(onnx.load(str(fp32_file)).graph)
    return {n.name for n in post}


def test_the_split_puts_the_decode_after_the_network_and_a_classifier_has_none(fp32_file: Path) -> None:
    graph = onnx.load(str(fp32_file)).graph
    network, post = convert.split_postprocessing(graph)
    assert len(network) + len(post) == len(graph.node)
    ops = {n.op_type for n in post}
    assert {"Sigmoid", "MaxPool", "TopK", "Exp", "GatherElements"} <= ops
    assert "Conv" not in ops and {n.op_type for n in network} >= {"Conv", "Relu"}

    from visionloop.models import registry as archs

    path = fp32_file.parent / "classifier.onnx"
    convert.export_fp32(archs.create_model("small_cnn", 3).eval(), (3, 16, 16), path)
    _, classifier_post = convert.split_postprocessing(onnx.load(str(path)).graph)
    assert classifier_post == []


def test_fp16_converts_loads_with_fp32_io_and_agrees_within_the_tasks_limits(
    detector: nn.Module, fp32_file: Path
) -> None:
    out = fp32_file.parent / "fp16.onnx"
    convert.to_fp16(fp32_file, out)
    model = onnx.load(str(out))
    onnx.checker.check_model(model, full_check=True)  # topologically sorted, typed
    session = _session(out)
    assert [(i.name, i.type) for i in session.get_inputs()] == [("input", "tensor(float)")]
    assert [(o.name, o.type) for o in session.get_outputs()] == [
        ("boxes", "tensor(float)"),
        ("scores", "tensor(float)"),
        ("labels", "tensor(int64)"),
    ]
    assert session.get_inputs()[0].shape[0] == "batch"
    # The network's weights are fp16.
    convs = {n.input[1] for n in model.graph.node if n.op_type == "Conv"}
    weights = [t for t in model.graph.initializer if t.name in convs]
    assert weights and all(t.data_type == onnx.TensorProto.FLOAT16 for t in weights)
    # The decode runs in fp32: every float tensor its nodes make is fp32.
    inferred = onnx.shape_inference.infer_shapes(model).graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.value_info, *inferred.output]}
    post = _post_names(fp32_file)
    made = [o for n in model.graph.node if n.name in post for o in n.output if o in types]
    assert made and onnx.TensorProto.FLOAT16 not in {types[o] for o in made}
    assert {n.name for n in model.graph.node} >= post

    m = _compare(detector, out).result()
    reference = _compare(detector, fp32_file).result()
    assert reference.score == m.reference_score and reference.max_abs_diff < 1e-4
    assert m.reference_score > 0.15, "the detector should have learned something for this to mean anything"
    max_diff, min_agreement = get_task("detection").parity_limits["fp16"]
    assert max_diff is None or m.max_abs_diff <= max_diff
    assert m.agreement >= min_agreement
    assert m.drop_points <= 1.0  # the export gate's default
    # fp16 activations with an fp32 decode: boxes and scores a few thousandths off, not pixels.
    assert m.max_abs_diff < 0.05


def test_int8_quantizes_the_network_and_leaves_the_decode_fp32(
    detector: nn.Module, fp32_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "int8.onnx"
    calibration, _ = _scenes(32, seed=2)
    convert.to_int8(fp32_file, out, calibration, tmp_path)
    graph = onnx.load(str(out)).graph
    producer = {o: n for n in graph.node for o in n.output}
    # What each QuantizeLinear quantizes (weights are initializers: they have no producer).
    quantized = [
        producer[n.input[0]] for n in graph.node if n.op_type == "QuantizeLinear" and n.input[0] in producer
    ]
    post = _post_names(fp32_file)
    assert sum(p.op_type == "Conv" for p in quantized) >= 10  # the network's activations are uint8
    assert [p.name for p in quantized if p.name in post] == []
    assert {n.name for n in graph.node} >= post  # the decode is all there, as exported

    m = _compare(detector, out).result()
    assert m.reference_score > 0.15
    assert m.drop_points <= 1.0


def test_a_detector_whose_network_runs_in_a_loop_is_refused_at_fp16_and_int8(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_detector("ssdlite320_mobilenet_v3_large", len(CLASSES), image_size=SIZE).eval()
    fp32 = tmp_path / "ssd.onnx"
    convert.export_fp32(export_module(model), (3, SIZE, SIZE), fp32, output_names=OUTPUTS)
    with pytest.raises(convert.Fp16ConversionError) as caught:
        convert.to_fp16(fp32, tmp_path / "fp16.onnx")
    assert "its network runs inside an ONNX Loop" in caught.value.reason
    assert str(caught.value).endswith("Export fp32 instead (int8 does not quantize inside the Loop either).")
    assert not (tmp_path / "fp16.onnx").exists()
    with pytest.raises(
        ExportError, match=r"no int8 export of this model: its network runs inside an ONNX Loop"
    ):
        convert.to_int8(fp32, tmp_path / "int8.onnx", torch.rand(4, 3, SIZE, SIZE), tmp_path)

    # What a refused int8 export of such a model advises: fp32, with the reason.
    advice = _instead_of_int8("m/1", tmp_path / "no-fp16-export", fp32, tmp_path / "trial.onnx")
    assert advice.startswith(
        "export fp32 instead (`visionloop export m/1`): fp16 is not possible, its network"
    )


def test_a_refused_int8_export_advises_fp16_when_it_converts(fp32_file: Path, tmp_path: Path) -> None:
    advice = _instead_of_int8("m/1", tmp_path / "no-fp16-export", fp32_file, tmp_path / "trial.onnx")
    assert advice == "export fp16 instead (`visionloop export m/1 --precision fp16`), whose graph converts"
    zeros = np.zeros((1, 3, SIZE, SIZE), np.float32)
    (scores,) = _session(tmp_path / "trial.onnx").run(["scores"], {"input": zeros})
    assert scores.dtype == np.float32 and np.isfinite(scores).all()
