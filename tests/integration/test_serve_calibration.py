"""The server applies the temperature `visionloop eval` stored with a version: the image
endpoint's confidences and the prediction log are softmax(logits / T), the raw infer endpoint
still answers the model's own logits, and the registry source reads the stored file."""

from __future__ import annotations

import io
import json
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from _modelkit import ModelKit, onnx_model
from _servekit import NAME, ServeKit, infer_body, ort_logits, serve_kit
from visionloop.registry.evals import CALIBRATION_FILE
from visionloop.registry.layout import parse_ref
from visionloop.serve.record import SCHEMA_VERSION, ReadStats, read_records
from visionloop.serve.source import RegistrySource, StaticSource

__all__ = ["onnx_model", "serve_kit"]

T = 2.5


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return np.asarray(e / e.sum())


def test_image_answers_and_log_use_the_temperature_and_infer_stays_raw(
    serve_kit: ServeKit, tmp_path: Path
) -> None:
    src = StaticSource()
    src.add(NAME, 1, serve_kit.v1, serve_kit.card, temperature=T)
    src.set_alias(NAME, "champion", 1)
    transform = serve_kit.card.eval_preprocess().to_transform()
    files = sorted(serve_kit.images.rglob("*.png"))[::151][:4]
    with serve_kit.server(src, tmp_path, max_batch_size=4, max_queue_delay_ms=1.0) as server:
        for path in files:
            data = path.read_bytes()
            logits = ort_logits(serve_kit.v1, transform(Image.open(io.BytesIO(data))).numpy()[None])[0]
            r = httpx.post(
                f"{server.url}/v2/models/{NAME}/classify?top_k=3",
                content=data,
                headers={"Content-Type": "image/png"},
            )
            assert r.status_code == 200, r.text
            preds = r.json()["predictions"]
            calibrated, raw = _softmax(logits / T), _softmax(logits)
            # The same ranking, the calibrated confidences (not the raw ones).
            assert [p["index"] for p in preds] == list(np.argsort(-logits, kind="stable")[:3])
            assert [p["score"] for p in preds] == pytest.approx(list(np.sort(calibrated)[::-1][:3]), abs=1e-5)
            assert abs(preds[0]["score"] - raw.max()) > 1e-3
        x = serve_kit.batch(2, seed=1)
        r = httpx.post(f"{server.url}/v2/models/{NAME}/infer", json=infer_body(x))
        assert r.status_code == 200
        got = np.asarray(r.json()["outputs"][0]["data"], dtype=np.float32).reshape(2, -1)
        ref = ort_logits(serve_kit.v1, x)
        np.testing.assert_allclose(got, ref, atol=1e-5)  # the tensor API answers the model's logits
        predlog = server.app.state.server.predlog
        predlog.flush()
        stats = ReadStats()
        records = list(read_records(predlog.path, stats))
    assert stats.bad == 0 and len(records) == len(files) + 2
    assert {(r.model, r.version, r.role, r.schema) for r in records} == {(NAME, 1, "primary", SCHEMA_VERSION)}
    for rec, row in zip(records[-2:], ref, strict=True):
        assert rec.answer["confidence"] == pytest.approx(float(_softmax(row / T).max()), abs=1e-5)


def test_registry_source_reads_the_stored_temperature(onnx_model: ModelKit, tmp_path: Path) -> None:
    kit = onnx_model.copy_home(tmp_path / "home")
    source = RegistrySource(kit.settings)
    assert source.resolve(parse_ref(kit.name)).temperature is None  # never evaluated
    stored = kit.info().dir / CALIBRATION_FILE
    stored.write_text(json.dumps({"temperature": 1.7}))
    assert source.resolve(parse_ref(kit.name)).temperature == pytest.approx(1.7)
    # A damaged file costs the calibration, not the model: served with raw confidences.
    for bad in ("{not json", json.dumps({"temperature": -1}), json.dumps({"temperature": "hot"})):
        stored.write_text(bad)
        assert source.resolve(parse_ref(kit.name)).temperature is None
