"""DDP on CPU (gloo) with 2 processes: under torchrun, and under `--nproc-per-node`, stopped
with SIGTERM and resumed, ending bitwise identical."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _trainkit import popen, spec_doc, write_spec


@pytest.mark.slow
def test_two_process_ddp_torchrun_and_launcher_agree_after_a_sigterm(
    tmp_path: Path, digits_dataset: Path
) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_doc(digits_dataset, epochs=2, data__workers=0))
    ref_dir = tmp_path / "torchrun"
    ref = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "visionloop", "train", str(spec), "--run-dir", str(ref_dir), "--no-track"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stdout + ref.stderr
    assert "2 processes" in ref.stderr

    run_dir = tmp_path / "launcher"
    p = popen("train", str(spec), "--run-dir", str(run_dir), "--nproc-per-node", "2", "--no-track")
    assert p.stdout is not None
    for line in p.stdout:
        if "checkpoint at step" in line:
            break
    os.killpg(p.pid, signal.SIGTERM)  # the whole group: launcher and both ranks, as a scheduler does
    out = p.communicate(timeout=120)[0]
    assert p.returncode == 75, out
    assert "stopping (SIGTERM)" in out

    p = popen("train", str(spec), "--run-dir", str(run_dir), "--nproc-per-node", "2", "--no-track")
    out = p.communicate(timeout=600)[0]
    assert p.returncode == 0, out
    assert "resuming from step-" in out

    a, b = load_file(str(ref_dir / "final.safetensors")), load_file(str(run_dir / "final.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    card = (run_dir / "model_card.json").read_text()
    assert '"arch": "small_cnn"' in card


@pytest.mark.slow
def test_global_batch_must_divide_over_processes(tmp_path: Path, digits_dataset: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_doc(digits_dataset, data__batch_size=63, data__workers=0))
    p = popen("train", str(spec), "--run-dir", str(tmp_path / "r"), "--nproc-per-node", "2", "--no-track")
    out = p.communicate(timeout=300)[0]
    assert p.returncode not in (0, 75)
    assert "must divide evenly over 2 processes" in out and "Traceback" not in out
