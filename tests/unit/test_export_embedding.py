"""The export's embedding output (penultimate layer, PCA-reduced), its log field, and the
monitor's MMD test on it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch

from _refkit import three_class_reference
from visionloop.export import convert
from visionloop.export.embedding import WithEmbedding, collect_features, fit_projection
from visionloop.models import create_model
from visionloop.monitor.reference import Reference, load_reference, save_reference
from visionloop.monitor.windows import judge
from visionloop.serve.record import MonitorFields, PredictionRecord, RecordError
from visionloop.tasks import get_task


def test_the_projection_finds_the_axes_of_the_data_and_is_reproducible() -> None:
    rng = np.random.default_rng(0)
    # 3 directions with variances 100, 25, 1 in 8 dimensions, plus small noise.
    basis = np.linalg.qr(rng.normal(size=(8, 8)))[0][:, :3].T  # orthonormal rows
    coeffs = rng.normal(size=(500, 3)) * np.array([10.0, 5.0, 1.0])
    x = coeffs @ basis + 3.0 + rng.normal(scale=0.01, size=(500, 8))
    p = fit_projection(x, components=2)
    assert p.dim == 2 and p.components.shape == (2, 8) and p.images == 500
    np.testing.assert_allclose(p.mean, x.mean(axis=0), atol=1e-5)
    # The two axes are the two largest directions, in order (up to sign).
    assert abs(float(p.components[0] @ basis[0])) > 0.999
    assert abs(float(p.components[1] @ basis[1])) > 0.999
    assert p.explained == pytest.approx((100 + 25) / (100 + 25 + 1), abs=0.01)
    again = fit_projection(x[::-1].copy(), components=2)  # same data, other order: same axes, same signs
    np.testing.assert_allclose(again.components, p.components, atol=1e-5)
    # Fewer images than components: at most n - 1 axes.
    assert fit_projection(x[:5], components=16).dim == 4


@pytest.mark.parametrize("bad", [np.full((10, 4), np.nan), np.zeros((1, 4))])
def test_the_projection_refuses_broken_features(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match=r"NaN|at least 2"):
        fit_projection(bad)


@pytest.mark.parametrize("arch", ["small_cnn", "tiny_resnet"])
def test_the_exported_embedding_is_the_projected_penultimate_layer(arch: str, tmp_path: Path) -> None:
    import onnxruntime as ort

    torch.manual_seed(0)
    model = create_model(arch, 5).eval()
    layer = get_task("classification").embedding_layer(model)
    assert layer is not None and layer.module is model.fc and layer.read == "input"
    x = torch.randn(24, 3, 16, 16)
    projection = fit_projection(collect_features(model, layer, [x[:12], x[12:]]), components=6)
    out = tmp_path / "m.onnx"
    convert.export_fp32(
        WithEmbedding(model, layer, projection), (3, 16, 16), out, output_names=("logits", "embedding")
    )
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == ["logits", "embedding"]
    logits, embedding = session.run(None, {"input": x[:5].numpy()})
    # The features, computed independently of the hook: the pooled input of fc.
    with torch.no_grad():
        feats = torch.stack(_fc_inputs(model, x[:5]))
        expected = (feats.numpy() - projection.mean) @ projection.components.T
        np.testing.assert_allclose(logits, model(x[:5]).numpy(), atol=1e-5)  # unchanged
    assert embedding.shape == (5, 6)
    np.testing.assert_allclose(embedding, expected, atol=1e-4)
    assert np.abs(embedding).max() > 1e-3  # not all zeros: the hook saw the features


def _fc_inputs(model: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    fc = model.get_submodule("fc")
    handle = fc.register_forward_pre_hook(lambda _m, args: seen.extend(args[0]))
    try:
        model(x)
    finally:
        handle.remove()
    return seen


def test_which_models_have_an_embedding_layer() -> None:
    from visionloop.tasks.detection.archs import build_detector

    detection = get_task("detection")
    native = detection.export_module(build_detector("native_detector", 3, image_size=64))
    layer = detection.embedding_layer(native)
    assert layer is not None and layer.read == "output"
    assert layer.module is native.model.stage4  # type: ignore[union-attr]
    # torchvision's detectors run their network inside an ONNX Loop: no second output.
    ssd = detection.export_module(build_detector("ssdlite320_mobilenet_v3_large", 3, image_size=64))
    assert detection.embedding_layer(ssd) is None


def test_the_embedding_round_trips_through_a_log_record_and_is_bounded() -> None:
    row = np.array([0.5, -1.25, 3.0], dtype=np.float32)
    rec = PredictionRecord(
        time=1.0,
        model="m",
        version=1,
        role="primary",
        latency_ms=1.0,
        monitor=MonitorFields(outputs=[0.2, 0.8], predicted=1, confidence=0.8, embedding=row),  # type: ignore[arg-type]
    )
    doc = orjson.loads(orjson.dumps(rec.to_json()))
    assert doc["monitor"]["embedding"] == [0.5, -1.25, 3.0]
    back = PredictionRecord.from_json(doc)
    assert back.monitor is not None and back.monitor.embedding == (0.5, -1.25, 3.0)
    for bad, says in (([0.1] * 257, "at most 256"), ([1.0, "x"], "finite number"), ("1,2", "must be a list")):
        with pytest.raises(RecordError, match=says):
            PredictionRecord.from_json({**doc, "monitor": {"embedding": bad}})


def _reference(rng: np.random.Generator, n: int = 1000) -> Reference:
    probs = rng.dirichlet([4.0, 4.0, 4.0], size=n)
    return three_class_reference(probs, embeddings=rng.normal(size=(n, 8)).astype(np.float32))


def _window(rng: np.random.Generator, ref: Reference, emb: np.ndarray | None) -> list[PredictionRecord]:
    n = 300 if emb is None else len(emb)
    probs = rng.dirichlet([4.0, 4.0, 4.0], size=n)  # the outputs do not move
    return [
        PredictionRecord(
            time=float(i),
            model="m",
            version=1,
            role="primary",
            latency_ms=1.0,
            monitor=MonitorFields(
                outputs=tuple(probs[i]),
                predicted=int(probs[i].argmax()),
                confidence=float(probs[i].max()),
                embedding=None if emb is None else tuple(float(v) for v in emb[i]),
            ),
        )
        for i in range(n)
    ]


def test_mmd_on_the_embeddings_sees_a_shift_the_outputs_do_not_show() -> None:
    rng = np.random.default_rng(3)
    ref = _reference(rng)
    same = judge(ref, _window(rng, ref, rng.normal(size=(300, 8))), thin=1)
    assert "mmd_embeddings" in same.p_values and "mmd_outputs" not in same.p_values
    p_same = same.p_values["mmd_embeddings"]
    assert not same.drift and p_same is not None and p_same > 0.05
    # The features moved (a new kind of image) while the class probabilities look the same.
    moved = rng.normal(size=(300, 8))
    moved[:, 0] += 0.6
    w = judge(ref, _window(rng, ref, moved), thin=1)
    assert w.drift and w.flagged == ("mmd_embeddings",), w
    mmd, ks = w.p_values["mmd_embeddings"], w.p_values["ks_bbsd"]
    assert mmd is not None and ks is not None and mmd < 0.01 and ks > 0.05
    # Records without embeddings (an export from before the embedding output): MMD on outputs.
    old = judge(ref, _window(rng, ref, None), thin=1)
    assert "mmd_outputs" in old.p_values and "mmd_embeddings" not in old.p_values


def test_the_reference_stores_its_embeddings(tmp_path: Path) -> None:
    ref = _reference(np.random.default_rng(4), n=50)
    save_reference(tmp_path, ref)
    back = load_reference(tmp_path)
    assert back.embeddings is not None and ref.embeddings is not None
    np.testing.assert_array_equal(back.embeddings, ref.embeddings)
    assert back.meta()["embedding_dim"] == 8
    # Damaged: a row count that is not the reference's.
    save_reference(tmp_path, dataclasses.replace(ref, embeddings=ref.embeddings[:10]))
    with pytest.raises(Exception, match="damaged"):
        load_reference(tmp_path)
