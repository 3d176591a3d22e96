"""`label.scoring.score_folder` reads each listed image as a regular file with a size cap: a file
swapped for a FIFO after the listing is skipped (never waited on), one past the cap is skipped
with "larger than ...", and the readable ones are scored."""

from __future__ import annotations

import io
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from PIL import Image

import visionloop.label.scoring as scoring
from _hangkit import in_thread
from visionloop.core.fsutil import human_bytes


class FakeScorer:
    """What score_folder asks of a Scorer, without a registry or a model."""

    has_embeddings = False

    def __init__(self, ref: str, settings: Any, precision: str) -> None:
        self.info = SimpleNamespace(ref=f"{ref}/1")
        self.card = SimpleNamespace(class_names=["a", "b"])
        self.task = SimpleNamespace(uncertainty_inputs=lambda outputs, names: None)

    def decode(self, data: bytes) -> np.ndarray:
        return np.zeros((1, 4), np.float32)

    def run(self, inputs: Any) -> dict[str, np.ndarray]:
        return {"logits": np.zeros((len(inputs), 2), np.float32)}


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (16, 16), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    src = tmp_path / "pool"
    src.mkdir()
    (src / "a.png").write_bytes(_png(0))
    (src / "big.png").write_bytes(_png(1) + b"\0" * 4096)
    os.mkfifo(src / "swapped.png")  # a regular file when listed, a FIFO when read
    listed = [src / "a.png", src / "big.png", src / "swapped.png"]
    monkeypatch.setattr(scoring, "list_images", lambda source: listed)
    monkeypatch.setattr(scoring, "Scorer", FakeScorer)
    monkeypatch.setattr(scoring, "MAX_FILE_BYTES", 4096)
    return src


def test_a_fifo_and_a_file_past_the_cap_are_skipped_never_waited_on(folder: Path) -> None:
    scored = in_thread(lambda: scoring.score_folder("m", folder, settings=object(), labelled=False))
    assert not isinstance(scored, BaseException), scored
    assert scored.pool.ids == ("a.png",)
    why = dict(scored.skipped)
    assert set(why) == {"big.png", "swapped.png"}
    assert why["big.png"] == "larger than 4 KiB"
    assert "not a regular file" in why["swapped.png"]


def test_the_default_cap_is_named_as_before() -> None:
    assert scoring.MAX_FILE_BYTES == 64 * 1024 * 1024
    assert human_bytes(scoring.MAX_FILE_BYTES) == "64 MiB"  # "larger than 64 MiB", as before
