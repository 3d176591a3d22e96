"""Process start-up: the CPU a fresh process spends to preprocess its first image, with
visionloop's plain-torch image path (`data.imageops`, the model card's eval transform) against
the torchvision v2 path it replaced (the same pixels, bitwise: tests/unit/test_imageops.py).

Every `visionloop eval`, `export`, `serve`, `label select` and training process pays this
once; a test suite that starts hundreds of them pays it hundreds of times.

    python benchmarks/startup.py --rounds 5

Each round starts one fresh interpreter per side (alternating), which imports what it needs,
decodes a PNG and runs the eval transform; the CPU time (user + system) of the child is read
from the kernel. Prints the median per side and the ratio visionloop / torchvision.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

SETUP = """
import io
import numpy as np
from PIL import Image
buf = io.BytesIO()
Image.fromarray(np.random.default_rng(0).integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(buf, "PNG")
data = buf.getvalue()
"""

VISIONLOOP = (
    SETUP
    + """
from visionloop.data.imageops import decode_rgb
from visionloop.models.card import EvalPreprocess
pre = EvalPreprocess(channels=3, resize_size=256, crop_size=(224, 224), interpolation="bilinear",
                     mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
x = pre.to_transform()(decode_rgb(data))
assert x.shape == (3, 224, 224)
"""
)

TORCHVISION = (
    SETUP
    + """
import torch
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms import v2
t = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop([224, 224]),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
x = t(decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB))
assert x.shape == (3, 224, 224)
"""
)


def _cpu_of(code: str) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=str, default=None, help="Also write the figures here.")
    args = parser.parse_args()
    _cpu_of(VISIONLOOP)  # warm the page cache and bytecode for both sides
    _cpu_of(TORCHVISION)
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(args.rounds):
        ours.append(_cpu_of(VISIONLOOP))
        theirs.append(_cpu_of(TORCHVISION))
    a, b = statistics.median(ours), statistics.median(theirs)
    for name, runs, median in (("visionloop (imageops)  ", ours, a), ("torchvision v2 (before)", theirs, b)):
        print(f"{name} CPU-s per process: {', '.join(f'{v:.2f}' for v in runs)}  median {median:.2f}")
    print(f"ratio visionloop / torchvision: {a / b:.3f}  (saved {b - a:.2f} CPU-s per process)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"visionloop": ours, "torchvision": theirs, "ratio": a / b, "at": time.time()}, f)


if __name__ == "__main__":
    main()
