"""The alert log (`<home>/alerts/log.jsonl`) read back for `alerts list --all`: what a crash or
another program left in it is skipped, and never held whole."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

from _hangkit import in_thread
from visionloop.alerts.deliver import AlertLog


def test_events_are_read_back_in_order_and_junk_lines_skipped(tmp_path: Path) -> None:
    log = AlertLog(tmp_path / "alerts" / "log.jsonl")
    log.append("firing", key="drift:pets", value=3.0)
    with open(log.path, "ab") as f:
        f.write(b"\xff\xfe not UTF-8\n")
        f.write(b'["a list, not an event"]\n')
        f.write(b"\0" * (8 << 20) + b"\n")  # a crash's NULs, one line
        f.write(b'{"event": "resolved", "key": "drift:pets"')  # torn: no end
        f.write(b"\n")
    log.append("resolved", key="drift:pets")
    tracemalloc.start()
    try:
        got = [(e["event"], e["key"]) for e in log.read()]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == [("firing", "drift:pets"), ("resolved", "drift:pets")]
    assert peak < 4 << 20, f"{peak} bytes held"


def test_a_fifo_in_place_of_the_log_reads_as_no_events(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    os.mkfifo(path)
    assert in_thread(lambda: list(AlertLog(path).read())) == []
