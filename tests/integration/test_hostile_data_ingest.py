"""A FIFO named like an image in a real ingest (worker processes, shards, manifest): it is
rejected, listed in rejected.jsonl with what to do, and every other image is stored. Before,
hashing it waited for a writer forever."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from _imgfactory import noise, png, write
from visionloop.data.ingest import IngestOptions, ingest


@pytest.mark.timeout(120)
def test_a_fifo_in_an_imagefolder_is_rejected_and_the_rest_ingested(tmp_path: Path) -> None:
    source = tmp_path / "source"
    for i, cls in enumerate(["cat", "dog"] * 3):
        write(source / cls / f"{i}.png", png(noise(16, 16, seed=i)))
    os.mkfifo(source / "cat" / "stream.jpg")
    report = ingest(source, tmp_path / "out", IngestOptions(workers=2))
    rejected = [json.loads(line) for line in (tmp_path / "out" / "rejected.jsonl").read_text().splitlines()]
    assert [(r["path"], r["reason"]) for r in rejected] == [("cat/stream.jpg", "unreadable")]
    assert "FIFO" in rejected[0]["message"] and "remove it" in rejected[0]["message"]
    assert report.rejected_by_reason == {"unreadable": 1}
    assert sum(report.stored_as.values()) == 6
