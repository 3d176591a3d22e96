"""A detector on a real inference server on loopback: the image endpoint /detect answers boxes
in the pixels of the image as sent (letterboxed as the model card says, NMS and the mapping
back in the server), compared with onnxruntime + the task's answer run in-process on the same
input; query parameters, the wrong endpoint, /infer through raw HTTP and tritonclient, metrics,
the prediction log and a shadow challenger.

The detector is the native one, untrained (seeded), with its heads' biases set so that its
scores straddle the default threshold and its boxes are larger than a cell (NMS has work).
"""

from __future__ import annotations

import io
import json
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from PIL import Image

from _servekit import metric
from visionloop.models.card import ModelCard
from visionloop.serve.config import ServeConfig
from visionloop.serve.server import BackgroundServer
from visionloop.serve.source import StaticSource
from visionloop.tasks import AnswerOptions, ImageContext, Task, list_tasks, register_task
from visionloop.tasks import registry as task_registry
from visionloop.tasks.detection import answer

NAME = "dets"
SIZE = 64
CLASSES = ["zero", "one", "two"]


@pytest.fixture(scope="module")
def detection_task() -> Iterator[None]:
    """The detection task as the server finds it (`get_task(card.task)`). Until the real one is
    registered, a test-only task whose serving half is `tasks.detection.answer`, removed after."""
    if "detection" in list_tasks():
        yield
        return
    register_task("detection")(_ServingOnlyDetection)
    try:
        yield
    finally:
        task_registry._REGISTRY.pop("detection", None)
        task_registry._INSTANCES.pop("detection", None)


class _ServingOnlyDetection(Task):
    primary_metric = "map"
    output_names = answer.OUTPUT_NAMES
    image_endpoint = "detect"
    metric_label = "mAP"

    def _no(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("serving only (test stand-in)")

    train_dataset = eval_dataset = record_targets = build_model = check_output = _no
    loss_fn = evaluator = model_card = export_comparison = output_scorer = _no

    def postprocess(self, outputs: Any, class_names: Any, *, top_k: int) -> Any:
        return answer.detections(outputs, class_names, options=AnswerOptions(top_k=top_k))

    def served_answer(
        self, outputs: Any, class_names: Any, *, options: AnswerOptions, image: ImageContext | None = None
    ) -> dict[str, Any]:
        return answer.served(outputs, class_names, options=options, image=image)

    def log_fields(self, outputs: Any, class_names: Any) -> list[dict[str, Any]]:
        return answer.log_fields(outputs, class_names)

    def agreement(self, a: Any, b: Any) -> Any:
        return answer.agreement(a, b)


def _export_detector(out: Path) -> None:
    import torch
    from torch import nn

    from visionloop.export.convert import export_fp32
    from visionloop.models.native_detector import build_native_detector

    torch.manual_seed(0)
    det = build_native_detector(len(CLASSES) + 1, input_size=SIZE).eval()
    with torch.no_grad():
        assert det.heatmap.out.bias is not None and det.box.out.bias is not None
        det.heatmap.out.bias.copy_(torch.tensor([0.0, -0.2, 0.2]))  # p ~ 0.5: around the threshold
        det.box.out.bias.copy_(torch.tensor([0.0, 0.0, 1.6, 1.2]))  # ~20 x 13 px boxes: they overlap

    class Fixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.det = det

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return self.det.forward_fixed(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        export_fp32(Fixed(), (3, SIZE, SIZE), out, output_names=answer.OUTPUT_NAMES)


CARD = ModelCard(
    task="detection",
    arch="native_detector",
    num_classes=len(CLASSES),
    class_names=CLASSES,
    input_size=(3, SIZE, SIZE),
    mean=(0.0, 0.0, 0.0),
    std=(1.0, 1.0, 1.0),
    crop_pct=1.0,
    resize="letterbox",
)


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("detector") / "det.onnx"
    _export_detector(path)
    return path


@pytest.fixture(scope="module")
def server(
    detection_task: None, onnx_file: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BackgroundServer]:
    src = StaticSource()
    src.add(NAME, 1, onnx_file, CARD)
    src.add(NAME, 2, onnx_file, CARD)  # the same file as a challenger: the shadow must agree
    src.set_alias(NAME, "champion", 1)
    src.set_alias(NAME, "challenger", 2)
    tmp = tmp_path_factory.mktemp("serve-det")
    cfg = ServeConfig(model=NAME, port=0, shadow_percent=100.0, max_queue_delay_ms=1.0)
    with BackgroundServer(cfg, src, tmp / "predictions.jsonl") as s:
        yield s


def _picture(width: int, height: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    return Image.fromarray(pixels).resize((width, height), Image.Resampling.NEAREST)


def _encode(im: Image.Image, fmt: str, **kw: Any) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def _ort(path: Path, x: np.ndarray) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in s.get_outputs()]
    return dict(zip(names, s.run(names, {"input": x}), strict=True))


def _reference(path: Path, data: bytes, options: AnswerOptions, width: int, height: int) -> dict[str, Any]:
    """What /detect must answer: the card's preprocessing, onnxruntime, the task's answer."""
    x = CARD.eval_preprocess().to_transform()(Image.open(io.BytesIO(data))).numpy()[None]
    outputs = _ort(path, x.astype(np.float32))
    image = ImageContext(width=width, height=height, input_height=SIZE, input_width=SIZE)
    return answer.served(outputs, CLASSES, options=options, image=image)


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got["counts"] == want["counts"]
    assert [(d["label"], d["index"]) for d in got["detections"]] == [
        (d["label"], d["index"]) for d in want["detections"]
    ]
    for g, w in zip(got["detections"], want["detections"], strict=True):
        assert g["score"] == pytest.approx(w["score"], abs=1e-5)
        assert g["box"] == pytest.approx(w["box"], abs=0.02)


def test_detect_answers_boxes_in_the_image_frame(onnx_file: Path, server: BackgroundServer) -> None:
    # 120 x 80: letterboxed at scale 64 / 120, so boxes in the image reach past x = 64.
    data = _encode(_picture(120, 80), "PNG")
    r = httpx.post(
        f"{server.url}/v2/models/{NAME}/detect?top_k=100",
        content=data,
        headers={"Content-Type": "image/png"},
    )
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["model_name"] == NAME and doc["model_version"] == "1"
    want = _reference(onnx_file, data, AnswerOptions(top_k=100), 120, 80)
    assert len(want["detections"]) >= 3  # the test means something: several boxes pass 0.25
    _same(doc, want)
    boxes = np.array([d["box"] for d in doc["detections"]])
    assert boxes[:, [0, 2]].min() >= 0 and boxes[:, [0, 2]].max() <= 120
    assert boxes[:, [1, 3]].min() >= 0 and boxes[:, [1, 3]].max() <= 80
    assert boxes[:, 2].max() > SIZE
    assert min(d["score"] for d in doc["detections"]) >= answer.DEFAULT_SCORE_THRESHOLD
    assert sum(doc["counts"].values()) == len(doc["detections"])

    # score_threshold (half the detections pass it) and top_k, in a multipart form to a version.
    threshold = round(float(np.median([d["score"] for d in doc["detections"]])), 3)
    r = httpx.post(
        f"{server.url}/v2/models/{NAME}/versions/1/detect?score_threshold={threshold}&top_k=100",
        files={"file": ("x.png", data, "image/png")},
    )
    assert r.status_code == 200, r.text
    _same(r.json(), _reference(onnx_file, data, AnswerOptions(top_k=100, score_threshold=threshold), 120, 80))
    assert 1 <= len(r.json()["detections"]) < len(doc["detections"])
    assert all(d["score"] >= threshold for d in r.json()["detections"])
    r = httpx.post(f"{server.url}/v2/models/{NAME}/detect?top_k=2", content=data)
    assert r.json()["detections"] == doc["detections"][:2]


def test_size_as_sent_survives_reduction_and_exif_rotation(onnx_file: Path, server: BackgroundServer) -> None:
    # Stored 80 wide x 120 high, EXIF orientation 6 (turn 90 degrees clockwise): 120 x 80 upright.
    exif = Image.Exif()
    exif[0x0112] = 6
    data = _encode(_picture(80, 120, seed=1), "JPEG", quality=95, exif=exif)
    r = httpx.post(f"{server.url}/v2/models/{NAME}/detect?top_k=100", content=data)
    assert r.status_code == 200, r.text
    _same(r.json(), _reference(onnx_file, data, AnswerOptions(top_k=100), 120, 80))
    assert max(d["box"][2] for d in r.json()["detections"]) > 80  # would be clipped at 80 unswapped

    # A large JPEG is decoded reduced (to ~2x the 64 px the card needs): boxes still come back in
    # the 1200 x 800 frame it was sent in.
    big = _encode(_picture(1200, 800, seed=2), "JPEG", quality=90)
    r = httpx.post(f"{server.url}/v2/models/{NAME}/detect?top_k=100", content=big)
    assert r.status_code == 200, r.text
    boxes = np.array([d["box"] for d in r.json()["detections"]])
    assert len(boxes) and boxes[:, 2].max() > 600 and boxes[:, [0, 2]].max() <= 1200
    assert boxes[:, [1, 3]].max() <= 800


def test_wrong_endpoint_and_bad_parameters_are_refused(server: BackgroundServer) -> None:
    png = _encode(_picture(40, 40), "PNG")
    checks = [
        (f"/v2/models/{NAME}/classify", 400, f"{NAME} is a detection model: POST /v2/models/{NAME}/detect"),
        (f"/v2/models/{NAME}/versions/1/classify", 400, f"POST /v2/models/{NAME}/versions/1/detect"),
        (f"/v2/models/{NAME}/segment", 404, f"no such endpoint: POST /v2/models/{NAME}/segment"),
        (
            f"/v2/models/{NAME}/detect?score_threshold=1.5",
            400,
            "score_threshold must be a number from 0 to 1",
        ),
        (f"/v2/models/{NAME}/detect?score_threshold=nan", 400, "score_threshold"),
        (f"/v2/models/{NAME}/detect?score_threshold=high", 400, "score_threshold"),
        (f"/v2/models/{NAME}/detect?top_k=0", 400, "top_k must be a whole number"),
        ("/v2/models/nope/detect", 404, "no model 'nope'"),
    ]
    for path, status, words in checks:
        r = httpx.post(f"{server.url}{path}", content=png)
        assert r.status_code == status, (path, r.text)
        assert words in r.json()["error"], (path, r.text)
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert "/v2/models/{name}/detect" in paths and "/v2/models/{name}/classify" in paths


def test_infer_returns_the_three_outputs(onnx_file: Path, server: BackgroundServer) -> None:
    x = np.stack(
        [CARD.eval_preprocess().to_transform()(_picture(90, 60, seed=s)).numpy() for s in range(3)]
    ).astype(np.float32)
    ref = _ort(onnx_file, x)
    body = {
        "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]
    }
    r = httpx.post(f"{server.url}/v2/models/{NAME}/infer", json=body)
    assert r.status_code == 200, r.text
    outs = {o["name"]: o for o in r.json()["outputs"]}
    assert [(o["name"], o["datatype"], o["shape"]) for o in r.json()["outputs"]] == [
        ("boxes", "FP32", [3, 100, 4]),
        ("scores", "FP32", [3, 100]),
        ("labels", "INT64", [3, 100]),
    ]
    np.testing.assert_allclose(np.array(outs["boxes"]["data"]).reshape(3, 100, 4), ref["boxes"], atol=1e-4)
    np.testing.assert_array_equal(np.array(outs["labels"]["data"]).reshape(3, 100), ref["labels"])

    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    try:
        meta = client.get_model_metadata(NAME)
        assert [o["name"] for o in meta["outputs"]] == ["boxes", "scores", "labels"]
        inp = triton.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        res = client.infer(NAME, [inp], outputs=[triton.InferRequestedOutput(n) for n in answer.OUTPUT_NAMES])
        boxes, scores, labels = (res.as_numpy(n) for n in answer.OUTPUT_NAMES)
        assert boxes.dtype == np.float32 and boxes.shape == (3, 100, 4)
        assert scores.dtype == np.float32 and scores.shape == (3, 100)
        assert labels.dtype == np.int64 and labels.shape == (3, 100)
        np.testing.assert_allclose(scores, ref["scores"], atol=1e-5)
        np.testing.assert_array_equal(labels, ref["labels"])
    finally:
        client.close()


def test_metrics_prediction_log_and_shadow_count_detections(
    onnx_file: Path, server: BackgroundServer
) -> None:
    before = httpx.get(f"{server.url}/metrics").text
    data = _encode(_picture(100, 70, seed=4), "PNG")
    bodies = [httpx.post(f"{server.url}/v2/models/{NAME}/detect?top_k=100", content=data) for _ in range(3)]
    assert all(b.status_code == 200 for b in bodies)
    state = server.app.state.server
    after = httpx.get(f"{server.url}/metrics").text
    lab = {"model": NAME, "version": "1"}
    assert (
        metric(after, "visionloop_serve_requests_total", **lab, endpoint="detect")
        - metric(before, "visionloop_serve_requests_total", **lab, endpoint="detect")
        == 3
    )
    # The challenger (the same file) got a mirrored copy of each and agreed every time; the
    # shadow comparisons finish after the answers, so wait for their counter.
    deadline = time.monotonic() + 30
    agree = 0.0
    while time.monotonic() < deadline:
        text = httpx.get(f"{server.url}/metrics").text
        agree = metric(text, "visionloop_serve_shadow_comparisons_total", model=NAME, agree="true") - metric(
            before, "visionloop_serve_shadow_comparisons_total", model=NAME, agree="true"
        )
        if agree >= 3:
            break
        time.sleep(0.05)
    assert agree == 3
    assert metric(text, "visionloop_serve_shadow_comparisons_total", model=NAME, agree="false") == 0
    state.predlog.flush()
    records = [json.loads(line) for line in state.predlog.path.read_text().splitlines()]
    primary = [r for r in records if r["role"] == "primary"][-3:]
    shadow = [r for r in records if r["role"] == "shadow"][-3:]
    # What the log records is counted in the model's input frame (log_fields sees no image).
    x = CARD.eval_preprocess().to_transform()(Image.open(io.BytesIO(data))).numpy()[None]
    want = answer.log_fields(_ort(onnx_file, x.astype(np.float32)), CLASSES)[0]
    assert want["detections"] > 0
    for rec in primary + shadow:
        assert rec["model"] == NAME and rec["detections"] == want["detections"]
        assert rec["counts"] == want["counts"]
        assert rec["max_score"] == pytest.approx(want["max_score"], abs=1e-5)
    assert all(r["agrees"] is True and r["version"] == 2 for r in shadow)


def test_the_detector_converts_to_fp16_and_keeps_its_outputs(onnx_file: Path, tmp_path: Path) -> None:
    import onnxruntime as ort

    from visionloop.export.convert import to_fp16

    to_fp16(onnx_file, tmp_path / "fp16.onnx")
    session = ort.InferenceSession(str(tmp_path / "fp16.onnx"), providers=["CPUExecutionProvider"])
    assert [(o.name, o.type) for o in session.get_outputs()] == [
        ("boxes", "tensor(float)"),
        ("scores", "tensor(float)"),
        ("labels", "tensor(int64)"),
    ]
    x = CARD.eval_preprocess().to_transform()(_picture(90, 60, seed=7)).numpy()[None].astype(np.float32)
    got = dict(zip(answer.OUTPUT_NAMES, session.run(list(answer.OUTPUT_NAMES), {"input": x}), strict=True))
    ref = _ort(onnx_file, x)
    assert got["boxes"].shape == ref["boxes"].shape == (1, 100, 4)
    # fp16 keeps about three digits of each score: the best detections stay the best.
    assert np.sort(got["scores"][0])[::-1][:10] == pytest.approx(
        np.sort(ref["scores"][0])[::-1][:10], abs=5e-3
    )
