"""DDP for detection on CPU (gloo) with 2 processes: `visionloop train --nproc-per-node 2`
trains the native detector, and the val metrics it logs (each rank evaluates its strided share
of the val split, and the evaluator's states are summed over ranks) equal those of the same
final weights evaluated in one process on the whole val split — so no image is lost or counted
twice on the way across ranks, though the ranks hold different numbers of images.

No comparison with a single-process run of the same global batch: the detector's losses are
normalised by the objects in each rank's batch and its BatchNorm sees 4 images, not 8, so the
weights of the two runs are not expected to be close (the classification DDP test compares
torchrun with the launcher instead)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from _trainkit import popen, write_spec
from visionloop.data.ingest import IngestOptions, ingest
from visionloop.data.manifest import eval_split, read_manifest
from visionloop.data.normalize import Normalizer
from visionloop.data.sampler import EvalBatchSampler
from visionloop.models import ModelCard
from visionloop.specs import validate_train_spec
from visionloop.tasks import get_task
from visionloop.tasks.detection.evaluate import SCALARS, DetectionTaskEvaluator
from visionloop.tasks.evaluation import EvalResult
from visionloop.train.setup import open_split

WORLD = 2
BATCH = 8  # global; each rank's eval batch is BATCH // WORLD = 4
# 42 rendered images with val_fraction 0.2 → 33 train (4 steps an epoch), 9 val: 9 is not a
# multiple of WORLD * 4, rank 0 holds 5 val images in 2 batches and rank 1 holds 4 in 1.
IMAGES, VAL_FRACTION, VAL = 42, 0.2, 9


@pytest.fixture(scope="module")
def detection_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The task's example source (rendered digits, COCO json) through the real ingest."""
    root = tmp_path_factory.mktemp("det-ddp")
    task = get_task("detection")
    source = task.example_source(root / "source", IMAGES, seed=0)
    out = root / "ds"
    ingest(source, out, IngestOptions(val_fraction=VAL_FRACTION, seed=0, workers=1))
    return out


def det_doc(dataset: Path) -> dict[str, Any]:
    task = get_task("detection")
    return {
        "task": "detection",
        "data": {
            "dataset": str(dataset),
            "batch_size": BATCH,
            "workers": 0,
            "image_size": task.example_image_size,
            "augment": {"hflip": 0.5, "scale": [0.5, 1.0], "color_jitter": 0.1},
        },
        "model": {
            "arch": task.example_arch,
            "kwargs": {"widths": [8, 16, 16, 24], "neck": 16, "score_thresh": 0.001},
        },
        "optimizer": {"name": "adamw", "lr": 0.02},
        "schedule": {"name": "cosine", "warmup_steps": 2},
        "epochs": 2,
        "seed": 0,
        "deterministic": True,
        "checkpoint": {"every_steps": 4, "keep_last": 1},
        "tracking": {"experiment": "det-ddp-tests"},
    }


def evaluate_in_one_process(run_dir: Path, spec_doc: dict[str, Any]) -> EvalResult:
    """The run's final weights, loaded from its card, evaluated without any process group on
    the whole eval split, in one pass over it (batches of 3, unlike the ranks' 4)."""
    task = get_task("detection")
    card = ModelCard.load(run_dir / "model_card.json")
    model = task.load_model(card, run_dir / "final.safetensors")
    spec = validate_train_spec(spec_doc)
    manifest = read_manifest(spec.data.dataset)
    split = eval_split(manifest)
    assert split == "val"
    reader = open_split(manifest, spec.data.dataset, split)
    assert reader is not None
    dataset = task.eval_dataset(reader, spec)
    (m0, m1, m2), (s0, s1, s2) = card.mean, card.std
    normalize = Normalizer((m0, m1, m2), (s0, s1, s2))
    evaluator = DetectionTaskEvaluator(card.class_names)
    n = len(reader)
    with torch.no_grad():
        for start in range(0, n, 3):
            x, y = task.collate([dataset[(i, 0)] for i in range(start, min(start + 3, n))])
            out, loss_sum = task.eval_forward(model, normalize(x), y, task.loss_fn(spec))
            evaluator.update(out, y, loss_sum)
    assert evaluator.inner.num_images == VAL
    return evaluator.compute()


@pytest.mark.slow
def test_two_process_ddp_detection_logs_the_whole_split_val_map(
    tmp_path: Path, detection_dataset: Path
) -> None:
    manifest = read_manifest(detection_dataset)
    assert manifest.task == "detection" and manifest.splits["val"].count == VAL
    # Ranks hold different numbers of val images and of eval batches.
    shares = [list(EvalBatchSampler(VAL, BATCH // WORLD, rank=r, world_size=WORLD)) for r in range(WORLD)]
    assert [sum(len(b) for b in s) for s in shares] == [5, 4] and [len(s) for s in shares] == [2, 1]

    doc = det_doc(detection_dataset)
    spec = write_spec(tmp_path / "spec.yaml", doc)
    run_dir = tmp_path / "run"
    p = popen("train", str(spec), "--run-dir", str(run_dir), "--nproc-per-node", str(WORLD))
    out = p.communicate(timeout=600)[0]
    assert p.returncode == 0, out
    assert f"{WORLD} processes" in out

    weights = load_file(str(run_dir / "final.safetensors"))
    assert len(weights) > 10 and all(torch.isfinite(t).all() for t in weights.values())
    run = json.loads((run_dir / "run.json").read_text())
    assert run["status"] == "succeeded" and run["step"] == 8  # 33 // 8 = 4 steps x 2 epochs
    ddp = run["final_metrics"]
    assert {"mAP", "mAP50", "AR100", "AP/0", "AP/1", "AP/2"} <= ddp.keys()
    report = json.loads((run_dir / "eval" / "step-000000008" / "report.json").read_text())
    assert report["num_images"] == VAL

    # Logged as val/mAP by rank 0, once per evaluation, with the value in run.json.
    from mlflow.tracking import MlflowClient

    from visionloop.core.settings import load_settings

    history = MlflowClient(load_settings().tracking_uri).get_metric_history(run["mlflow_run_id"], "val/mAP")
    assert sorted(m.step for m in history) == [4, 8]
    assert [m.value for m in history if m.step == 8] == [pytest.approx(ddp["mAP"], abs=1e-9)]

    # The same final weights in one process on the whole split. The same boxes per class:
    # every val image crossed the ranks once.
    whole = evaluate_in_one_process(run_dir, doc)
    assert {c["name"]: c["num_gt"] for c in report["per_class"]} == {
        c["name"]: c["num_gt"] for c in whole.report["per_class"]
    }
    # The same detections per class and the same metrics: every rank evaluated the saved
    # weights. (Eight steps leave mAP near 0, so the detection counts carry most of the weight.)
    num_pred = {c["name"]: c["num_pred"] for c in report["per_class"]}
    assert sum(num_pred.values()) > 0
    # Every rank evaluated the saved weights (rank 0's BatchNorm statistics): the same counts.
    assert num_pred == {c["name"]: c["num_pred"] for c in whole.report["per_class"]}
    for k in (*SCALARS, "AR1", "AR10", "AP/0", "AP/1", "AP/2"):
        assert (k in whole.metrics) == (k in ddp), k
        if k in ddp:
            assert whole.metrics[k] == pytest.approx(ddp[k], abs=1e-9), (k, whole.metrics[k], ddp[k])
    assert report["metrics"] == pytest.approx(ddp, abs=1e-12)
