"""The loop tests' helpers: labelled folders as `label import` leaves them, and a driver that
takes a loop's passes until its round ends."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
from PIL import Image

from _cpkit import CP
from visionloop.api.client import Client
from visionloop.core.settings import load_settings
from visionloop.data.manifest import read_manifest
from visionloop.data.shards import ShardReader
from visionloop.loop import runner
from visionloop.loop.runner import REPORT_SUFFIX, advance
from visionloop.loop.spec import LoopSpec


class Crash(BaseException):
    """A process killed between a step's act and its record (not an Exception: nothing catches it)."""


def labelled_folder(dataset: Path, out: Path, n: int, seed: int) -> None:
    """`n` new labelled images (noisy copies of val images, under their true class) as `label
    import` leaves them: a folder and its report beside it."""
    m = read_manifest(dataset)
    reader = ShardReader(dataset / "shards" / "val")
    rng = np.random.default_rng(seed)
    for k in range(n):
        r = reader[k * 3 % len(reader)]
        pixels = np.asarray(Image.open(io.BytesIO(r["image"])).convert("RGB"), dtype=np.int64)
        noisy = np.clip(pixels + rng.integers(-25, 25, pixels.shape), 0, 255).astype(np.uint8)
        folder = out / m.classes[int(r["label"])]
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(noisy).save(folder / f"{seed}-{k}.png")
    out.with_name(out.name + REPORT_SUFFIX).write_text(json.dumps({"images": n}))


def drive(spec: LoopSpec, cp: CP, deadline_s: float = 300) -> runner.Pass:
    settings = load_settings()
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        result = advance(spec, settings, lambda: Client(cp.url, cp.admin_token))
        if result.stopped != "waiting":
            return result
        time.sleep(0.3)
    raise AssertionError(f"the round did not end within {deadline_s} s: {result.reason}")
