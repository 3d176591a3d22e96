"""Hostile and damaged run directories: checkpoints (single-file and sharded), run.json,
spec.resolved.yaml and the trainer's own files. Every one gets a clear error or a fallback to
the previous good checkpoint with a warning; nothing hangs, nothing is executed, nothing good
is deleted or overwritten."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from _hangkit import in_thread
from visionloop.core.errors import CheckpointError, TrainingError
from visionloop.train import checkpoint as ckpt_mod
from visionloop.train import sharding
from visionloop.train.checkpoint import MAGIC, CheckpointManager, checkpoint_name, load_verified
from visionloop.train.dist import DistInfo
from visionloop.train.rundir import RunDir
from visionloop.train.sharded_checkpoint import (
    MANIFEST,
    ShardedCheckpointManager,
    _MetadataUnpickler,
    _sha256_file,
)

# ----------------------------------------------------------------------------- single file


def _manager(d: Path) -> CheckpointManager:
    return CheckpointManager(d, keep_last=5, keep_best=1)


def _with_good_step_1(tmp_path: Path) -> tuple[CheckpointManager, Path]:
    d = tmp_path / "ckpt"
    m = _manager(d)
    m.save({"w": torch.ones(3)}, 1, 0.5, block=True)
    return m, d


def _file(trailer: dict[str, Any], payload_state: Any = None) -> bytes:
    """A checkpoint file whose trailer fields are overridden by `trailer` (checksum valid)."""
    buf = io.BytesIO()
    torch.save(payload_state if payload_state is not None else {"w": torch.ones(3)}, buf)
    payload = buf.getvalue()
    fields = {
        "format": 2,
        "step": 2,
        "metric": None,
        "sha256": hashlib.sha256(payload).hexdigest(),
        "size": len(payload),
    }
    body = json.dumps({**fields, **trailer}).encode()
    return payload + body + struct.pack("<I", len(body)) + MAGIC


def _falls_back_to_step_1(m: CheckpointManager, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        found = in_thread(m.load_latest)
    assert not isinstance(found, BaseException), found
    assert found is not None and found[0].step == 1
    assert checkpoint_name(2) in caplog.text


def test_a_fifo_named_like_the_latest_checkpoint_is_set_aside_not_waited_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    m, d = _with_good_step_1(tmp_path)
    os.mkfifo(d / checkpoint_name(2))
    assert not isinstance(in_thread(m.infos), BaseException)  # retention lists it without hanging
    _falls_back_to_step_1(m, caplog)
    assert "not a regular file" in caplog.text
    assert (d / (checkpoint_name(2) + ".corrupt")).exists() and (d / checkpoint_name(1)).is_file()
    m.close()


@pytest.mark.parametrize(
    "trailer",
    [{"step": "two"}, {"size": None}, {"sha256": [1]}, {"step": True}, {"size": -5}],
    ids=["str-step", "no-size", "list-sha", "bool-step", "negative-size"],
)
def test_a_trailer_with_fields_of_the_wrong_type_is_damage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, trailer: dict[str, Any]
) -> None:
    m, d = _with_good_step_1(tmp_path)
    (d / checkpoint_name(2)).write_bytes(_file(trailer))
    _falls_back_to_step_1(m, caplog)
    m.save({"w": torch.ones(3)}, 3, 0.7, block=True)  # retention copes with what is left
    m.close()


def test_a_metric_that_is_no_number_neither_crashes_retention_nor_ranks_as_best(tmp_path: Path) -> None:
    m, d = _with_good_step_1(tmp_path)
    (d / checkpoint_name(2)).write_bytes(_file({"metric": "x"}))
    (d / checkpoint_name(3)).write_bytes(_file({"step": 3, "metric": float("nan")}))
    m.save({"w": torch.ones(3)}, 4, 0.7, block=True)  # prunes on the writer thread
    m.close()
    best = m.best()
    assert best is not None and best.step == 4
    assert [c.metric for c in m.infos()] == [0.5, None, None, 0.7]


def test_a_trailer_nested_past_the_parsers_depth_is_damage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    m, d = _with_good_step_1(tmp_path)
    body = b"[" * 100_000 + b"]" * 100_000
    (d / checkpoint_name(2)).write_bytes(body + struct.pack("<I", len(body)) + MAGIC)
    _falls_back_to_step_1(m, caplog)
    m.close()


def test_a_pickle_payload_is_refused_without_running_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    m, d = _with_good_step_1(tmp_path)
    (d / checkpoint_name(2)).write_bytes(_file({}, {"w": Evil()}))
    _falls_back_to_step_1(m, caplog)
    assert not marker.exists()
    m.close()


def test_a_checkpoint_larger_than_memory_is_refused_before_reading_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m, d = _with_good_step_1(tmp_path)
    big = d / checkpoint_name(2)
    big.write_bytes(_file({}, {"w": torch.zeros(300_000)}))  # ~1.2 MB
    monkeypatch.setattr(ckpt_mod, "memory_bytes", lambda: 1 << 20)
    with pytest.raises(CheckpointError, match=r"more than this machine's memory.*move it out of"):
        m.load_latest()
    assert big.is_file()  # maybe genuine (from a bigger machine): never set aside for its size
    m.close()


def test_a_symlink_to_dev_zero_is_set_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    m, d = _with_good_step_1(tmp_path)
    (d / checkpoint_name(2)).symlink_to("/dev/zero")
    _falls_back_to_step_1(m, caplog)
    m.close()


# ----------------------------------------------------------------------------- sharded


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return model, opt


def _sharded(tmp_path: Path) -> tuple[Path, Path]:
    """Two sharded checkpoints (steps 1, 2); returns (folder, step 2's directory)."""
    d = tmp_path / "ckpt"
    m = ShardedCheckpointManager(d, keep_last=3, keep_best=0, info=DistInfo())
    model, opt = _trained()
    try:
        for step in (1, 2):
            model_state, optim_state = sharding.sharded_state(model, opt)
            m.save({"model": model_state, "optimizer": optim_state, "position": {}}, step, block=True)
    finally:
        m.close()
    return d, d / "step-000000002.dcp"


def _rehash(ck: Path) -> None:
    """Rewrite the manifest to match the files: whoever can tamper with a file can do this too."""
    manifest = json.loads((ck / MANIFEST).read_text())
    for name in manifest["files"]:
        sha, size = _sha256_file(ck / name)
        manifest["files"][name] = {"sha256": sha, "size": size}
    (ck / MANIFEST).write_text(json.dumps(manifest))


def _tamper_metadata(ck: Path, **fields: Any) -> None:
    with open(ck / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    for where in metadata.storage_data.values():
        for k, v in fields.items():
            setattr(where, k, v)
    (ck / ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(ck)


def _sharded_falls_back(d: Path, ck: Path) -> None:
    m = ShardedCheckpointManager(d, keep_last=3, keep_best=0, info=DistInfo())
    found = in_thread(m.load_latest)
    assert not isinstance(found, BaseException), found
    assert found is not None and found[0].step == 1
    assert ck.with_name(ck.name + ".corrupt").is_dir()
    # and what it chose loads
    model, opt = _trained()
    sharding.load_sharded(model, opt, Path(found[1]["dcp_dir"]), with_optimizer=True)


def test_dcp_metadata_pointing_outside_the_checkpoint_is_damage(tmp_path: Path) -> None:
    d, ck = _sharded(tmp_path)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(os.urandom(100_000))
    _tamper_metadata(ck, relative_path=str(secret), offset=0)
    with pytest.raises(CheckpointError, match="not a shard file of its manifest"):
        load_verified(ck)
    _sharded_falls_back(d, ck)


def test_dcp_metadata_pointing_at_an_unlisted_fifo_is_damage(tmp_path: Path) -> None:
    d, ck = _sharded(tmp_path)
    os.mkfifo(ck / "extra.distcp")
    _tamper_metadata(ck, relative_path="extra.distcp")
    _sharded_falls_back(d, ck)


def test_dcp_metadata_reading_past_a_shards_end_is_damage(tmp_path: Path) -> None:
    d, ck = _sharded(tmp_path)
    _tamper_metadata(ck, length=1 << 45)
    with pytest.raises(CheckpointError, match="reads past the end"):
        load_verified(ck)
    _sharded_falls_back(d, ck)


def test_garbage_dcp_metadata_is_damage(tmp_path: Path) -> None:
    d, ck = _sharded(tmp_path)
    (ck / ".metadata").write_bytes(os.urandom(3000))
    _rehash(ck)
    _sharded_falls_back(d, ck)


@pytest.mark.parametrize("victim", [MANIFEST, ".metadata", "__0_0.distcp", "trainer.pt"])
def test_a_fifo_in_place_of_a_sharded_checkpoints_file_is_damage(tmp_path: Path, victim: str) -> None:
    d, ck = _sharded(tmp_path)
    (ck / victim).unlink()
    os.mkfifo(ck / victim)
    _sharded_falls_back(d, ck)


def test_a_manifest_nested_past_the_parsers_depth_is_damage(tmp_path: Path) -> None:
    d, ck = _sharded(tmp_path)
    (ck / MANIFEST).write_text("[" * 200_000 + "]" * 200_000)
    _sharded_falls_back(d, ck)


def test_a_manifest_entry_of_the_wrong_type_is_damage(tmp_path: Path) -> None:
    d, ck = _sharded(tmp_path)
    manifest = json.loads((ck / MANIFEST).read_text())
    manifest["files"]["trainer.pt"]["size"] = "big"
    (ck / MANIFEST).write_text(json.dumps(manifest))
    _sharded_falls_back(d, ck)


def test_a_shard_that_links_out_of_the_checkpoint_is_damage(tmp_path: Path) -> None:
    d, ck = _sharded(tmp_path)
    outside = tmp_path / "outside.distcp"
    (ck / "__0_0.distcp").rename(outside)
    (ck / "__0_0.distcp").symlink_to(outside)
    _sharded_falls_back(d, ck)
    assert outside.is_file()


def test_extra_files_in_a_sharded_checkpoint_are_ignored(tmp_path: Path) -> None:
    d, ck = _sharded(tmp_path)
    (ck / "notes.txt").write_text("hello")
    os.mkfifo(ck / "stray.fifo")
    found = in_thread(ShardedCheckpointManager(d, keep_last=3, keep_best=0, info=DistInfo()).load_latest)
    assert not isinstance(found, BaseException), found
    assert found is not None and found[0].step == 2


# ----------------------------------------------------------------------------- run directory

SPEC: dict[str, Any] = {"data": {"dataset": "/d", "workers": 2}, "optimizer": {"lr": 0.1}}


def _made_run(tmp_path: Path) -> RunDir:
    rd = RunDir(tmp_path / "run")
    rd.prepare("", SPEC)
    return rd


@pytest.mark.parametrize(
    "damage",
    ["fifo", "huge", "not-utf8", "deep", "list", "int-uid", "no-uid"],
)
def test_a_damaged_run_json_is_a_clear_error_and_is_left_as_it_is(tmp_path: Path, damage: str) -> None:
    rd = _made_run(tmp_path)
    meta = rd.meta_file
    good = json.loads(meta.read_text())
    meta.unlink()
    if damage == "fifo":
        os.mkfifo(meta)
    elif damage == "huge":
        with open(meta, "wb") as f:
            f.truncate(64 << 20)  # sparse
    elif damage == "not-utf8":
        meta.write_bytes(b'{"uid": "\xff\xfe"}')
    elif damage == "deep":
        meta.write_text("[" * 100_000 + "]" * 100_000)
    elif damage == "list":
        meta.write_text("[1, 2]")
    elif damage == "int-uid":
        meta.write_text(json.dumps({**good, "uid": 5}))
    else:
        meta.write_text(json.dumps({k: v for k, v in good.items() if k != "uid"}))
    before = os.lstat(meta)
    got = in_thread(lambda: rd.prepare("", SPEC))
    assert isinstance(got, TrainingError), got
    assert str(meta) in str(got) and "damaged" in str(got) and "new --run-dir" in str(got)
    after = os.lstat(meta)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not replaced


def test_a_fifo_resolved_spec_does_not_hang_the_report_of_a_changed_spec(tmp_path: Path) -> None:
    rd = _made_run(tmp_path)
    resolved = rd.path / "spec.resolved.yaml"
    resolved.unlink()
    os.mkfifo(resolved)
    got = in_thread(lambda: rd.prepare("", {**SPEC, "optimizer": {"lr": 0.2}}))
    assert isinstance(got, TrainingError) and "different spec" in str(got), got


def test_an_aliased_resolved_spec_is_not_expanded(tmp_path: Path) -> None:
    rd = _made_run(tmp_path)
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    (rd.path / "spec.resolved.yaml").write_text("\n".join(lines) + "\n")
    got = in_thread(lambda: rd.prepare("", {**SPEC, "optimizer": {"lr": 0.2}}))
    assert isinstance(got, TrainingError) and "different spec" in str(got), got


def test_a_lock_file_that_links_elsewhere_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    victim = tmp_path / "precious.txt"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(victim)
    with pytest.raises(TrainingError, match=r"\.lock is a symbolic link.*Remove it"):
        RunDir(run).lock()
    assert victim.read_text() == "precious"
    (run / ".lock").unlink()
    os.mkfifo(run / ".lock")
    got = in_thread(RunDir(run).lock)
    assert isinstance(got, TrainingError) and "not a regular file" in str(got), got


def test_the_lock_still_names_its_holder(tmp_path: Path) -> None:
    first, second = RunDir(tmp_path / "run"), RunDir(tmp_path / "run")
    first.lock()
    try:
        with pytest.raises(TrainingError, match=rf"is in use by pid {os.getpid()}"):
            second.lock()
    finally:
        first.unlock()


@pytest.mark.parametrize("kind", ["fifo", "symlink"])
def test_a_train_log_that_is_no_plain_file_is_refused(tmp_path: Path, kind: str) -> None:
    rd = _made_run(tmp_path)
    victim = tmp_path / "precious.txt"
    victim.write_text("precious")
    if kind == "fifo":
        os.mkfifo(rd.log_file)
    else:
        rd.log_file.symlink_to(victim)
    with pytest.raises(TrainingError, match=r"train\.log is .*Remove it"):
        rd.check_own_file(rd.log_file)
    rd.log_file.unlink()
    rd.check_own_file(rd.log_file)  # missing: fine, the trainer creates it
