"""`distributed: fsdp` (FSDP2) on CPU with 2 processes over gloo: sharded DCP checkpoints,
a run stopped as an evaluation starts resumed bitwise exactly, the same final.safetensors a DDP
run writes (and the same weights, without clipping), and a checkpoint written by 2 processes
at a SIGTERM resumed by 1.

FSDP2 runs on CPU/gloo in torch 2.14 (all-gather and reduce-scatter included), so these need
no GPU. The specs clip gradients (the sharded-gradient norm path; the bitwise comparison with
DDP does not, see there) and use an eval batch of 179
over 359 images, so rank 0 has two eval batches and rank 1 one: without gathering the
parameters for evaluation, FSDP's per-forward all-gather would hang there."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from _trainkit import cli, popen, spec_doc, write_spec
from visionloop.models import ModelCard, create_model, load_weights
from visionloop.specs import validate_train_spec
from visionloop.train.api import train
from visionloop.train.report import Reporter
from visionloop.train.signals import StopRequest

pytestmark = pytest.mark.slow


_STOP_AT_EVAL = """
import sys
from pathlib import Path

from visionloop.specs import load_train_spec
from visionloop.train.api import train
from visionloop.train.report import Reporter
from visionloop.train.signals import StopRequest

stop = StopRequest()


class StopAtEval(Reporter):
    def eval_start(self, epoch, rounds):
        stop.request("test")


spec = load_train_spec(Path(sys.argv[1]))[0]
result = train(spec, Path(sys.argv[2]), reporter=StopAtEval(), track=False, stop=stop)
print(f"exit {result.exit_code} at step {result.step}")
"""


def _doc(dataset: Path, **overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "distributed": "fsdp",
        "data__workers": 0,
        "data__eval_batch_size": 179,
        "optimizer__grad_clip_norm": 0.5,
    }
    return spec_doc(dataset, **{**fields, **overrides})


def _train(spec: Path, run_dir: Path, *extra: str) -> str:
    p = cli("train", str(spec), "--run-dir", str(run_dir), "--no-track", *extra, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    return out


def _train_and_sigterm(spec: Path, run_dir: Path) -> str:
    """Start 2 processes, SIGTERM the whole group after the first checkpoint, expect exit 75."""
    p = popen("train", str(spec), "--run-dir", str(run_dir), "--nproc-per-node", "2", "--no-track")
    assert p.stdout is not None
    for line in p.stdout:
        if "checkpoint at step" in line:
            break
    os.killpg(p.pid, signal.SIGTERM)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 75, out
    assert "stopping (SIGTERM)" in out
    return out


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final.safetensors"))


def test_fsdp_stopped_at_an_evaluation_resumes_bitwise_exact_and_equals_ddp_without_clipping(
    tmp_path: Path, digits_dataset: Path
) -> None:
    # Without gradient clipping, so that DDP on the same spec is comparable (at the end); the
    # next test stops (SIGTERM, 2 processes) and resumes (1 process) with clipping.
    spec = write_spec(tmp_path / "fsdp.yaml", _doc(digits_dataset, epochs=2, optimizer__grad_clip_norm=None))
    ref_dir = tmp_path / "uninterrupted"
    out = _train(spec, ref_dir, "--nproc-per-node", "2")
    assert "2 processes" in out
    a = _weights(ref_dir)

    # Stopped as the first evaluation starts: the resumed run's first forward is that
    # evaluation's (with the parameters gathered before FSDP's lazy start-up ever ran).
    at_eval = tmp_path / "stopped-at-eval"
    script = tmp_path / "stop_at_eval.py"
    script.write_text(_STOP_AT_EVAL)
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(script), str(spec), str(at_eval)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0 and p.stdout.count("exit 75 at step 22") == 2, p.stdout + p.stderr
    dirs = sorted((at_eval / "checkpoints").iterdir())
    assert dirs and all(d.is_dir() and d.suffix == ".dcp" for d in dirs), dirs
    manifest = json.loads((dirs[-1] / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "trainer.pt"} <= set(manifest["files"])
    out = _train(spec, at_eval, "--nproc-per-node", "2")
    assert "resuming from step-000000022.dcp" in out
    kept = sorted(p.name for p in (at_eval / "checkpoints").iterdir())
    assert kept == ["step-000000040.dcp", "step-000000044.dcp"]  # keep_last 2, no temporaries
    c = _weights(at_eval)
    assert a.keys() == c.keys()
    assert all(torch.equal(a[k], c[k]) for k in a), [k for k in a if not torch.equal(a[k], c[k])]

    # The single file a DDP run writes: the registry's model loads it with every key.
    card = ModelCard.load(at_eval / "model_card.json")
    assert card.arch == "small_cnn"
    model = create_model(card.arch, len(card.class_names), **card.model_kwargs)
    model.load_state_dict(load_weights(at_eval / "final.safetensors"), strict=True)
    assert all(torch.equal(model.state_dict()[k], a[k]) for k in a)

    # DDP on the same spec (no gradient clipping): bitwise equal. Both average gradients as
    # x/2 + y/2 over 2 ranks (exact and commutative) and the optimizer works element-wise. With
    # clipping they are not comparable: FSDP sums the squared norm from each rank's shard of the
    # gradients, a different order of float additions than DDP's over whole tensors, and that
    # last-bit difference is amplified by training (seen: conv weights 20% apart after 44 steps).
    ddp = write_spec(
        tmp_path / "ddp.yaml",
        _doc(digits_dataset, epochs=2, distributed="ddp", optimizer__grad_clip_norm=None),
    )
    ddp_dir = tmp_path / "ddp"
    _train(ddp, ddp_dir, "--nproc-per-node", "2")
    d = _weights(ddp_dir)
    assert d.keys() == a.keys()
    assert all(torch.equal(a[k], d[k]) for k in a), [k for k in a if not torch.equal(a[k], d[k])]


def test_a_two_process_fsdp_checkpoint_resumes_with_one_process(tmp_path: Path, digits_dataset: Path) -> None:
    # A residual model, channels-last: FSDP2 cannot shard channels-last parameters, so under
    # fsdp only the batches are channels-last (the run would fail at start-up otherwise).
    model = {"arch": "tiny_resnet", "channels_last": True}
    spec = write_spec(tmp_path / "fsdp.yaml", _doc(digits_dataset, epochs=1, model=model))
    run_dir = tmp_path / "run"
    _train_and_sigterm(spec, run_dir)
    stopped_at = sorted((run_dir / "checkpoints").iterdir())[-1]

    p = cli("train", str(spec), "--run-dir", str(run_dir), "--no-track", timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    # DCP reshards the 2 processes' shards into 1; what cannot carry over is each rank's RNG.
    assert f"resuming from {stopped_at.name}" in out
    assert "written by 2 process(es), now 1" in out and "not bitwise reproducible" in out
    final = sorted((run_dir / "checkpoints").iterdir())[-1]
    assert json.loads((final / "manifest.json").read_text())["world_size"] == 1
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "succeeded" and meta["step"] == 22
    w = _weights(run_dir)
    assert all(torch.isfinite(v).all() for v in w.values() if v.is_floating_point())
    assert meta["final_metrics"]["accuracy"] > 0.5  # it went on learning, not from scratch


def _loads_into_its_model(run_dir: Path) -> None:
    card = ModelCard.load(run_dir / "model_card.json")
    model = create_model(card.arch, len(card.class_names), **card.model_kwargs)
    model.load_state_dict(load_weights(run_dir / "final.safetensors"), strict=True)


@pytest.mark.gpu
def test_fsdp_on_one_gpu_checkpoints_and_resumes(tmp_path: Path, digits_dataset: Path) -> None:
    """One process shards nothing, but writes the same DCP checkpoints, here from CUDA tensors."""
    doc = _doc(digits_dataset, epochs=None, steps=8, device="cuda", precision="bf16", deterministic=False)
    stop = StopRequest()

    class StopAt4(Reporter):
        def step(self, step: int, loss: float | None, lr: float, images_per_s: float | None) -> None:
            if step == 4:
                stop.request("test")

    first = train(validate_train_spec(doc), tmp_path / "run", reporter=StopAt4(), track=False, stop=stop)
    assert first.exit_code == 75 and first.step == 4
    assert (tmp_path / "run" / "checkpoints" / "step-000000004.dcp" / "manifest.json").is_file()
    second = train(validate_train_spec(doc), tmp_path / "run", track=False)
    assert second.exit_code == 0 and second.step == 8
    _loads_into_its_model(tmp_path / "run")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for FSDP over NCCL")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])  # fp16: the sharded loss scaler
def test_fsdp_over_nccl_stops_resumes_and_finishes(
    tmp_path: Path, digits_dataset: Path, precision: str
) -> None:
    doc = _doc(digits_dataset, epochs=2, device="cuda", precision=precision, deterministic=False)
    spec = write_spec(tmp_path / "spec.yaml", doc)
    run_dir = tmp_path / "run"
    _train_and_sigterm(spec, run_dir)
    stopped_at = sorted((run_dir / "checkpoints").iterdir())[-1]
    assert json.loads((stopped_at / "manifest.json").read_text())["world_size"] == 2
    out = _train(spec, run_dir, "--nproc-per-node", "2")
    assert f"resuming from {stopped_at.name}" in out
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "succeeded" and meta["final_metrics"]["accuracy"] > 0.5
    _loads_into_its_model(run_dir)
