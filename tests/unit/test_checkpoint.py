"""Checkpoint files: exact round trip, verification, fallback, retention, durability."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from visionloop.core.errors import CheckpointError
from visionloop.train.checkpoint import CheckpointManager, checkpoint_name, load_verified, read_header


def state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.zeros(32, dtype=torch.float64)},
        "rng": torch.get_rng_state(),
        "python": (3, tuple(range(10)), None),
        "position": {"step": step, "epoch": 1, "pending_eval": False},
    }


def manager(tmp_path: Path, keep_last: int = 2, keep_best: int = 1, mode: str = "max") -> CheckpointManager:
    return CheckpointManager(tmp_path / "ckpt", keep_last=keep_last, keep_best=keep_best, best_mode=mode)


def test_round_trip_is_exact_and_the_header_describes_the_file(tmp_path: Path) -> None:
    m = manager(tmp_path)
    s = state(7)
    m.save(s, step=7, metric=0.5, block=True)
    path = tmp_path / "ckpt" / checkpoint_name(7)
    header = read_header(path)
    assert path.read_bytes().endswith(b"VLCKPT2\n")
    assert header["step"] == 7 and header["metric"] == 0.5 and len(header["sha256"]) == 64
    loaded = load_verified(path)
    assert torch.equal(loaded["model"]["w"], s["model"]["w"])  # type: ignore[index]
    assert loaded["model"]["b"].dtype == torch.float64
    assert torch.equal(loaded["rng"], s["rng"])  # type: ignore[arg-type]
    assert loaded["python"] == s["python"] and loaded["position"] == s["position"]
    m.close()


def test_snapshot_is_taken_at_save_time_not_at_write_time(tmp_path: Path) -> None:
    m = manager(tmp_path)
    live = {"w": torch.zeros(1000)}
    m.save(live, step=1)
    live["w"].add_(1.0)  # training goes on mutating the live tensor while the writer runs
    m.wait()
    assert torch.equal(load_verified(tmp_path / "ckpt" / checkpoint_name(1))["w"], torch.zeros(1000))
    m.close()


def test_corrupt_latest_is_set_aside_with_a_warning_and_the_previous_used(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    m = manager(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        m.save(state(step), step=step, block=True)
    latest = tmp_path / "ckpt" / checkpoint_name(3)
    data = bytearray(latest.read_bytes())
    data[len(data) // 3] ^= 0x01  # inside the payload
    latest.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        found = m.load_latest()
    assert found is not None
    info, loaded = found
    assert info.step == 2 and torch.equal(loaded["model"]["w"], state(2)["model"]["w"])  # type: ignore[index]
    assert "checksum mismatch" in caplog.text and checkpoint_name(3) in caplog.text
    assert not latest.exists() and latest.with_name(latest.name + ".corrupt").exists()
    m.close()


@pytest.mark.parametrize("damage", ["truncate", "empty", "garbage_header"])
def test_partial_or_garbled_files_never_load(tmp_path: Path, damage: str) -> None:
    m = manager(tmp_path, keep_last=5)
    m.save(state(1), step=1, block=True)
    m.save(state(2), step=2, block=True)
    latest = tmp_path / "ckpt" / checkpoint_name(2)
    data = latest.read_bytes()
    if damage == "truncate":
        latest.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        latest.write_bytes(b"")
    else:
        latest.write_bytes(data[:-40] + b"{not json at all" + data[-24:])
    with pytest.raises(CheckpointError):
        load_verified(latest)
    found = m.load_latest()
    assert found is not None and found[0].step == 1
    m.close()


def test_all_checkpoints_corrupt_is_an_error_not_a_silent_restart(tmp_path: Path) -> None:
    m = manager(tmp_path)
    m.save(state(1), step=1, block=True)
    (tmp_path / "ckpt" / checkpoint_name(1)).write_bytes(b"xx\x02\x00\x00\x00VLCKPT2\n")
    with pytest.raises(CheckpointError, match="no valid checkpoint"):
        m.load_latest()
    m.close()


def test_empty_directory_means_a_fresh_start(tmp_path: Path) -> None:
    assert manager(tmp_path).load_latest() is None


def test_retention_keeps_the_last_k_and_the_best_by_metric(tmp_path: Path) -> None:
    m = manager(tmp_path, keep_last=2, keep_best=1, mode="max")
    metrics = {1: None, 2: 0.9, 3: None, 4: 0.7, 5: None, 6: 0.8, 7: None}
    for step, metric in metrics.items():
        m.save(state(step), step=step, metric=metric, block=True)
    assert [c.step for c in m.infos()] == [2, 6, 7]
    best = m.best()
    assert best is not None and best.step == 2
    m.close()


def test_retention_min_mode(tmp_path: Path) -> None:
    m = manager(tmp_path, keep_last=1, keep_best=2, mode="min")
    for step, metric in {1: 0.5, 2: 0.2, 3: 0.9, 4: 0.3, 5: None}.items():
        m.save(state(step), step=step, metric=metric, block=True)
    assert [c.step for c in m.infos()] == [2, 4, 5]
    m.close()


def test_stale_temporary_files_from_a_killed_writer_are_removed(tmp_path: Path) -> None:
    m = manager(tmp_path)
    m.save(state(1), step=1, block=True)
    stale = tmp_path / "ckpt" / ".step-000000002.ckpt.abc123.tmp"
    stale.write_bytes(b"half a checkpoint")
    found = m.load_latest()
    assert found is not None and found[0].step == 1 and not stale.exists()
    m.close()


def test_write_failure_surfaces_as_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "ckpt"
    blocker.write_text("a file where the checkpoint folder should be")
    m = CheckpointManager(blocker, keep_last=1, keep_best=0)
    with pytest.raises(CheckpointError, match="rerun the same command"):
        m.save(state(1), step=1, block=True)
    m._pool.shutdown()


def test_buffers_are_reused_between_checkpoints_and_rebuilt_when_shapes_change(tmp_path: Path) -> None:
    from visionloop.train.checkpoint import Snapshotter

    snap = Snapshotter()
    a = torch.ones(4)
    live = {"a": a, "b": [torch.zeros(2, 2)]}
    first = snap(live)
    a.add_(1)
    second = snap(live)
    assert second["a"].data_ptr() == first["a"].data_ptr()  # same buffer, refilled
    assert torch.equal(second["a"], torch.full((4,), 2.0))
    third = snap({"a": torch.ones(5), "b": [torch.zeros(2, 2)]})
    assert third["a"].shape == (5,) and torch.equal(third["b"][0], torch.zeros(2, 2))


def test_a_full_disk_during_a_write_is_a_clear_error_and_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    """A real write failure: the file-size limit (RLIMIT_FSIZE) makes the kernel refuse to
    grow the file past 64 KiB, as a full disk would."""
    import subprocess
    import sys

    code = f"""
import resource, signal, sys, torch
from pathlib import Path
from visionloop.core.errors import CheckpointError
from visionloop.train.checkpoint import CheckpointManager
m = CheckpointManager(Path({str(tmp_path / "ckpt")!r}), keep_last=2, keep_best=0)
m.save({{"w": torch.zeros(10)}}, step=1, block=True)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
try:
    m.save({{"w": torch.zeros(1_000_000)}}, step=2, block=True)
except CheckpointError as e:
    print(e); sys.exit(3)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 3, p.stdout + p.stderr
    assert "writing a checkpoint" in p.stdout and "Free disk space" in p.stdout
    m = manager(tmp_path)
    found = m.load_latest()
    assert found is not None and found[0].step == 1  # nothing half-written is visible
    assert not list((tmp_path / "ckpt").glob(".*.tmp"))


def test_before_commit_runs_before_the_checkpoint_is_visible(tmp_path: Path) -> None:
    m = manager(tmp_path)
    seen: list[bool] = []
    target = tmp_path / "ckpt" / checkpoint_name(5)
    m.save(state(5), step=5, block=True, before_commit=lambda: seen.append(target.exists()))
    assert seen == [False] and target.exists()
    m.close()
