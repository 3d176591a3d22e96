"""Shared helpers for benchmarks: machine description, results files, synthetic data.

Benchmarks compare against a baseline measured in the same run and print the ratio; they
never assert wall-clock thresholds. Results go to benchmarks/results/<name>.json.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def machine() -> dict[str, Any]:
    import torch

    from visionloop.bench.sweep import cpu_name

    cpu = cpu_name()
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    doc = {"benchmark": name, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(), **payload}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def synthetic_photos(
    root: Path, n: int, classes: int = 10, size: tuple[int, int] = (640, 480), seed: int = 0
) -> Path:
    """JPEG 'photos' (smooth colour fields + texture + shapes, quality 90) in an ImageFolder.
    They compress and decode like camera images rather than like noise or flat colour."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    w, h = size
    xx = np.mgrid[0:h, 0:w][1].astype(np.float32)
    for c in range(classes):
        (root / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        c = i % classes
        base = np.stack(
            [np.sin(xx / rng.uniform(20, 200) + rng.uniform(0, 6)) * 60 + 120 + 40 * k for k in range(3)],
            axis=-1,
        )
        base += rng.normal(0, 12, size=(h, w, 3))
        img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).filter(ImageFilter.GaussianBlur(1))
        draw = ImageDraw.Draw(img)
        for _ in range(6):
            x0, y0 = int(rng.integers(0, w - 50)), int(rng.integers(0, h - 50))
            x1, y1 = x0 + int(rng.integers(20, 200)), y0 + int(rng.integers(20, 200))
            color = tuple(int(v) for v in rng.integers(0, 256, 3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=color)
        img.save(root / f"class_{c:02d}" / f"{i:05d}.jpg", quality=90)
    return root


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank), e.g. pct(times, 0.99) for a p99."""
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]
