"""Process-group setup for DDP under torchrun (or any launcher that sets RANK/WORLD_SIZE).

gloo on CPU, NCCL on CUDA. A single process needs no process group at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from visionloop.core.errors import TrainingError
from visionloop.train.launch import node_layout


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def from_env() -> DistInfo:
    if not os.environ.get("WORLD_SIZE"):
        # One process per node, started by a multi-node launcher (visionloop.train.launch).
        layout = node_layout(os.environ)
        if layout is not None:
            return DistInfo(rank=layout.node_rank, local_rank=0, world_size=layout.nnodes)
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError as e:
        raise TrainingError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers: {e}") from e
    return DistInfo(rank=rank, local_rank=local, world_size=world)


def init(info: DistInfo, device: torch.device) -> bool:
    """Create the process group if this process runs under a launcher; True if it did."""
    if not info.enabled or dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(minutes=30)}
    # Given explicitly: a one-process-per-node rank has no RANK/WORLD_SIZE in its environment.
    kwargs.update(rank=info.rank, world_size=info.world_size)
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)
    return True


def shutdown() -> None:
    """Destroy the process group. Call it after the last collective (on a clean exit, after a
    barrier) and once nothing else uses the group: the checkpoint writer's thread joined.

    With gloo this does not end the backend's C++ threads while a DDP or FSDP wrapper still
    refers to the group (torch 2.14 keeps such references until the interpreter exits), so
    nothing may start a collective afterwards."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def any_flag(flags: list[bool], device: torch.device, info: DistInfo) -> list[bool]:
    """Element-wise OR of boolean flags over all ranks (one small all_reduce)."""
    if not info.enabled:
        return flags
    t = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(x) for x in t.tolist()]


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_buffers(module: torch.nn.Module, info: DistInfo) -> None:
    """Every rank takes rank 0's buffers (BatchNorm running statistics). DDP copies them at the
    start of each training forward, which then updates each rank's own from its local batch:
    between steps the ranks differ, and only rank 0's are saved."""
    if info.enabled:
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
