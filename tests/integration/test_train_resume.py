"""Interrupted-and-resumed training ends bitwise identical to an uninterrupted run.

The trainer runs as a real subprocess (`python -m visionloop train`), its process group is
sent SIGTERM or SIGKILL at random moments — during start-up, training steps, checkpoint
writes, evaluation and finalisation alike — and the same command is rerun each time. The
final weights are compared tensor by tensor with `torch.equal`; the MLflow history must hold
every step exactly once.
"""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _trainkit import cli, popen, spec_doc, write_spec
from visionloop.core.settings import load_settings
from visionloop.train.checkpoint import CheckpointManager

EXIT_PREEMPTED = 75


def run_to_end(
    spec: Path, run_dir: Path, *extra: str, timeout: float = 300, cold: bool = False
) -> tuple[int, str, float]:
    t0 = time.monotonic()
    p = cli("train", str(spec), "--run-dir", str(run_dir), *extra, timeout=timeout, cold=cold)
    return p.returncode, p.stdout + p.stderr, time.monotonic() - t0


def interrupt(spec: Path, run_dir: Path, after_s: float, sig: signal.Signals) -> tuple[int, str]:
    p = popen("train", str(spec), "--run-dir", str(run_dir))
    try:
        out, _ = p.communicate(timeout=after_s)
        return p.returncode, out  # finished before the signal
    except Exception:
        os.killpg(p.pid, sig)
        out, _ = p.communicate(timeout=120)
        return p.returncode, out


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final.safetensors"))


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"tensors differ after resumption: {different[:5]}"


def metric_steps(run_dir: Path, key: str) -> list[int]:
    import json

    from mlflow.tracking import MlflowClient

    run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    client = MlflowClient(load_settings().tracking_uri)
    return sorted(m.step for m in client.get_metric_history(run_id, key))


@pytest.mark.slow
def test_random_sigterm_and_sigkill_resume_bitwise_identical(tmp_path: Path, digits_dataset: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_doc(digits_dataset))
    # Cold, as the interrupted runs below start: their signals are drawn within its time.
    code, out, elapsed = run_to_end(spec, tmp_path / "reference", cold=True)
    assert code == 0, out
    reference = weights(tmp_path / "reference")

    rng = random.Random(1234)
    run_dir = tmp_path / "interrupted"
    outcomes: list[tuple[str, int]] = []
    for _ in range(6):
        sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
        code, out = interrupt(spec, run_dir, rng.uniform(0.3, elapsed), sig)
        outcomes.append((sig.name, code))
        if code == 0:
            break
        if sig == signal.SIGTERM:
            # Either it stopped cleanly after a checkpoint, or the signal came before the
            # handler was installed (interpreter start-up), which a scheduler sees as -15.
            assert code in (EXIT_PREEMPTED, -signal.SIGTERM), out
        else:
            assert code == -signal.SIGKILL, out
    assert any(c == EXIT_PREEMPTED for _, c in outcomes) or any(c == -9 for _, c in outcomes), outcomes
    code, out, _ = run_to_end(spec, run_dir)
    assert code == 0, out

    assert_bitwise_equal(reference, weights(run_dir))
    total = 2 * (1437 // 64)
    assert metric_steps(run_dir, "train/loss") == list(range(1, total + 1))
    assert metric_steps(run_dir, "val/accuracy") == [total // 2, total]


@pytest.mark.slow
def test_sigterm_exits_75_with_a_checkpoint_and_resumes(tmp_path: Path, digits_dataset: Path) -> None:
    spec = write_spec(
        tmp_path / "spec.yaml", spec_doc(digits_dataset, checkpoint__every_steps=1000, epochs=3)
    )
    run_dir = tmp_path / "run"
    p = popen("train", str(spec), "--run-dir", str(run_dir))
    # Wait until training is under way (the first step is logged), then ask it to stop.
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith("step ") or "checkpoint at step" in line or "eval" in line:
            break
    os.killpg(p.pid, signal.SIGTERM)
    out = p.communicate(timeout=120)[0]
    assert p.returncode == EXIT_PREEMPTED, out
    assert "resume with: visionloop train" in out
    ckpts = CheckpointManager(run_dir / "checkpoints", keep_last=2, keep_best=1).infos()
    assert ckpts, "a SIGTERM must leave a checkpoint behind"
    stopped_at = ckpts[-1].step
    assert '"status": "preempted"' in (run_dir / "run.json").read_text()

    code, out, _ = run_to_end(spec, run_dir)
    assert code == 0, out
    assert f"resuming from step-{stopped_at:09d}.ckpt (step {stopped_at})" in out


@pytest.mark.slow
@pytest.mark.parametrize("nproc", ["1", "2"])
def test_a_sigterm_while_a_paused_run_winds_down_keeps_its_exit_status(
    tmp_path: Path, digits_dataset: Path, nproc: str
) -> None:
    # A tuning trial paused at its rung can be sent the scheduler's SIGTERM (its preemption)
    # while its process winds down after the checkpoint: the run is saved, so the stop has
    # nothing left to do and must not turn exit 76 into the default action's 143 (seen in CI).
    spec = write_spec(tmp_path / "spec.yaml", spec_doc(digits_dataset, epochs=2))
    run_dir = tmp_path / "run"
    # One process, and the DDP launcher's (two workers; the launcher's own exit too).
    args = ["--until-epoch", "1", "--no-track", "--nproc-per-node", nproc]
    p = popen("train", str(spec), "--run-dir", str(run_dir), *args)
    assert p.stdout is not None
    seen = []
    for line in p.stdout:
        seen.append(line)
        if "paused at step" in line:
            break
    assert any("paused at step" in line for line in seen), "".join(seen)
    # Signal the whole group until it is gone: every moment of its teardown gets one.
    sent = 0
    while p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            sent += 1
        except ProcessLookupError:
            break
        time.sleep(0.01)
    out = "".join(seen) + p.communicate(timeout=60)[0]
    assert sent >= 1
    assert p.returncode == 76, out
    assert '"status": "paused"' in (run_dir / "run.json").read_text()


@pytest.mark.slow
def test_corrupt_latest_checkpoint_falls_back_and_still_matches(tmp_path: Path, digits_dataset: Path) -> None:
    doc = spec_doc(digits_dataset, epochs=1)
    spec = write_spec(tmp_path / "spec.yaml", doc)
    code, out, _ = run_to_end(spec, tmp_path / "reference", "--no-track")
    assert code == 0, out

    # Stop a second run after a few checkpoints, then damage the newest one.
    run_dir = tmp_path / "run"
    p = popen("train", str(spec), "--run-dir", str(run_dir), "--no-track")
    assert p.stdout is not None
    seen = 0
    for line in p.stdout:
        seen += "checkpoint at step" in line
        if seen >= 3:
            break
    os.killpg(p.pid, signal.SIGKILL)
    p.communicate(timeout=60)
    manager = CheckpointManager(run_dir / "checkpoints", keep_last=2, keep_best=1)
    infos = manager.infos()
    assert len(infos) >= 2
    latest, previous = infos[-1], infos[-2]
    data = bytearray(latest.path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the payload
    latest.path.write_bytes(bytes(data))

    code, out, _ = run_to_end(spec, run_dir, "--no-track")
    assert code == 0, out
    assert f"{latest.path.name} is unusable" in out and "checksum mismatch" in out
    assert f"resuming from {previous.path.name}" in out
    assert (run_dir / "checkpoints" / (latest.path.name + ".corrupt")).exists()
    assert_bitwise_equal(weights(tmp_path / "reference"), weights(run_dir))
