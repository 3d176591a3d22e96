"""Checkpoints copied to an object store: what the copy costs training, and how its upload and
download compare with fsspec's own.

A real training state (a ResNet-50 with AdamW moments, about 300 MB) is checkpointed with
visionloop's CheckpointManager, once with no store and once copying to an S3 server
(SeaweedFS on loopback, started here unless --endpoint names one), alternating rounds:
  - the loop's stall per checkpoint (the copy runs on the writer thread, so it should not
    change);
  - the time until a checkpoint is safe off the machine (written, then uploaded), against
    the local write alone;
  - visionloop's sync (a listing, the upload, the pruning) against a bare `put_file` of the
    same file with s3fs, and its resume download (size check, complete-or-absent file,
    fsync) against a bare `get_file`.

    python benchmarks/checkpoint_store.py [--arch resnet50] [--rounds 3] [--endpoint URL]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from _common import median, write_result

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--endpoint", default=None, help="an S3 endpoint to use instead of a local SeaweedFS")
    args = ap.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "vl")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "vl-secret")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    server = None
    endpoint = args.endpoint
    if endpoint is None:
        from _s3kit import start_server

        server = start_server()
        endpoint = next(server).endpoint
    try:
        run(args, endpoint)
    finally:
        if server is not None:
            server.close()


def run(args: argparse.Namespace, endpoint: str) -> None:
    from visionloop.core.objectstore import ObjectStore, parse_store_uri
    from visionloop.models import create_model
    from visionloop.train.checkpoint import CheckpointManager, checkpoint_name
    from visionloop.train.checkpoint_store import CheckpointStore

    torch.manual_seed(0)
    model = create_model(args.arch, 1000)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(4, 3, 64, 64), torch.randint(0, 1000, (4,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    state: dict[str, Any] = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "position": {"step": 1},
    }

    bucket = f"vl-bench-{uuid.uuid4().hex[:8]}"
    store = ObjectStore(parse_store_uri(f"s3://{bucket}/bench"), endpoint_url=endpoint, timeout_s=120.0)
    store.fs.mkdir(bucket)
    work = Path(tempfile.mkdtemp(prefix="vl-ckpt-store-"))
    rows: dict[str, list[float]] = {
        k: [] for k in ("stall_off", "stall_on", "local", "safe", "sync", "put", "fetch", "get")
    }
    size = 0
    try:
        for r in range(args.rounds):
            for copy in (False, True):  # alternating rounds: the machine's drift hits both
                d = work / f"{r}-{int(copy)}"
                cs = CheckpointStore(store, f"runs/r{r}") if copy else None
                m = CheckpointManager(d, keep_last=1, keep_best=0, store=cs)
                t0 = time.perf_counter()
                m.save(state, step=r + 1)
                m.wait()
                total = time.perf_counter() - t0
                rows["stall_on" if copy else "stall_off"].append(m.last_stall_s)
                if copy:
                    rows["safe"].append(total)
                    rows["sync"].append(m.last_copy_s)
                else:
                    rows["local"].append(total)
                m.close()
            path = work / f"{r}-1" / checkpoint_name(r + 1)
            size = path.stat().st_size
            t0 = time.perf_counter()
            store.fs.put_file(str(path), f"{bucket}/bare/{r}.ckpt")
            rows["put"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            store.fs.get_file(f"{bucket}/bare/{r}.ckpt", str(work / f"bare-{r}.ckpt"))
            rows["get"].append(time.perf_counter() - t0)
            fresh = work / f"fresh-{r}"
            cs = CheckpointStore(store, f"runs/r{r}")
            t0 = time.perf_counter()
            cs.fetch(r + 1, checkpoint_name(r + 1), size, fresh, 1 << 40)
            rows["fetch"].append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {k: median(v) for k, v in rows.items()}
    print(
        f"state {args.arch} + AdamW, checkpoint {size / 2**20:.0f} MiB, {args.rounds} rounds, "
        f"S3 at {endpoint}"
    )
    print(
        f"loop stall per checkpoint: no store {med['stall_off'] * 1e3:.0f} ms, "
        f"copying {med['stall_on'] * 1e3:.0f} ms "
        f"(ratio {med['stall_on'] / med['stall_off']:.2f})"
    )
    print(f"until safe: on local disk {med['local']:.2f} s, also in the store {med['safe']:.2f} s")
    print(
        f"upload: visionloop sync {med['sync']:.2f} s, bare s3fs put_file {med['put']:.2f} s "
        f"(ratio {med['sync'] / med['put']:.2f}); {size / 2**20 / med['sync']:.0f} MiB/s"
    )
    print(
        f"download: visionloop fetch {med['fetch']:.2f} s, bare s3fs get_file {med['get']:.2f} s "
        f"(ratio {med['fetch'] / med['get']:.2f})"
    )
    path_out = write_result(
        "checkpoint_store", {"arch": args.arch, "size_bytes": size, "rounds": rows, "median": med}
    )
    print(f"results: {path_out}")


if __name__ == "__main__":
    main()
