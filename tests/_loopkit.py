"""The loop tests' helpers: labelled folders as `label import` leaves them, and a driver that
takes a loop's passes until its round ends."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from _cpkit import CP
from visionloop.api.client import Client
from visionloop.core.settings import load_settings
from visionloop.data.manifest import read_manifest
from visionloop.data.shards import ShardReader
from visionloop.loop import runner, state, steps
from visionloop.loop.runner import advance
from visionloop.loop.spec import LoopSpec
from visionloop.loop.triggers import REPORT_SUFFIX


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


def drive_through_crashes(
    spec: LoopSpec, cp: CP, monkeypatch: pytest.MonkeyPatch, deadline_s: float = 400
) -> tuple[runner.Pass, list[str]]:
    """Drive the round to its end while every state the loop is about to save for the first
    time is lost once (the process "dies" after a step acted, before its record reached the
    disk); returns the closing pass and the states lost."""
    settings = load_settings()
    real_save = state.save_state
    crashed: list[str] = []

    def flaky_save(home: Path, st: state.LoopState) -> None:
        rnd = st.rounds[-1] if st.rounds else None
        steps = [] if rnd is None else [(n, r.status, sorted(r.outputs)) for n, r in rnd.steps.items()]
        signature = json.dumps([None if rnd is None else rnd.outcome, steps])
        if signature not in crashed:
            crashed.append(signature)
            raise Crash()
        real_save(home, st)

    # Both modules that save the state: the pass (`runner`) and the steps (`steps`: a step
    # saves mid-way, e.g. once its queue job is submitted).
    for module in (runner, steps):
        monkeypatch.setattr(module, "save_state", flaky_save)
    try:
        deadline = time.monotonic() + deadline_s
        while True:
            assert time.monotonic() < deadline, f"the round did not end within {deadline_s} s"
            try:
                result = advance(spec, settings, lambda: Client(cp.url, cp.admin_token))
            except Crash:
                continue
            if result.stopped == "closed":
                return result, crashed
            time.sleep(0.3)
    finally:
        for module in (runner, steps):
            monkeypatch.setattr(module, "save_state", real_save)
