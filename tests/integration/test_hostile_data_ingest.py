"""A FIFO named like an image in a real ingest (worker processes, shards, manifest): it is
rejected, listed in rejected.jsonl with what to do, and every other image is stored. Before,
hashing it waited for a writer forever. And `data info` on a dataset whose side files were
replaced by a FIFO or a line gigabytes long: it answers, reading neither whole."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import _warmcli
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

    # `data info` lists the rejections from rejected.jsonl, a side file of the dataset folder.
    out = tmp_path / "out"
    side = out / "rejected.jsonl"
    good = side.read_bytes()

    def info() -> str:
        r = _warmcli.run(["data", "info", str(out)], env={**os.environ, "COLUMNS": "250"}, timeout=120)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        return r.stdout

    assert "unreadable" in info() and "stream.jpg" in info()
    # A line longer than ingest writes (a crash's NULs, no newline) is skipped, not held whole;
    # the real row after it is still counted. Before, the file was read whole, then split.
    side.write_bytes(b"\0" * (4 << 20) + b"\n" + good)
    shown = info()
    assert "unreadable" in shown and "stream.jpg" in shown, shown
    # A FIFO in its place: before, `data info` waited for a writer forever.
    side.unlink()
    os.mkfifo(side)
    shown = info()
    assert "rejected: 1" in shown and "stream.jpg" not in shown, shown
