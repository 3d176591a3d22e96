"""Checkpoint stall: how long the training loop is blocked per checkpoint, visionloop's
background writer vs a synchronous `torch.save` of the same state.

The state is a real training state — model, AdamW moments, scheduler, RNG and position —
for a ResNet-50 (about 300 MB) after a few training steps on CPU. visionloop's `save()` blocks
only while the state is copied to host memory; serialisation, SHA-256, fsync and rename run
on the writer thread while training continues. The baseline blocks for a plain
`torch.save(state, path)` (no fsync, no checksum: the cheapest synchronous save there is).
Training steps run between checkpoints, long enough for the previous write to finish, as with
checkpoints minutes apart. Also reported: how much slower the training steps run while a
background write is in flight (the writer shares the CPU and the GIL).

    python benchmarks/checkpoint_stall.py [--arch resnet50] [--checkpoints 4]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from _common import median, write_result


def make_state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    from visionloop.train import rng

    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": [rng.capture()],
        "position": {"step": step, "epoch": 0, "batch": step},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--checkpoints", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=64)
    args = ap.parse_args()

    from visionloop.models import create_model
    from visionloop.train.checkpoint import CheckpointManager

    torch.manual_seed(0)
    model = create_model(args.arch, 1000)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 1000, (args.batch,))

    def step() -> float:
        t = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        return time.perf_counter() - t

    for _ in range(2):
        step()  # materialise the optimizer state
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(
        v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v)
    )

    sync_s: list[float] = []
    stall_s: list[float] = []
    write_s: list[float] = []
    idle_steps: list[float] = []
    busy_steps: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        manager = CheckpointManager(Path(tmp) / "vl", keep_last=2, keep_best=0)
        for i in range(args.checkpoints):
            # Baseline: the loop stops for the whole synchronous save.
            t = time.perf_counter()
            torch.save(make_state(model, opt, i), Path(tmp) / f"sync-{i}.pt")
            sync_s.append(time.perf_counter() - t)
            idle_steps += [step() for _ in range(2)]

            # visionloop: the loop stops only for the snapshot; train while the writer works.
            manager.save(make_state(model, opt, i), step=i)
            stall_s.append(manager.last_stall_s)
            while manager._pending is not None and not manager._pending.done():
                busy_steps.append(step())
            manager.wait()
            write_s.append(manager.last_write_s)
            idle_steps += [step() for _ in range(2)]
        manager.close()

    ratio = median(stall_s) / median(sync_s)
    slowdown = median(busy_steps) / median(idle_steps) if busy_steps else 1.0
    mb = state_bytes / 2**20
    print(f"state: {args.arch} + AdamW, {mb:.0f} MiB")
    print(f"synchronous torch.save     {median(sync_s) * 1000:8.0f} ms blocked per checkpoint (baseline)")
    print(f"visionloop save()          {median(stall_s) * 1000:8.0f} ms blocked per checkpoint   "
          f"ratio {ratio:.3f}  (target <= 0.2)")  # fmt: skip
    print(f"  background write (serialise + sha256 + fsync + rename): {median(write_s) * 1000:.0f} ms")
    print(f"  training steps during a background write: {slowdown:.2f}x their idle time "
          f"({len(busy_steps)} steps measured)")  # fmt: skip
    path = write_result(
        "checkpoint_stall",
        {
            "config": vars(args),
            "state_mib": mb,
            "sync_save_s": sync_s,
            "visionloop_stall_s": stall_s,
            "background_write_s": write_s,
            "ratio": ratio,
            "target": 0.2,
            "step_slowdown_during_write": slowdown,
        },
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
