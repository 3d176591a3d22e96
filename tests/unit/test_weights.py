"""save_weights/load_weights round trips: every tensor comes back bit-for-bit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from _hangkit import in_thread
from visionloop.models import WeightsError, create_model, load_weights, save_weights
from visionloop.models.weights import _torch_load, strip_wrapper_prefixes


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


class TiedNet(nn.Module):
    """An embedding tied to the output projection, as in language models."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 4)
        self.out = nn.Linear(4, 11, bias=False)
        self.out.weight = self.embed.weight


def test_round_trip_of_a_model(tmp_path: Path) -> None:
    model = create_model("tiny_resnet", 5)
    # Make BN buffers non-trivial, so that they are checked too.
    model.train()
    model(torch.randn(4, 3, 32, 32))
    path = save_weights(model, tmp_path / "w.safetensors")
    assert path == tmp_path / "w.safetensors"
    _assert_same(load_weights(path), model.state_dict())
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"], "no temporary file left behind"


def test_round_trip_of_odd_tensors(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).view(4, 6)
    sd = {
        "transposed": base.t(),  # non-contiguous
        "slice": base[1:3],  # a view into part of a storage
        "base": base,  # shares storage with both views above
        "bf16": torch.randn(3, 3).to(torch.bfloat16),
        "int64": torch.tensor([1, 2, 3]),
        "empty_a": torch.empty(0),
        "empty_b": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
    }
    path = save_weights(sd, tmp_path / "odd.safetensors")
    _assert_same(load_weights(path), {k: v.contiguous() for k, v in sd.items()})


def test_tied_weights_are_saved_and_reloaded_into_a_tied_model(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedNet()
    state = model.state_dict()
    assert state["embed.weight"].data_ptr() == state["out.weight"].data_ptr()
    loaded = load_weights(save_weights(model, tmp_path / "tied.safetensors"))
    _assert_same(loaded, state)

    fresh = TiedNet()
    fresh.load_state_dict(loaded)
    assert torch.equal(fresh.embed.weight, model.embed.weight)
    assert fresh.out.weight is fresh.embed.weight, "loading must not untie the weights"


def test_ddp_prefix_is_stripped(tmp_path: Path) -> None:
    """A real DistributedDataParallel wrapper (gloo, one process) saves `module.`-prefixed
    keys; the file holds the bare names."""
    model = create_model("small_cnn", 3)
    store = dist.HashStore()  # type: ignore[attr-defined]  # imported by torch.distributed, not exported
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        assert all(k.startswith("module.") for k in ddp.state_dict())
        loaded = load_weights(save_weights(ddp, tmp_path / "ddp.safetensors"))
    finally:
        dist.destroy_process_group()
    _assert_same(loaded, model.state_dict())


def test_compile_prefix_is_stripped(tmp_path: Path) -> None:
    model = create_model("small_cnn", 3)
    compiled = torch.compile(model)  # wraps lazily; nothing is compiled until a forward
    assert isinstance(compiled, nn.Module)
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    _assert_same(load_weights(save_weights(compiled, tmp_path / "c.safetensors")), model.state_dict())


def test_prefixes_in_a_dict_are_stripped_on_load_too(tmp_path: Path) -> None:
    sd = create_model("small_cnn", 3).state_dict()
    torch.save({f"module._orig_mod.{k}": v for k, v in sd.items()}, tmp_path / "wrapped.pt")
    _assert_same(load_weights(tmp_path / "wrapped.pt"), sd)


def test_strip_wrapper_prefixes_rules() -> None:
    t = torch.zeros(1)
    # `module.` only when every key has it: a real submodule may be called "module".
    assert list(strip_wrapper_prefixes({"module.a": t, "b": t})) == ["module.a", "b"]
    assert list(strip_wrapper_prefixes({"module.a": t, "module.b": t})) == ["a", "b"]
    # `_orig_mod.` is removed wherever it appears (a compiled submodule).
    assert list(strip_wrapper_prefixes({"net._orig_mod.w": t, "head.w": t})) == ["net.w", "head.w"]
    with pytest.raises(WeightsError, match="collide"):
        strip_wrapper_prefixes({"a._orig_mod.w": t, "a.w": t})


def test_save_refuses_non_tensors_and_other_suffixes(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="only tensors"):
        save_weights({"w": torch.zeros(1), "step": 3}, tmp_path / "x.safetensors")  # type: ignore[dict-item]
    with pytest.raises(WeightsError, match=r"\*\.safetensors"):
        save_weights({"w": torch.zeros(1)}, tmp_path / "x.pt")


def test_save_replaces_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_weights({"w": torch.zeros(2)}, path)
    save_weights({"w": torch.ones(2)}, path)
    assert torch.equal(load_weights(path)["w"], torch.ones(2))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", ["w.pt", "w.pth"])
def test_a_fifo_in_place_of_torch_weights_is_refused_not_waited_on(tmp_path: Path, name: str) -> None:
    fifo = tmp_path / name
    os.mkfifo(fifo)
    # load_weights checks is_file() first; the reader under it must refuse a FIFO too, since a
    # swap after that check puts one there (torch.load(path) waited on it for ever).
    got = in_thread(lambda: load_weights(fifo))
    assert isinstance(got, WeightsError) and "does not exist" in str(got)
    got = in_thread(lambda: _torch_load(fifo))
    assert isinstance(got, WeightsError) and "FIFO" in str(got), got
