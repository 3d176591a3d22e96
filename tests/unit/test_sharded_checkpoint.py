"""Sharded (DCP directory) checkpoints in one process: the same rules as the single-file ones
(atomic, verified before trusted, pruned) and no unpickling of what is on disk.

One process needs no process group: DCP writes one shard file. The two-process behaviour is in
tests/integration/test_train_fsdp.py."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from visionloop.core.errors import CheckpointError, SpecError
from visionloop.models import create_model
from visionloop.specs import validate_train_spec
from visionloop.train import sharding
from visionloop.train.checkpoint import load_verified
from visionloop.train.dist import DistInfo
from visionloop.train.sharded_checkpoint import MANIFEST, ShardedCheckpointManager, _sha256_file


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 6)).square().mean().backward()
        opt.step()
    return model, opt


def _state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    model_state, optim_state = sharding.sharded_state(model, opt)
    rest = {"position": {"step": step}, "rng": [torch.arange(3)]}
    return {"model": model_state, "optimizer": optim_state, **rest}


def _manager(directory: Path, keep_last: int = 2, keep_best: int = 0) -> ShardedCheckpointManager:
    return ShardedCheckpointManager(directory, keep_last=keep_last, keep_best=keep_best, info=DistInfo())


def _save_steps(directory: Path, steps: list[int], **kw: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    mgr = _manager(directory, **kw)
    model, opt = _trained(0)
    try:
        for step in steps:
            mgr.save(_state(model, opt, step), step, metric=float(step), block=True)
    finally:
        mgr.close()
    return model, opt


def test_round_trip_restores_model_and_optimizer_exactly_and_prunes(tmp_path: Path) -> None:
    model, opt = _save_steps(tmp_path, [1, 2, 3])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["step-000000002.dcp", "step-000000003.dcp"]  # keep_last 2, no temporaries
    manifest = json.loads((tmp_path / "step-000000003.dcp" / MANIFEST).read_text())
    assert manifest["step"] == 3 and manifest["world_size"] == 1 and manifest["metric"] == 3.0
    assert {".metadata", "trainer.pt", "__0_0.distcp"} <= set(manifest["files"])

    found = _manager(tmp_path).load_latest()
    assert found is not None
    info, state = found
    assert info.step == 3 and state["position"] == {"step": 3} and state["has_optimizer_state"] is True
    assert torch.equal(state["rng"][0], torch.arange(3))
    fresh, fresh_opt = _trained(1)  # other weights, other optimizer moments
    sharding.load_sharded(fresh, fresh_opt, Path(state["dcp_dir"]), with_optimizer=True)
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    for pid, s in opt.state_dict()["state"].items():
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s[k], fresh_opt.state_dict()["state"][pid][k])
    assert fresh_opt.param_groups[0]["lr"] == 0.01  # a non-tensor value, read with weights_only


def test_corrupt_shard_is_set_aside_and_the_previous_checkpoint_used(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1, 2])
    shard = tmp_path / "step-000000002.dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    found = _manager(tmp_path).load_latest()
    assert found is not None and found[0].step == 1
    assert (tmp_path / "step-000000002.dcp.corrupt").is_dir()
    with pytest.raises(CheckpointError, match=r"checksum mismatch in __0_0\.distcp"):
        load_verified(tmp_path / "step-000000002.dcp.corrupt")


def test_a_directory_without_a_manifest_never_loads(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1, 2])
    (tmp_path / "step-000000002.dcp" / MANIFEST).unlink()  # as if the writer died before it
    found = _manager(tmp_path).load_latest()
    assert found is not None and found[0].step == 1


def test_crafted_metadata_is_refused_without_running_it(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1], keep_last=1)
    ckpt = tmp_path / "step-000000001.dcp"
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {marker}",))

    (ckpt / ".metadata").write_bytes(pickle.dumps(Evil()))
    # Whoever can write the file can rewrite its manifest: the checksum alone is no defence.
    manifest = json.loads((ckpt / MANIFEST).read_text())
    sha, size = _sha256_file(ckpt / ".metadata")
    manifest["files"][".metadata"] = {"sha256": sha, "size": size}
    (ckpt / MANIFEST).write_text(json.dumps(manifest))

    # The checksums match; verification reads the metadata too, with the safe unpickler.
    with pytest.raises(CheckpointError, match=r"posix\.system is not allowed|os\.system is not allowed"):
        load_verified(ckpt)
    model, opt = _trained(1)
    with pytest.raises(CheckpointError, match=r"posix\.system is not allowed|os\.system is not allowed"):
        sharding.load_sharded(model, opt, ckpt, with_optimizer=True)
    assert not marker.exists()


def test_stale_temporaries_are_removed_and_a_half_replaced_checkpoint_is_put_back(tmp_path: Path) -> None:
    _save_steps(tmp_path, [1, 2])
    (tmp_path / ".step-000000003.dcp.tmp").mkdir()
    (tmp_path / ".step-000000003.dcp.tmp" / "__0_0.distcp").write_bytes(b"half")
    # A crash between setting aside the old step 2 and renaming its replacement into place.
    (tmp_path / "step-000000002.dcp").rename(tmp_path / ".step-000000002.dcp.old")
    found = _manager(tmp_path).load_latest()
    assert found is not None and found[0].step == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001.dcp", "step-000000002.dcp"]


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, keep_last=3)
    model, opt = _trained(0)
    try:
        mgr.save(_state(model, opt, 5), 5, metric=None, block=True)
        mgr.save(_state(model, opt, 5), 5, metric=0.75, block=True)  # the eval after a resume
    finally:
        mgr.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000005.dcp"]
    assert [(i.step, i.metric) for i in mgr.infos()] == [(5, 0.75)]


def test_keep_best_keeps_the_best_directory_beyond_keep_last(tmp_path: Path) -> None:
    mgr = _manager(tmp_path, keep_last=1, keep_best=1)
    model, opt = _trained(0)
    try:
        for step, metric in [(1, 0.9), (2, 0.5), (3, 0.6)]:
            mgr.save(_state(model, opt, step), step, metric=metric, block=True)
    finally:
        mgr.close()
    assert [i.step for i in mgr.infos()] == [1, 3]
    assert mgr.best() is not None and mgr.best().step == 1  # type: ignore[union-attr]


def test_no_optimizer_state_before_the_first_step_is_saved_as_such(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    mgr = _manager(tmp_path)
    try:
        mgr.save(_state(model, opt, 0), 0, block=True)
    finally:
        mgr.close()
    # Asking for the optimizer's state dict would have made its state with a zero-lr step.
    assert not opt.state
    found = _manager(tmp_path).load_latest()
    assert found is not None and found[1]["has_optimizer_state"] is False


def test_fsdp_units_are_the_outermost_blocks() -> None:
    model = create_model("small_cnn", 10)
    units = sharding.fsdp_units(model)
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(u)] for u in units] == ["features.0", "features.2", "features.4", "features.6"]


def test_distributed_accepts_ddp_and_fsdp_only() -> None:
    doc = {"data": {"dataset": "/d"}, "model": {"arch": "small_cnn"}, "epochs": 1}
    assert validate_train_spec(doc).distributed == "ddp"
    assert validate_train_spec({**doc, "distributed": "fsdp"}).distributed == "fsdp"
    with pytest.raises(SpecError, match=r"distributed.*Example: distributed: fsdp"):
        validate_train_spec({**doc, "distributed": "zero3"})
