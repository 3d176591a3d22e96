"""The prediction record: what the server writes reads back the same, older lines still read,
and a reader skips what is not a record instead of failing the whole log."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from visionloop.serve.predlog import PredictionLog
from visionloop.serve.record import (
    MAX_LINE_BYTES,
    SCHEMA_VERSION,
    PredictionRecord,
    ReadStats,
    RecordError,
    read_records,
)


def test_round_trip_through_the_log_file(tmp_path: Path) -> None:
    records = [
        PredictionRecord(1.5, "digits", 3, "primary", 4.25, {"top_class": "7", "confidence": 0.98}),
        PredictionRecord(
            2.0, "digits", 4, "shadow", 5.0, {"top_class": "1", "confidence": 0.5}, agrees=False
        ),
        PredictionRecord(2.5, "shapes", 1, "challenger", 9.0, {"detections": 2, "counts": {"circle": 2}}),
    ]
    log = PredictionLog(tmp_path / "p.jsonl", max_bytes=1 << 20, backups=1)
    for r in records:
        log.put(r)
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert lines[0] == {
        "schema": SCHEMA_VERSION,
        "time": 1.5,
        "model": "digits",
        "version": 3,
        "role": "primary",
        "latency_ms": 4.25,
        "top_class": "7",
        "confidence": 0.98,
    }
    assert lines[1]["agrees"] is False and "agrees" not in lines[0]
    assert list(read_records(tmp_path / "p.jsonl")) == records


def test_schema_1_lines_read_and_newer_ones_are_refused() -> None:
    old = {"time": 1.0, "model": "m", "version": 1, "latency_ms": 2.0, "top_class": "a", "role": "primary"}
    r = PredictionRecord.from_json(old)
    assert r.schema == SCHEMA_VERSION and r.answer == {"top_class": "a"} and r.agrees is None
    with pytest.raises(RecordError, match="newer visionloop"):
        PredictionRecord.from_json({**old, "schema": SCHEMA_VERSION + 1})


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"time": "now"}, "time must be a finite number"),
        ({"latency_ms": float("nan")}, "latency_ms must be a finite number"),
        ({"model": ""}, "model must be a non-empty string"),
        ({"version": 0}, "version must be a positive integer"),
        ({"version": True}, "version must be a positive integer"),
        ({"role": "boss"}, "role must be one of primary, challenger, shadow"),
        ({"agrees": "yes"}, "agrees must be true or false"),
        ({"schema": "2"}, "schema must be a positive integer"),
    ],
)
def test_bad_fields_are_named(change: dict[str, object], message: str) -> None:
    doc = {"schema": 2, "time": 1.0, "model": "m", "version": 1, "role": "primary", "latency_ms": 1.0}
    with pytest.raises(RecordError, match=message):
        PredictionRecord.from_json({**doc, **change})


def test_a_reader_skips_and_counts_what_is_not_a_record(tmp_path: Path) -> None:
    good = PredictionRecord(1.0, "m", 1, "primary", 1.0, {"top_class": "a"}).to_json()
    path = tmp_path / "p.jsonl"
    path.write_text(
        "\n".join(
            [
                json.dumps(good),
                '{"time": 1.0, "model": "m"',  # torn by a crash mid-write
                json.dumps([1, 2, 3]),
                json.dumps({**good, "pad": "x" * 70_000}),  # far longer than any record
                "",
                json.dumps({**good, "time": 2.0}),
            ]
        )
        + "\n"
    )
    stats = ReadStats()
    got = list(read_records(path, stats))
    assert [r.time for r in got] == [1.0, 2.0]
    assert (stats.read, stats.bad) == (2, 3)
    assert stats.first_error is not None and stats.first_error.startswith(f"{path}:2:")


def test_a_line_past_the_limit_is_skipped_without_holding_it_in_memory(tmp_path: Path) -> None:
    """A crash can leave a log with megabytes of NULs and no newline: the reader counts the
    line and reads on, a block at a time, instead of reading it whole to measure it."""
    good = PredictionRecord(1.0, "m", 1, "primary", 1.0, {"top_class": "a"}).to_json()
    path = tmp_path / "p.jsonl"
    with path.open("wb") as f:
        f.write(json.dumps(good).encode() + b"\n")
        f.write(b"\0" * (24 * 2**20) + b"\n")  # one 24 MiB line
        f.write(json.dumps({**good, "time": 2.0}).encode() + b"\n")
        f.write(b"\0" * (8 * 2**20))  # and a torn tail without a newline
    stats = ReadStats()
    tracemalloc.start()
    try:
        got = list(read_records(path, stats))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [r.time for r in got] == [1.0, 2.0]
    assert (stats.read, stats.bad) == (2, 2)
    assert stats.first_error == f"{path}:2: line of {24 * 2**20 + 1} bytes (at most {MAX_LINE_BYTES})"
    assert peak < 4 * 2**20, f"{peak} bytes held"


def test_a_fifo_among_the_logs_is_counted_not_waited_on(tmp_path: Path) -> None:
    import os

    from _hangkit import in_thread

    fifo = tmp_path / "predictions.jsonl.1"
    os.mkfifo(fifo)
    stats = ReadStats()
    assert in_thread(lambda: list(read_records(fifo, stats))) == []
    assert stats.bad == 1 and "FIFO" in str(stats.first_error)
