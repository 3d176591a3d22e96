"""One suite over every registered task: what the task contract promises, each stage in turn.

For each task (`visionloop.tasks.list_tasks()`): ingest the small source the task generates
(`Task.example_source`), train its example architecture a few steps, stop and resume to the
same weights bit for bit, register the run, export it to ONNX through the gate, compare the
export with eager PyTorch, and serve one image through the task's image endpoint and one
tensor through the Open Inference Protocol. A new task under `tasks/<name>/` is picked up here
with nothing else to change.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from visionloop.core.settings import load_settings
from visionloop.data.ingest import IngestOptions, ingest
from visionloop.data.manifest import eval_split, read_manifest
from visionloop.models.card import ModelCard
from visionloop.specs import validate_train_spec
from visionloop.tasks import AnswerOptions, ImageContext, get_task, list_tasks
from visionloop.tasks.drift_outputs import EMBEDDING_OUTPUT
from visionloop.train.api import train
from visionloop.train.report import Reporter
from visionloop.train.signals import StopRequest

TASKS = list_tasks()
STEPS = 6


@pytest.fixture(scope="module", params=TASKS)
def task_dataset(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path]:
    """The task's example source, through the real ingest (read-only for the tests)."""
    name: str = request.param
    root = tmp_path_factory.mktemp(f"contract-{name}")
    source = get_task(name).example_source(root / "source", 48, seed=0)
    out = root / "dataset"
    ingest(source, out, IngestOptions(seed=0, workers=1))
    return name, out


def spec_for(name: str, dataset: Path, **extra: object) -> dict[str, object]:
    task = get_task(name)
    doc: dict[str, object] = {
        "task": name,
        "data": {
            "dataset": str(dataset),
            "batch_size": 8,
            "workers": 0,
            "image_size": task.example_image_size,
            "augment": {"hflip": 0.5},
        },
        "model": {"arch": task.example_arch},
        "optimizer": {"name": "adamw", "lr": 0.002},
        "steps": STEPS,
        "seed": 0,
        "deterministic": True,
        "checkpoint": {"every_steps": 2, "keep_last": 2},
        "eval": {"every_epochs": 1},
    }
    doc.update(extra)
    return doc


class StopAt(Reporter):
    def __init__(self, stop: StopRequest, at: int) -> None:
        super().__init__()
        self.stop, self.at = stop, at

    def step(self, step: int, loss: float | None, lr: float, images_per_s: float | None) -> None:
        if step == self.at:
            self.stop.request("test")


def test_ingest_records_the_task_and_an_eval_split(task_dataset: tuple[str, Path]) -> None:
    name, dataset = task_dataset
    manifest = read_manifest(dataset)
    assert manifest.task == name
    assert eval_split(manifest) == "val"
    assert manifest.splits["train"].count > 0 and manifest.splits["val"].count > 0


def test_stop_and_resume_reach_the_same_weights_bit_for_bit(
    tmp_path: Path, task_dataset: tuple[str, Path]
) -> None:
    name, dataset = task_dataset
    spec = validate_train_spec(spec_for(name, dataset))
    whole = train(spec, tmp_path / "whole", track=False)
    assert whole.exit_code == 0 and whole.step == STEPS

    stop = StopRequest()
    first = train(spec, tmp_path / "split", reporter=StopAt(stop, 3), track=False, stop=stop)
    assert first.exit_code == 75 and first.step == 3
    second = train(spec, tmp_path / "split", track=False)
    assert second.exit_code == 0 and second.step == STEPS

    a = load_file(str(tmp_path / "whole" / "final.safetensors"))
    b = load_file(str(tmp_path / "split" / "final.safetensors"))
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{name}: weights differ after a stop and resume: {differ[:5]}"
    # The primary metric was measured and decided which checkpoint is best.
    task = get_task(name)
    assert task.primary_metric in whole.final_metrics


def test_register_export_compare_and_serve(tmp_path: Path, task_dataset: tuple[str, Path]) -> None:
    from visionloop.export import export_model
    from visionloop.registry import register
    from visionloop.serve.config import ServeConfig
    from visionloop.serve.server import BackgroundServer
    from visionloop.serve.source import RegistrySource

    name, dataset = task_dataset
    task = get_task(name)
    settings = load_settings().ensure()
    result = train(validate_train_spec(spec_for(name, dataset)), tmp_path / "run", settings=settings)
    assert result.exit_code == 0

    info = register(result.run_dir, name=f"contract-{name}", settings=settings)
    card = info.card()
    assert card.task == name

    # An untrained model's score can be anything; the gate compares it with eager PyTorch on
    # the same images, so the fp32 export must match eager within the task's own parity.
    report = export_model(info, precision="fp32", settings=settings)
    assert report.passed, report.reason
    assert report.max_abs_diff < 1e-3
    assert abs(report.accuracy - report.reference_accuracy) * 100 <= 1.0
    # int8 is checked with the task's own parity limits (a detector's boxes only by the mAP
    # gate), whether or not this barely trained model passes them.
    from visionloop.export.report import ExportGateError

    try:
        int8 = export_model(info, precision="int8", settings=settings, calibration_size=16)
    except ExportGateError as refused:
        int8 = refused.report
    max_diff, min_agreement = task.parity_limits["int8"]
    assert (int8.max_abs_diff_threshold, int8.top1_agreement_threshold) == (max_diff, min_agreement)
    assert int8.parity_passed == (int8.top1_agreement >= min_agreement)

    image = _an_image(dataset)
    expected = _answer_from_onnx(Path(report.path), card, image)
    config = ServeConfig(model=info.name, port=0, prediction_log=False)
    with BackgroundServer(config, RegistrySource(settings), insecure_no_auth=True) as server:
        r = httpx.post(
            f"{server.url}/v2/models/{info.name}/{task.image_endpoint}",
            content=image,
            headers={"Content-Type": "image/png"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body.pop("model_name") == info.name
        assert body.pop("model_version") == str(info.version)
        # The served answer is the task's answer to the exported model's outputs for the
        # card's preprocessing of that image: no stage in between changed it.
        assert body.keys() == expected.keys()
        assert _close(body, expected), (body, expected)

        c, h, w = card.input_size
        x = np.random.default_rng(0).random((2, c, h, w), dtype=np.float32)
        infer = {
            "inputs": [
                {"name": "input", "shape": [2, c, h, w], "datatype": "FP32", "data": x.ravel().tolist()}
            ]
        }
        r = httpx.post(f"{server.url}/v2/models/{info.name}/infer", json=infer, timeout=60)
        assert r.status_code == 200, r.text
        outputs = {o["name"]: o for o in r.json()["outputs"]}
        # The task's outputs, then the embedding the export adds (both example archs have one;
        # at most 16 components, fewer on a validation split this small: images - 1).
        assert report.embedding_dim is not None and 1 < report.embedding_dim <= 16
        assert list(outputs) == [*task.output_names, EMBEDDING_OUTPUT]
        assert outputs[EMBEDDING_OUTPUT]["shape"] == [2, report.embedding_dim]
        assert all(o["shape"][0] == 2 for o in outputs.values())


def _answer_from_onnx(onnx_path: Path, card: ModelCard, image: bytes) -> dict[str, Any]:
    """What the image endpoint should answer, computed here with ONNX Runtime and the task."""
    import onnxruntime as ort
    from PIL import Image

    task = get_task(card.task)
    with Image.open(io.BytesIO(image)) as im:
        im.load()
        width, height = im.size
        x = card.eval_preprocess().to_transform()(im).numpy()[None].astype(np.float32)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(names, {session.get_inputs()[0].name: x}), strict=True))
    context = ImageContext(
        width=width, height=height, input_height=card.input_size[1], input_width=card.input_size[2]
    )
    return task.served_answer(outputs, card.class_names, options=AnswerOptions(), image=context)


def _close(a: Any, b: Any) -> bool:
    """Equal JSON, floats within 1e-4 (server and test run the same graph, maybe other threads)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) or isinstance(b, float):
        return abs(float(a) - float(b)) <= 1e-4 * max(1.0, abs(float(b)))
    return bool(a == b)


def _an_image(dataset: Path) -> bytes:
    """The PNG bytes of the first validation record of the dataset."""
    from visionloop.data.manifest import shard_dir_of
    from visionloop.data.shards import ShardReader

    manifest = read_manifest(dataset)
    record = ShardReader(shard_dir_of(dataset, manifest.splits["val"]))[0]
    return record["image"]


def test_eval_with_stress_through_the_contract(tmp_path: Path, task_dataset: tuple[str, Path]) -> None:
    """`visionloop eval` knows no task: the task's metrics, error analysis and (where its
    outputs are one softmax) calibration come through the contract, clean and corrupted."""
    from visionloop.eval.api import evaluate_model
    from visionloop.eval.options import EvalOptions
    from visionloop.registry import register

    name, dataset = task_dataset
    task = get_task(name)
    settings = load_settings().ensure()
    result = train(validate_train_spec(spec_for(name, dataset)), tmp_path / "run", settings=settings)
    assert result.exit_code == 0
    info = register(result.run_dir, name=f"eval-{name}", settings=settings)
    options = EvalOptions(stress=True, corruptions=("occlusion", "night"), severities=(1, 5), seed=1)
    report = evaluate_model(info, options, settings=settings)
    assert report.task == name and report.metric == task.primary_metric
    assert report.clean == pytest.approx(result.final_metrics[task.primary_metric], abs=1e-6)
    assert [(c.corruption, c.severity) for c in report.stress] == [
        ("occlusion", 1),
        ("occlusion", 5),
        ("night", 1),
        ("night", 5),
    ]
    assert all(0.0 <= c.value <= 1.0 for c in report.stress)
    assert report.stress_mean == pytest.approx(sum(c.value for c in report.stress) / 4)
    assert report.errors is not None
    assert isinstance(report.errors["confused"], list)
    again = evaluate_model(info, options, settings=settings)
    assert [c.metrics for c in again.stress] == [c.metrics for c in report.stress]  # seeded
    # Every task calibrates its confidences (a detector's, per detection); an untrained one
    # may give nothing to calibrate, which the report says instead of failing.
    if report.calibration is None:
        assert report.calibration_note and name in report.calibration_note
    else:
        assert 0.0 <= report.calibration["ece"] <= 1.0 and report.calibration["samples"] > 0

    # Slices (`visionloop eval --slices`) score subsets of the pass again from each image's
    # kept result (Task.image_result, join_results, repeated_targets): a slice holding every
    # image gives the clean metric, and a bootstrap that draws images twice works for the task.
    from visionloop.data.manifest import shard_dir_of
    from visionloop.data.shards import ShardReader
    from visionloop.eval.run import score
    from visionloop.eval.slices import compute_slices

    card = info.card()
    data = read_manifest(dataset)
    reader = ShardReader(shard_dir_of(dataset, data.splits[report.split]))  # type: ignore[index]
    model = task.load_model(card, info.weights)
    loss_fn = task.loss_fn(validate_train_spec(spec_for(name, dataset)))
    kept = score(
        task, card, model, loss_fn, reader, range(len(reader)), device=torch.device("cpu"), keep_images=True
    )
    assert kept.images is not None and len(kept.images) == len(reader) == report.images
    assert kept.result.metrics[task.primary_metric] == pytest.approx(report.clean, abs=1e-6)
    (whole,) = compute_slices(
        task, card.class_names, kept.images, ["all"] * len(reader), column="c", seed=0, resamples=10
    )
    assert whole.metric == pytest.approx(report.clean, abs=1e-6)
    halves = compute_slices(
        task,
        card.class_names,
        kept.images,
        [i % 2 for i in range(len(reader))],
        column="c",
        seed=0,
        resamples=10,
    )
    assert sorted(str(s.value) for s in halves) == ["0", "1"] and sum(s.images for s in halves) == len(reader)
    for s in halves:
        assert s.metric is None or s.ci_low is None or s.ci_low <= s.metric <= s.ci_high  # type: ignore[operator]
