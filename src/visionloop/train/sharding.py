"""Sharded data parallelism (`distributed: fsdp`): FSDP2 (`torch.distributed.fsdp.fully_shard`).

What differs from DDP, and why each piece is here:

- **Sharding** (`shard_model`): the "blocks" of the model (the outermost modules held in an
  `nn.Sequential` or `nn.ModuleList`: a ResNet stage's residual blocks, a ViT's encoder
  layers) are each one FSDP unit, whose parameters are gathered just before they are used and
  freed after; the root holds what is left (stem, head). It must run before the optimizer is
  built: it replaces the parameters with sharded ones (DTensors).
- **Buffers** (`sync_buffers`): FSDP shards parameters, not buffers; every rank updates its own
  BatchNorm statistics from its local batch. DDP makes all ranks take rank 0's at every
  forward, and rank 0's are what it saves. Broadcasting rank 0's after every step gives the same
  semantics, so a checkpoint (whichever rank writes a replicated buffer) holds the statistics
  an uninterrupted run goes on with: resumption stays exact, and the run matches DDP.
- **State** (`sharded_state`, `load_sharded`): through `torch.distributed.checkpoint.state_dict`,
  which names optimizer state by parameter name and lets DCP reshard on load.
- **Evaluation** (`unsharded`): ranks hold different numbers of eval batches, and every FSDP
  forward is a collective (an all-gather). Gathering the parameters once before evaluating and
  keeping them until the end makes the eval forwards local. The price: the whole parameter set
  (not the gradients or optimizer state, which dominate training memory) is on every rank
  during evaluation.
- **Final weights** (`full_state_dict`): the full state gathered to rank 0 on CPU, for the same
  `final.safetensors` a DDP run writes.

One process with `distributed: fsdp` shards nothing (there is no one to share with) but writes
the same checkpoint directories, so a run can move between world sizes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

from visionloop.train.dist import DistInfo
from visionloop.train.sharded_checkpoint import dcp_load


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules that become one FSDP unit each, outermost first, never nested: a module held
    in a Sequential/ModuleList that has parameters, without descending into it."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        container = isinstance(module, nn.Sequential | nn.ModuleList)
        for child in module.children():
            if container and any(True for _ in child.parameters()):
                units.append(child)
            else:
                visit(child)

    visit(model)
    return units


def shard_model(model: nn.Module, device: torch.device) -> nn.Module:
    """Apply `fully_shard` to every unit, then to the root (in place; returns `model`).

    Needs the default process group (one mesh over all ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (tdist.get_world_size(),))
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def grad_scaler(device: torch.device, *, enabled: bool) -> torch.amp.GradScaler:
    """fp16's loss scaler. Sharded, each rank sees only its shard of the gradients: an inf in
    one rank's shard must make every rank skip the step (ShardedGradScaler all-reduces it)."""
    if not enabled:
        return torch.amp.GradScaler(device.type, enabled=False)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device.type)


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def sync_buffers(model: nn.Module, info: DistInfo) -> None:
    """Every rank takes rank 0's buffers: one broadcast per dtype (buffers are small and many;
    a broadcast each would cost a round trip each)."""
    if not info.enabled:
        return
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for b in model.buffers():
        by_dtype.setdefault((b.dtype, b.device), []).append(b)
    for group in by_dtype.values():
        flat = torch.cat([b.reshape(-1) for b in group])
        tdist.broadcast(flat, src=0)
        offset = 0
        for b in group:
            n = b.numel()
            b.copy_(flat[offset : offset + n].view_as(b))
            offset += n


@contextlib.contextmanager
def unsharded(model: nn.Module) -> Iterator[None]:
    """Parameters gathered on every rank for the duration (see the module docstring): forwards
    inside make no collectives, so ranks may run different numbers of them."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield
        return
    root = units[0]
    root.set_reshard_after_forward(False)  # recursive: every unit keeps what it gathered
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        # fully_shard's own settings: units free after forward; the root keeps its parameters
        # (its backward needs them at once).
        root.set_reshard_after_forward(True)
        root.set_reshard_after_forward(False, recurse=False)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], Any]:
    """(model state, optimizer state or None), each rank's shards, keyed by parameter name.

    The optimizer's state is left out while it has none (before the first step):
    `get_optimizer_state_dict` would create it with a zero-learning-rate step, which changes
    the step count and so the next real step of an Adam-type optimizer."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_state = get_model_state_dict(model)
    optim_state = get_optimizer_state_dict(model, optimizer) if optimizer.state else None
    return model_state, optim_state


def load_sharded(
    model: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, *, with_optimizer: bool
) -> None:
    """Load a verified checkpoint directory's shards into the (sharded or plain) model and
    optimizer. Collective: every rank calls it. DCP reshards: a checkpoint written by N
    processes loads into M."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state: dict[str, Any] = {"model": get_model_state_dict(model)}
    if with_optimizer:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp_load(state, directory)
    set_model_state_dict(model, state["model"])
    if with_optimizer:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


def full_state_dict(model: nn.Module, info: DistInfo) -> dict[str, torch.Tensor]:
    """The unsharded model state on CPU, on rank 0 (empty elsewhere). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not is_sharded(model):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()} if info.is_main else {}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    return {k: v for k, v in full.items() if isinstance(v, torch.Tensor)}
