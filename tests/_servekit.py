"""Test helper for the inference server: real ONNX exports of the session's trained digits
model, a deliberately slow ONNX model, and small readers for the server's metrics.

    from _servekit import serve_kit   # a session fixture: import it into the module

`kit.v1` is the trained small_cnn (`_modelkit`'s model, trained by the real trainer) exported
by torch.onnx with a dynamic batch axis; `kit.v2` is the same network with two classes' classifier
rows swapped, so the two versions disagree on some images (canary, shadow and promotion tests
can tell which version answered). `kit.source()` is a StaticSource holding both, v1 champion.
"""

from __future__ import annotations

import fcntl
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from visionloop.models.card import ModelCard
from visionloop.serve.config import ServeConfig
from visionloop.serve.server import BackgroundServer
from visionloop.serve.source import StaticSource

NAME = "digits"


# A card for the tiny hand-built ONNX graphs that take FP32 [batch, 3, 2, 2] (12 values): the
# datatype and event-loop tests serve their graphs under it.
FLAT_CARD = ModelCard(
    arch="small_cnn",
    num_classes=12,
    class_names=[f"c{i}" for i in range(12)],
    input_size=(3, 2, 2),
    mean=(0.0, 0.0, 0.0),
    std=(1.0, 1.0, 1.0),
    crop_pct=1.0,
)


@dataclass(frozen=True)
class ServeKit:
    root: Path
    card: ModelCard
    v1: Path
    v2: Path
    slow: Path
    images: Path  # the digits as PNG files, one folder per class (what ingest read)

    def source(self, champion: int = 1, challenger: int | None = None) -> StaticSource:
        src = StaticSource()
        src.add(NAME, 1, self.v1, self.card)
        src.add(NAME, 2, self.v2, self.card)
        src.set_alias(NAME, "champion", champion)
        if challenger is not None:
            src.set_alias(NAME, "challenger", challenger)
        return src

    def slow_source(self) -> StaticSource:
        src = StaticSource()
        src.add("slow", 1, self.slow, self.card)
        return src

    def server(self, source: StaticSource, tmp: Path, **config: Any) -> BackgroundServer:
        cfg = ServeConfig(model=config.pop("model", NAME), port=0, **config)
        return BackgroundServer(cfg, source, tmp / "predictions.jsonl")

    def batch(self, n: int, seed: int = 0) -> np.ndarray:
        """n real digit images, preprocessed as the card says (float32, N x C x H x W)."""
        from PIL import Image

        transform = self.card.eval_preprocess().to_transform()
        files = sorted(self.images.rglob("*.png"))
        pick = np.random.default_rng(seed).choice(len(files), size=n, replace=False)
        return np.stack([transform(Image.open(files[i])).numpy() for i in pick]).astype(np.float32)


def ort_logits(path: Path, x: np.ndarray) -> np.ndarray:
    """The reference: the same ONNX file run in-process, no server."""
    import onnxruntime as ort

    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out: np.ndarray = s.run(None, {s.get_inputs()[0].name: x})[0]
    return out


def _export(card: ModelCard, weights: Path, out: Path, swap: bool) -> None:
    import torch

    model = card.create_model(weights).eval()
    if swap:
        # The classifier's rows for classes 0 and 1 swapped: the two versions disagree exactly
        # on the images v1 calls 0 or 1, and agree on the rest.
        with torch.no_grad():
            fc = model.fc
            assert isinstance(fc, torch.nn.Linear)
            fc.weight[[0, 1]] = fc.weight[[1, 0]].clone()
            fc.bias[[0, 1]] = fc.bias[[1, 0]].clone()
    x = torch.zeros(1, *card.input_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (x,),
            str(out),
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
            dynamo=False,
        )


def _slow_model(out: Path, card: ModelCard, depth: int = 800, width: int = 1024) -> None:
    """A real ONNX model with the digits signature whose batch-1 inference takes tens of ms:
    `depth` (MatMul, Tanh) layers sharing one weight matrix (a small file, a lot of compute)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    c, h, w = card.input_size
    rng = np.random.default_rng(0)
    w_in = numpy_helper.from_array(
        (rng.standard_normal((c * h * w, width)) / np.sqrt(c * h * w)).astype(np.float32), "w_in"
    )
    w_mid = numpy_helper.from_array(
        (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32), "w_mid"
    )
    w_out = numpy_helper.from_array(
        (rng.standard_normal((width, card.num_classes)) / np.sqrt(width)).astype(np.float32), "w_out"
    )
    nodes = [
        helper.make_node("Flatten", ["input"], ["x0"], axis=1),
        helper.make_node("MatMul", ["x0", "w_in"], ["h0"]),
    ]
    for i in range(depth):
        nodes.append(helper.make_node("MatMul", [f"h{i}", "w_mid"], [f"m{i}"]))
        nodes.append(helper.make_node("Tanh", [f"m{i}"], [f"h{i + 1}"]))
    nodes.append(helper.make_node("MatMul", [f"h{depth}", "w_out"], ["logits"]))
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", c, h, w])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", card.num_classes])],
        [w_in, w_mid, w_out],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(out))


def build_serve_kit(factory: pytest.TempPathFactory, dataset: Path) -> ServeKit:
    from _modelkit import trained_model

    base = trained_model(factory, dataset)
    root = factory.getbasetemp() / "servekit"
    root.mkdir(exist_ok=True)
    card = ModelCard.load(base.run_dir)
    kit = ServeKit(
        root, card, root / "v1.onnx", root / "v2.onnx", root / "slow.onnx", dataset.parent / "digits-images"
    )
    with open(root / ".build-lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        if not (root / "done").is_file():
            _export(card, base.run_dir / "final.safetensors", kit.v1, swap=False)
            _export(card, base.run_dir / "final.safetensors", kit.v2, swap=True)
            _slow_model(kit.slow, card)
            (root / "done").write_text("ok")
    return kit


@pytest.fixture(scope="session")
def serve_kit(tmp_path_factory: pytest.TempPathFactory, digits_dataset: Path) -> ServeKit:
    return build_serve_kit(tmp_path_factory, digits_dataset)


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` whose labels include `labels` (Prometheus text)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def infer_body(x: np.ndarray, name: str = "input", **extra: Any) -> dict[str, Any]:
    return {
        "inputs": [{"name": name, "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}],
        **extra,
    }
