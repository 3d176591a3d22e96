"""Training a detector end to end through the trainer (`visionloop.train.api.train`): a tiny
synthetic detection dataset (rendered digits, real shards and manifest), the native detector
on CPU, val/mAP measured and used to choose the best checkpoint, the model card, and exact
resumption: a run stopped midway and resumed ends bitwise identical to one that never stopped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from visionloop.data.manifest import (
    ChannelStats,
    DatasetManifest,
    ImagePolicy,
    SizeStats,
    SourceInfo,
    SplitInfo,
    SplitPolicy,
    write_manifest,
)
from visionloop.data.shards import ShardWriter, make_record
from visionloop.models import ModelCard
from visionloop.specs import validate_train_spec
from visionloop.tasks.detection.annotations import read_coco
from visionloop.tasks.detection.boxes import encode_boxes
from visionloop.tasks.detection.synthetic import generate_detection_dataset
from visionloop.train.api import train
from visionloop.train.checkpoint import CheckpointManager
from visionloop.train.report import Reporter
from visionloop.train.signals import StopRequest

SIZE = 64
CLASSES = (3, 7)
TRAIN, VAL = 32, 8


@pytest.fixture(scope="module")
def detection_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rendered digits (COCO json + PNGs) → shards with boxes → a detection dataset folder."""
    root = tmp_path_factory.mktemp("det")
    coco = generate_detection_dataset(
        root / "source", TRAIN + VAL, image_size=SIZE, classes=CLASSES, max_objects=2, digit_size=(16, 30)
    )
    source = read_coco(root / "source" / "images", coco)
    names = [str(c) for c in CLASSES]
    out = root / "ds"
    splits: dict[str, SplitInfo] = {}
    for split, samples in (("train", source.samples[:TRAIN]), ("val", source.samples[TRAIN:])):
        writer = ShardWriter(out / "shards" / split)
        per_class = dict.fromkeys(names, 0)
        for i, s in enumerate(samples):
            labels = [int(k) for k in s.labels]
            for k in labels:
                per_class[names[k]] += 1
            writer.add(
                make_record(
                    Path(s.image).read_bytes(),
                    len(labels),
                    i + (0 if split == "train" else TRAIN),
                    boxes=encode_boxes(np.asarray(s.boxes, dtype=np.float32).reshape(-1, 4), labels),
                )
            )
        writer.close()
        splits[split] = SplitInfo(
            count=len(samples), per_class=per_class, shard_dir=f"shards/{split}", bytes=writer.bytes
        )
    write_manifest(
        out,
        DatasetManifest(
            version="det-test-1",
            task="detection",
            classes=names,
            splits=splits,
            image_policy=ImagePolicy(),
            source=SourceInfo(kind="coco", path=str(coco), files_seen=TRAIN + VAL),
            split_policy=SplitPolicy(seed=0, val_fraction=0.2, test_fraction=0.0, from_source=False),
            channel_stats=ChannelStats(mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25)),
            size_stats=SizeStats(min=(SIZE, SIZE), median=(SIZE, SIZE), max=(SIZE, SIZE)),
            created_at="2026-01-01T00:00:00+00:00",
            visionloop_version="0.1.0",
        ),
    )
    return out


def det_doc(dataset: Path, **top: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "task": "detection",
        "data": {
            "dataset": str(dataset),
            "batch_size": 8,
            "workers": 0,
            "image_size": SIZE,
            "augment": {"hflip": 0.5, "scale": [0.5, 1.0], "zoom_out": 0.3, "color_jitter": 0.1},
        },
        "model": {
            "arch": "native_detector",
            "kwargs": {"widths": [8, 16, 16, 24], "neck": 16},
        },
        "optimizer": {"name": "adamw", "lr": 0.003},
        "schedule": {"name": "cosine", "warmup_steps": 2},
        "epochs": 2,
        "seed": 0,
        "deterministic": True,
        "checkpoint": {"every_steps": 3, "keep_last": 2, "keep_best": 1},
        "tracking": {"experiment": "det-tests"},
    }
    doc.update(top)
    return doc


class Recorder(Reporter):
    def __init__(self, stop: StopRequest | None = None, stop_at: int | None = None) -> None:
        self.steps: list[int] = []
        self.evals: list[tuple[int, dict[str, float], str]] = []
        self.stop, self.stop_at = stop, stop_at

    def step(self, step: int, loss: float | None, lr: float, images_per_s: float | None) -> None:
        self.steps.append(step)
        if self.stop is not None and step == self.stop_at:
            self.stop.request("test")

    def eval_end(self, epoch: float, step: int, metrics: dict[str, float], summary: str) -> None:
        self.evals.append((step, metrics, summary))


def test_a_detector_trains_logs_val_map_and_keeps_the_best_by_it(
    tmp_path: Path, detection_dataset: Path
) -> None:
    from mlflow.tracking import MlflowClient

    from visionloop.core.settings import load_settings

    rec = Recorder()
    result = train(validate_train_spec(det_doc(detection_dataset)), tmp_path / "run", reporter=rec)
    assert result.exit_code == 0 and result.step == 8  # 32 images / 8 = 4 steps x 2 epochs
    assert [s for s, _, _ in rec.evals] == [4, 8]
    for _, metrics, summary in rec.evals:
        assert {"mAP", "mAP50", "mAP75", "AR100", "AP/3", "AP/7"} <= metrics.keys()
        assert all(0.0 <= metrics[k] <= 1.0 for k in ("mAP", "mAP50", "AR100"))
        assert summary.startswith(f"mAP {metrics['mAP']:.3f}")

    # Tracked as val/<name>, every evaluation.
    run_id = json.loads((tmp_path / "run" / "run.json").read_text())["mlflow_run_id"]
    history = MlflowClient(load_settings().tracking_uri).get_metric_history(run_id, "val/mAP")
    tracked = sorted((m.step, m.value) for m in history)
    assert [s for s, _ in tracked] == [s for s, _, _ in rec.evals]
    assert [v for _, v in tracked] == pytest.approx([m["mAP"] for _, m, _ in rec.evals])

    # The best checkpoint is chosen by val/mAP (checkpoint.best_metric is left to the task):
    # each evaluation's checkpoint carries its mAP, the best is the highest. (A few steps
    # leave mAP near 0; a metric the task did not measure would leave no best at all.)
    manager = CheckpointManager(tmp_path / "run" / "checkpoints", keep_last=2, keep_best=1)
    scored = {c.step: c.metric for c in manager.infos() if c.metric is not None}
    evals = {s: m["mAP"] for s, m, _ in rec.evals}
    assert 8 in scored and all(scored[s] == pytest.approx(evals[s]) for s in scored)
    best = manager.best()
    assert best is not None and best.metric == max(m["mAP"] for _, m, _ in rec.evals)
    assert result.best_metric == best.metric

    # The evaluation's artifacts and the model card.
    eval_dir = tmp_path / "run" / "eval" / "step-000000008"
    written = {p.name for p in eval_dir.iterdir()} if eval_dir.is_dir() else set()
    assert {"report.json", "pr_curves.png", "confusion_matrix.png", "predictions.png"} <= written, written
    # Earlier evaluations keep their numbers; the plots are drawn for the final one only.
    earlier = [d for d in (tmp_path / "run" / "eval").iterdir() if d != eval_dir]
    assert earlier and all({p.name for p in d.iterdir()} == {"report.json"} for d in earlier), earlier
    card = ModelCard.load(tmp_path / "run" / "model_card.json")
    assert (card.task, card.arch, card.input_size, card.resize) == (
        "detection",
        "native_detector",
        (3, SIZE, SIZE),
        "letterbox",
    )
    assert card.mean == (0.0, 0.0, 0.0) and card.std == (1.0, 1.0, 1.0)
    assert card.class_names == ["3", "7"] and card.metrics is not None
    assert card.metrics["mAP"] == pytest.approx(rec.evals[-1][1]["mAP"])


def test_a_stopped_and_resumed_detector_run_is_bitwise_identical(
    tmp_path: Path, detection_dataset: Path
) -> None:
    spec = validate_train_spec(det_doc(detection_dataset))
    reference = train(spec, tmp_path / "reference", reporter=Recorder(), track=False)
    assert reference.exit_code == 0 and reference.step == 8

    stop = StopRequest()
    first = train(spec, tmp_path / "run", reporter=Recorder(stop, stop_at=5), track=False, stop=stop)
    assert first.exit_code == 75 and first.step == 5  # mid-epoch, after the first evaluation
    rec = Recorder()
    second = train(spec, tmp_path / "run", reporter=rec, track=False)
    assert second.exit_code == 0 and rec.steps == [6, 7, 8]

    a = load_file(str(tmp_path / "reference" / "final.safetensors"))
    b = load_file(str(tmp_path / "run" / "final.safetensors"))
    assert a.keys() == b.keys() and len(a) > 10
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ after resumption: {different[:5]}"
    assert second.final_metrics["mAP"] == reference.final_metrics["mAP"]
