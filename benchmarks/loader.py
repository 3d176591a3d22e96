"""Loader throughput: visionloop's shard loader vs torchvision ImageFolder + DataLoader.

Both read the same JPEG photos (synthetic, 640x480) with the same number of workers and
batch size, and produce the same training batch: a random-resized 224x224 crop, a random
horizontal flip, normalised float32 (N, 3, 224, 224). The baseline is torchvision's standard
recipe (PIL decode, RandomResizedCrop, ToTensor, Normalize in the workers). visionloop decodes
with libjpeg-turbo via torchvision.io, augments uint8 tensors and normalises in the main
process (timed too). Shards are built once by `visionloop data ingest`; that one-off time is
reported separately. Two shard variants: original JPEG bytes (no resize at ingest), and
`--max-side 256`, the recommended setting for 224 training.

    python benchmarks/loader.py [--images 1500] [--workers 2] [--epochs 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from _common import synthetic_photos, write_result

SIZE = 224
BATCH = 64
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def images_per_s(loader: Any, epochs: int, per_batch: Any = None, warmup_batches: int = 3) -> float:
    """Images/s over `epochs` passes, not counting the first `warmup_batches` (worker start)."""
    seen, t0 = 0, None
    for _ in range(epochs):
        for i, (x, _y) in enumerate(loader):
            if per_batch is not None:
                x = per_batch(x)
            if t0 is None and i + 1 >= warmup_batches:
                t0, seen = time.perf_counter(), 0
                continue
            seen += x.shape[0]
    assert t0 is not None
    return seen / (time.perf_counter() - t0)


def baseline(root: Path, workers: int, epochs: int) -> float:
    from torchvision import datasets
    from torchvision import transforms as T

    tf = T.Compose(
        [T.RandomResizedCrop(SIZE), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]
    )
    ds = datasets.ImageFolder(str(root), transform=tf)
    loader = torch.utils.data.DataLoader(
        ds,
        batch_size=BATCH,
        shuffle=True,
        num_workers=workers,
        drop_last=True,
        persistent_workers=workers > 0,
    )
    return images_per_s(loader, epochs)


def visionloop_loader(dataset_dir: Path, workers: int, epochs: int) -> float:
    from visionloop.data.loader import make_loader
    from visionloop.data.manifest import read_manifest
    from visionloop.data.normalize import Normalizer
    from visionloop.data.sampler import ResumableBatchSampler
    from visionloop.data.shards import ShardReader
    from visionloop.specs import AugmentSpec
    from visionloop.tasks.classification.data import ShardClassificationDataset
    from visionloop.tasks.classification.transforms import TrainTransform

    m = read_manifest(dataset_dir)
    reader = ShardReader(dataset_dir / m.splits["train"].shard_dir)
    ds = ShardClassificationDataset(
        reader, TrainTransform(SIZE, AugmentSpec(scale=(0.08, 1.0), hflip=0.5), seed=0)
    )
    sampler = ResumableBatchSampler(reader.chunk_sizes, BATCH, seed=0)
    loader = make_loader(ds, sampler, workers=workers)
    norm = Normalizer(MEAN, STD)
    epoch = [0]

    class Epochs:
        def __iter__(self) -> Any:
            sampler.set_position(epoch[0], 0)
            epoch[0] += 1
            return iter(loader)

    try:
        return images_per_s(Epochs(), epochs, per_batch=norm)
    finally:
        it = getattr(loader, "_iterator", None)
        if it is not None:
            it._shutdown_workers()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=1500)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="alternate baseline/ours this many times")
    args = ap.parse_args()

    from visionloop.data.ingest import IngestOptions, ingest

    with tempfile.TemporaryDirectory() as tmp:
        root = synthetic_photos(Path(tmp) / "photos", args.images)
        t = time.perf_counter()
        raw = ingest(root, Path(tmp) / "ds-raw", IngestOptions(val_fraction=0.0, workers=args.workers)).out
        ingest_raw_s = time.perf_counter() - t
        t = time.perf_counter()
        small = ingest(
            root, Path(tmp) / "ds-256", IngestOptions(val_fraction=0.0, max_side=256, workers=args.workers)
        ).out
        ingest_256_s = time.perf_counter() - t

        runs: dict[str, list[float]] = {"imagefolder": [], "shards_original": [], "shards_max_side_256": []}
        for _ in range(args.rounds):  # alternate, so drift in machine load hits all alike
            runs["imagefolder"].append(baseline(root, args.workers, args.epochs))
            runs["shards_original"].append(visionloop_loader(raw, args.workers, args.epochs))
            runs["shards_max_side_256"].append(visionloop_loader(small, args.workers, args.epochs))

    best = {k: max(v) for k, v in runs.items()}
    ratio_raw = best["shards_original"] / best["imagefolder"]
    ratio_256 = best["shards_max_side_256"] / best["imagefolder"]
    print(f"ImageFolder + DataLoader     {best['imagefolder']:8.0f} img/s   (baseline)")
    print(f"shards, original JPEG bytes  {best['shards_original']:8.0f} img/s   ratio {ratio_raw:.2f}x")
    print(
        f"shards, --max-side 256       {best['shards_max_side_256']:8.0f} img/s   "
        f"ratio {ratio_256:.2f}x  (target >= 2x)"
    )
    print(
        f"one-off ingest: {ingest_raw_s:.1f} s (original), {ingest_256_s:.1f} s (--max-side 256) "
        f"for {args.images} images"
    )
    path = write_result(
        "loader",
        {
            "config": vars(args) | {"size": SIZE, "batch": BATCH, "photo": "640x480 JPEG q90"},
            "images_per_s": runs,
            "best_images_per_s": best,
            "ratio_original": ratio_raw,
            "ratio_max_side_256": ratio_256,
            "target": 2.0,
            "ingest_seconds": {"original": ingest_raw_s, "max_side_256": ingest_256_s},
        },
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
