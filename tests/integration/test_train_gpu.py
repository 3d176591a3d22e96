"""CUDA training: skipped without a GPU (this suite's CI has none); run on a GPU machine with
`pytest -m gpu`. Same contracts as on CPU: finite losses, checkpoints that resume, and DDP
over NCCL with the launcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _trainkit import cli, spec_doc, write_spec
from visionloop.specs import validate_train_spec
from visionloop.train.api import train
from visionloop.train.signals import StopRequest

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("precision", ["bf16", "fp16", "auto"])
def test_cuda_precisions_channels_last_train_and_resume(
    tmp_path: Path, digits_dataset: Path, precision: str
) -> None:
    doc = spec_doc(
        digits_dataset,
        epochs=None,
        steps=8,
        device="cuda",
        precision=precision,
        deterministic=False,
        model={"arch": "resnet18", "channels_last": True},
        data__image_size=32,
    )
    stop = StopRequest()

    from visionloop.train.report import Reporter

    class StopAt4(Reporter):
        def step(self, step: int, loss: float | None, lr: float, images_per_s: float | None) -> None:
            assert loss is not None and loss == loss  # not NaN
            if step == 4:
                stop.request("test")

    first = train(validate_train_spec(doc), tmp_path / "run", reporter=StopAt4(), track=False, stop=stop)
    assert first.exit_code == 75 and first.step == 4
    second = train(validate_train_spec(doc), tmp_path / "run", track=False)
    assert second.exit_code == 0 and second.step == 8
    card = json.loads((tmp_path / "run" / "model_card.json").read_text())
    assert card["arch"] == "resnet18"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL DDP")
def test_nccl_ddp_with_the_launcher(tmp_path: Path, digits_dataset: Path) -> None:
    spec = write_spec(
        tmp_path / "spec.yaml", spec_doc(digits_dataset, epochs=1, device="cuda", deterministic=False)
    )
    p = cli("train", str(spec), "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "2", "--no-track")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 processes" in p.stderr and (tmp_path / "run" / "final.safetensors").is_file()
