"""Trainer settings checked by what they do: `optimizer.grad_clip_norm` bounds the gradient the
optimizer steps with, `loss.label_smoothing` is the loss that is logged, and
`eval.every_epochs` / `tracking.log_every_steps` hold across a SIGKILL and a resume (every
step in MLflow exactly once, evaluations at the right epochs only)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from _trainkit import spec_doc, write_spec
from visionloop.specs import validate_train_spec
from visionloop.train.api import train
from visionloop.train.report import Reporter, StartInfo


class Steps(Reporter):
    def __init__(self) -> None:
        self.steps: list[tuple[int, float | None]] = []
        self.info: StartInfo | None = None

    def start(self, info: StartInfo) -> None:
        self.info = info

    def step(self, step: int, loss: float | None, lr: float, images_per_s: float | None) -> None:
        self.steps.append((step, loss))


# -- optimizer.grad_clip_norm -----------------------------------------------------------------


def grad_norms_at_optimizer_steps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The total gradient norm each optimizer step is taken with (a step pre-hook on the
    optimizer the trainer builds), i.e. after clipping and after the grad scaler's unscale."""
    import visionloop.train.setup as setup
    from visionloop.train.schedule import build_optimizer as real

    norms: list[float] = []

    def hook(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        grads = [p.grad.double() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norms.append(
            float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        )

    def build(*args: Any, **kwargs: Any) -> torch.optim.Optimizer:
        optimizer = real(*args, **kwargs)
        optimizer.register_step_pre_hook(hook)
        return optimizer

    monkeypatch.setattr(setup, "build_optimizer", build)
    return norms


CLIP = 0.05  # far below this model's gradient norms at the start of training (about 1)


@pytest.mark.parametrize(("precision", "clip"), [("fp32", CLIP), ("fp32", None), ("fp16", CLIP)])
def test_grad_clip_norm_bounds_the_gradient_the_optimizer_steps_with(
    tmp_path: Path, digits_dataset: Path, monkeypatch: pytest.MonkeyPatch, precision: str, clip: float | None
) -> None:
    norms = grad_norms_at_optimizer_steps(monkeypatch)
    doc = spec_doc(
        digits_dataset,
        epochs=None,
        steps=3,
        precision=precision,
        deterministic=precision == "fp32",  # CPU fp16 needs deterministic: false
        data__workers=0,
        optimizer={"name": "sgd", "lr": 0.1, "momentum": 0.0, "grad_clip_norm": clip},
    )
    result = train(validate_train_spec(doc), tmp_path / "run", track=False)
    assert result.exit_code == 0 and result.step == 3
    # fp16 may skip a step whose scaled gradient overflowed (the scaler then backs off).
    assert len(norms) == 3 if precision == "fp32" else 1 <= len(norms) <= 3, norms
    if clip is None:
        assert all(n > 10 * CLIP for n in norms), norms  # what clipping has to bring down
    else:
        # clip_grad_norm_ scales to clip * norm / (norm + 1e-6): the bound, reached (not merely
        # "below it", which a too-small gradient, e.g. one clipped while still scaled, also is).
        assert all(n == pytest.approx(clip, rel=1e-4) for n in norms), norms


# -- loss.label_smoothing ---------------------------------------------------------------------


def first_batch_labels(dataset: Path, spec_doc_: dict[str, Any]) -> torch.Tensor:
    """The labels of training step 1, from the sampler's order (a pure function of seed and
    epoch) and the shards: independent of how the loss is computed."""
    from visionloop.data.manifest import read_manifest
    from visionloop.data.sampler import epoch_order
    from visionloop.data.shards import ShardReader

    manifest = read_manifest(dataset)
    reader = ShardReader(dataset / manifest.splits["train"].shard_dir)
    spec = validate_train_spec(spec_doc_)
    order = epoch_order(reader.chunk_sizes, spec.seed, 0, spec.data.shuffle_window)
    positions = order[: spec.data.batch_size].tolist()
    return torch.tensor([r["label"] for r in reader.read_many(positions)])


def smoothed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, eps: float) -> float:
    """By hand: (1 - eps) * NLL of the true class + eps * mean NLL over all classes."""
    logp = torch.log_softmax(logits.double(), dim=1)
    nll = -logp[torch.arange(len(labels)), labels].mean()
    uniform = -logp.mean(dim=1).mean()
    return float((1 - eps) * nll + eps * uniform)


@pytest.mark.parametrize("eps", [0.0, 0.3])
def test_the_logged_loss_is_cross_entropy_with_the_label_smoothing_asked_for(
    tmp_path: Path, digits_dataset: Path, monkeypatch: pytest.MonkeyPatch, eps: float
) -> None:
    import visionloop.models as models

    logits: list[torch.Tensor] = []
    real = models.create_model  # the task builds the model through the architecture registry

    def create(*args: Any, **kwargs: Any) -> torch.nn.Module:
        model = real(*args, **kwargs)
        model.register_forward_hook(
            lambda _m, _i, out: logits.append(out.detach().clone()) if torch.is_grad_enabled() else None
        )
        return model

    monkeypatch.setattr(models, "create_model", create)
    doc = spec_doc(digits_dataset, epochs=None, steps=1, data__workers=0, loss={"label_smoothing": eps})
    rec = Steps()
    train(validate_train_spec(doc), tmp_path / "run", reporter=rec, track=False)
    assert len(logits) == 1 and rec.steps and rec.steps[0][0] == 1
    labels = first_batch_labels(digits_dataset, doc)
    logged = rec.steps[0][1]
    assert logged is not None
    assert logged == pytest.approx(smoothed_cross_entropy(logits[0], labels, eps), rel=1e-5)
    if eps:  # the smoothing is large enough to tell apart from plain cross-entropy
        plain = smoothed_cross_entropy(logits[0], labels, 0.0)
        assert abs(logged - plain) > 0.01, (logged, plain)


# -- eval.every_epochs and tracking.log_every_steps across a SIGKILL --------------------------

# Train, printing each step the reporter is told of, and SIGKILL this process (no clean-up:
# checkpoint writes and metric flushes may be in flight) either the moment checkpoint N is
# durable ("checkpoint N") or when the reporter is told of step N or later ("report N").
KILLED = r"""
import os, signal, sys, time
from pathlib import Path
import visionloop.train.checkpoint as ck
from visionloop.specs import load_train_spec
from visionloop.train.api import train
from visionloop.train.report import Reporter

when, at = sys.argv[3], int(sys.argv[4])
real = ck.write_checkpoint
def write_then_die(path, state, step, metric, before_commit=None):
    real(path, state, step, metric, before_commit)
    if when == "checkpoint" and step == at:
        os.kill(os.getpid(), signal.SIGKILL)
ck.write_checkpoint = write_then_die

class Steps(Reporter):
    def step(self, step, loss, lr, images_per_s):
        if when == "checkpoint" and step > at:
            # The checkpoint is written off the training loop: hold the loop here until the
            # write of checkpoint `at` kills the process, or a loaded machine lets it run (and
            # log) steps past it first (seen in CI: step 29 reported before the kill).
            time.sleep(120)
        print("step", step, repr(loss), flush=True)
        if when == "report" and step >= at:
            os.kill(os.getpid(), signal.SIGKILL)

spec, _ = load_train_spec(Path(sys.argv[1]))
train(spec, Path(sys.argv[2]), reporter=Steps())
"""

BATCH, STEPS_PER_EPOCH, EPOCHS = 128, 11, 4  # about 1437 training images // 128
TOTAL = STEPS_PER_EPOCH * EPOCHS
LOG_EVERY, EVAL_EVERY, CHECKPOINT_EVERY = 5, 2, 8


def reported_steps(after: int) -> list[int]:
    """The steps the reporter is told of when training runs on from step `after`: the end of an
    interval of LOG_EVERY steps, and where an interval is cut short: an epoch's end and a
    periodic checkpoint (its steps are logged before it)."""
    out, n = [], 0
    for step in range(after + 1, TOTAL + 1):
        n += 1
        if n == LOG_EVERY or step % STEPS_PER_EPOCH == 0 or step % CHECKPOINT_EVERY == 0:
            out.append(step)
            n = 0
    return out


def killed(spec: Path, run_dir: Path, when: str, at: int) -> list[tuple[int, float]]:
    p = subprocess.run(
        [sys.executable, "-c", KILLED, str(spec), str(run_dir), when, str(at)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == -9, p.stderr[-3000:]
    return [
        (int(s), float(v)) for _, s, v in (x.split() for x in p.stdout.splitlines() if x.startswith("step "))
    ]


@pytest.mark.timeout(300)
def test_eval_every_epochs_and_log_every_steps_hold_across_a_sigkill_and_resume(
    tmp_path: Path, digits_dataset: Path, vl_home: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from mlflow.tracking import MlflowClient

    from _mlflowkit import copy_migrated_store
    from visionloop.core.settings import load_settings
    from visionloop.data.manifest import read_manifest

    train_images = read_manifest(digits_dataset).splits["train"].count
    assert train_images // BATCH == STEPS_PER_EPOCH, f"the steps below assume {STEPS_PER_EPOCH} steps/epoch"
    copy_migrated_store(tmp_path_factory, vl_home)
    doc = spec_doc(
        digits_dataset,
        epochs=EPOCHS,
        data__workers=0,
        data__batch_size=BATCH,
        data__augment={"random_resized_crop": False, "hflip": 0.0},  # cheaper steps, same loop
        eval={"every_epochs": EVAL_EVERY},
        tracking={"experiment": "tests", "log_every_steps": LOG_EVERY},
        checkpoint={"every_steps": CHECKPOINT_EVERY, "every_minutes": None, "keep_last": 2},
    )
    spec = write_spec(tmp_path / "spec.yaml", doc)
    run_dir = tmp_path / "run"
    told: dict[int, float] = {}

    # 1. Killed the moment checkpoint 24 is durable: steps 23 and 24, still in an open logging
    #    interval when it was taken, must already be in the store (nothing replays them).
    first = killed(spec, run_dir, "checkpoint", 24)
    assert [s for s, _ in first] == reported_steps(0)[:7] == [5, 8, 11, 16, 21, 22, 24]
    told.update(first)
    run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]

    # 2. Resumed, and killed after logging steps past its next checkpoint (32): those steps are
    #    logged again by the next resume, and must not be stored twice.
    second = killed(spec, run_dir, "report", 35)
    assert [s for s, _ in second] == reported_steps(24)[:4] == [29, 32, 33, 38]
    told.update(second)

    # 3. Resumed to the end in this process.
    rec = Steps()
    result = train(validate_train_spec(doc), run_dir, reporter=rec)
    assert result.exit_code == 0 and result.step == TOTAL and result.run_id == run_id
    assert rec.info is not None and rec.info.resumed_from_step in (24, 32)  # 32 if durable by the kill
    assert [s for s, _ in rec.steps] == reported_steps(rec.info.resumed_from_step)
    told.update((s, float(v)) for s, v in rec.steps if v is not None)

    client = MlflowClient(load_settings().tracking_uri)
    history = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, TOTAL + 1))  # each step once, no gap
    # What the reporter was told is what the store holds for that step (resumption is exact,
    # so a replayed step has the same loss as the first time).
    stored = {m.step: m.value for m in history}
    assert all(math.isfinite(v) and stored[s] == pytest.approx(v, rel=1e-6) for s, v in told.items()), told

    evals = [STEPS_PER_EPOCH * e for e in range(EVAL_EVERY, EPOCHS + 1, EVAL_EVERY)]  # [22, 44]
    for key in ("val/accuracy", "val/loss", "epoch"):
        assert sorted(m.step for m in client.get_metric_history(run_id, key)) == evals, key
    epochs = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "epoch"))
    assert epochs == [(s, float(s // STEPS_PER_EPOCH)) for s in evals]
    assert sorted(d.name for d in (run_dir / "eval").iterdir()) == [f"step-{s:09d}" for s in evals]
