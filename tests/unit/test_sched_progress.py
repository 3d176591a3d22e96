"""Progress lines: what the trainer writes, and how the control plane reads them back from an
attempt's log (the local executor's real log file) without trusting them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from visionloop.sched.executors.local import LocalExecutor
from visionloop.sched.progress import CheckpointEvent, EvalEvent, PaceEvent, ProgressReader, parse_line
from visionloop.train import progress
from visionloop.train.progress import MAX_LINE_BYTES, PREFIX

P = PREFIX.encode()


def _line(doc: object) -> bytes:
    return P + json.dumps(doc).encode()


def test_the_trainers_lines_parse_back_into_events(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(progress.ENV, raising=False)
    progress.checkpoint(10)
    progress.evaluation(10, 1.0, {"accuracy": 0.5})
    assert capsys.readouterr().out == ""  # only when the control plane asks for it
    monkeypatch.setenv(progress.ENV, "1")
    progress.checkpoint(200)
    metrics = {"accuracy": 0.91, "loss": float("nan"), "per_class/cat": 0.8, "top5": True, "f1": 0.5}
    progress.evaluation(200, 2.5, metrics)
    lines = capsys.readouterr().out.encode().splitlines()
    assert len(lines) == 2
    ckpt, ev = (parse_line(x) for x in lines)
    assert isinstance(ckpt, CheckpointEvent) and ckpt.step == 200 and ckpt.at > 1.7e9
    # Only finite scalars with plain names go out.
    assert ev == EvalEvent(200, 2.5, {"accuracy": 0.91, "f1": 0.5})


def test_an_eval_line_with_many_metrics_is_cut_to_fit(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(progress.ENV, "1")
    progress.evaluation(7, 1.0, {f"{i:02d}" + "m" * 60: 0.123456789 + i for i in range(100)})
    (line,) = capsys.readouterr().out.encode().splitlines()
    assert len(line) <= MAX_LINE_BYTES
    event = parse_line(line)
    assert isinstance(event, EvalEvent) and 0 < len(event.metrics) <= progress.MAX_METRICS


@pytest.mark.parametrize(
    "line",
    [
        _line({"event": "checkpoint", "step": 1, "at": 1.0, "pad": "x" * MAX_LINE_BYTES}),  # too long
        P + b'{"event": "checkpoint", "step": 1, "at": 1.0',  # cut short
        P + b"not json",
        P + b"[" * 5000 + b"]" * 5000,  # nesting past the parser's recursion limit
        P + b'{"event": "checkpoint", "step": 1, "at": 1.0, "x": "\xff\xfe"}',  # not UTF-8
        _line(["checkpoint", 1]),
        _line({"event": "checkpoint", "step": "200", "at": 1.0}),
        _line({"event": "checkpoint", "step": True, "at": 1.0}),
        _line({"event": "checkpoint", "step": 1.5, "at": 1.0}),
        _line({"event": "checkpoint", "step": -1, "at": 1.0}),
        _line({"event": "checkpoint", "step": 2**31, "at": 1.0}),
        _line({"event": "checkpoint", "step": 1}),
        _line({"event": "checkpoint", "step": 1, "at": "now"}),
        P + b'{"event": "checkpoint", "step": 1, "at": NaN}',
        _line({"event": "eval", "step": 1, "epoch": 1, "metrics": {"a": "high"}}),
        _line({"event": "eval", "step": 1, "epoch": 1, "metrics": [1]}),
        _line({"event": "eval", "step": 1, "epoch": 1, "metrics": {str(i): 1 for i in range(33)}}),
        _line({"event": "pace", "step": 10, "total": 5, "rate": 1.0, "at": 1.0}),  # past its total
        _line({"event": "pace", "step": 0, "total": 0, "rate": 1.0, "at": 1.0}),
        _line({"event": "pace", "step": 1, "total": 9, "rate": 0, "at": 1.0}),
        _line({"event": "pace", "step": 1, "total": 9, "rate": -2.0, "at": 1.0}),
        _line({"event": "pace", "step": 1, "total": 9, "rate": 1e7, "at": 1.0}),  # no training step
        _line({"event": "pace", "step": 1, "total": 9, "rate": True, "at": 1.0}),
        _line({"event": "pace", "step": 1, "total": 9.5, "rate": 1.0, "at": 1.0}),
        _line({"event": "pace", "step": 1, "total": 2**31, "rate": 1.0, "at": 1.0}),
        _line({"event": "pace", "step": 1, "total": 9, "rate": 1.0}),
        P + b'{"event": "pace", "step": 1, "total": 9, "rate": Infinity, "at": 1.0}',
        _line({"event": "delete_job", "step": 1, "job": 7}),
        _line({"step": 1, "at": 1.0}),
        b"say " + _line({"event": "checkpoint", "step": 1, "at": 1.0}),  # not at the line's start
        b'@@visionloop-progres {"event": "checkpoint", "step": 1, "at": 1.0}',
    ],
)
def test_hostile_or_malformed_lines_are_ignored(line: bytes) -> None:
    assert parse_line(line) is None


def test_a_valid_line_from_a_foreign_hand_parses(tmp_path: Path) -> None:
    assert parse_line(_line({"event": "checkpoint", "step": 3, "at": 5})) == CheckpointEvent(3, 5.0)
    assert parse_line(_line({"event": "eval", "step": 3, "epoch": 1, "metrics": {}})) == EvalEvent(3, 1.0, {})
    pace = {"event": "pace", "step": 9, "total": 9, "rate": 2, "at": 5}
    assert parse_line(_line(pace)) == PaceEvent(9, 9, 2.0, 5.0)


def test_the_pace_is_told_at_most_every_interval_from_the_attempts_first_step(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr("visionloop.train.progress.time.monotonic", lambda: clock[0])
    monkeypatch.setenv(progress.ENV, "1")
    monkeypatch.setenv(progress.PACE_ENV, "30")
    pace = progress.Pace()
    assert pace.every_s == 30.0
    pace.tick(100, 1000)  # the first step of a resumed attempt: the rate counts from here
    for step in range(101, 130):  # 29 steps in 29 s: nothing due yet
        clock[0] += 1.0
        pace.tick(step, 1000)
    assert capsys.readouterr().out == ""
    clock[0] += 1.0
    pace.tick(130, 1000)  # 30 steps in 30 s
    clock[0] += 10.0
    pace.tick(135, 1000)  # 10 s later: not due again
    clock[0] += 20.0
    pace.tick(160, 1000)  # 60 steps in 60 s since the first
    events = [parse_line(x) for x in capsys.readouterr().out.encode().splitlines()]
    assert [(e.step, e.total, e.rate) for e in events if isinstance(e, PaceEvent)] == [
        (130, 1000, 1.0),
        (160, 1000, 1.0),
    ]
    assert len(events) == 2
    monkeypatch.delenv(progress.ENV)
    clock[0] += 100.0
    pace.tick(200, 1000)
    assert capsys.readouterr().out == ""  # only when the control plane asks for it
    monkeypatch.setenv(progress.PACE_ENV, "soon")
    assert progress.Pace().every_s == progress.PACE_EVERY_S  # a bad value: the default


def test_expected_end_is_the_reported_pace_carried_forward_for_this_attempt_only() -> None:
    from visionloop.sched.records import Job
    from visionloop.sched.states import JobState

    base = dict.fromkeys(f.name for f in dataclasses.fields(Job) if f.default is dataclasses.MISSING)
    job = Job(**{**base, "state": JobState.RUNNING, "state_since": 1000.0})  # type: ignore[arg-type]
    assert job.expected_end(now=1010.0) is None  # nothing reported yet
    paced = dataclasses.replace(job, pace_step=200, pace_total=1000, pace_rate=4.0, pace_at=1050.0)
    assert paced.expected_end(now=1060.0) == 1050.0 + 800 / 4.0
    assert paced.expected_end(now=2000.0) == 2000.0  # overdue: never in the past
    requeued = dataclasses.replace(paced, state_since=1100.0)  # a new attempt, no pace of its own yet
    assert requeued.expected_end(now=1110.0) is None
    assert dataclasses.replace(paced, state=JobState.QUEUED).expected_end(now=1060.0) is None


def _ckpt(step: int) -> bytes:
    return _line({"event": "checkpoint", "step": step, "at": 100.0 + step}) + b"\n"


def test_the_reader_reads_only_new_complete_lines_of_the_attempts_log(tmp_path: Path) -> None:
    attempt_dir = tmp_path / "attempt-1"
    attempt_dir.mkdir()
    log = attempt_dir / "log"
    ex, handle, key = LocalExecutor(inventory=[]), {"attempt_dir": str(attempt_dir)}, (1, 1)
    reader = ProgressReader()
    assert reader.read(ex, handle, key, now=0.0) == []  # no log yet
    log.write_bytes(b"starting\n" + _ckpt(10) + _ckpt(20)[:15])  # the last line is unfinished
    assert reader.read(ex, handle, key, now=0.0) == [CheckpointEvent(10, 110.0)]
    with log.open("ab") as f:
        f.write(_ckpt(20)[15:] + b"epoch 1 done\n")
    assert reader.read(ex, handle, key, now=0.0) == [CheckpointEvent(20, 120.0)]
    # Only the bytes after the last read are read: what is rewritten before them is not seen.
    size = log.stat().st_size
    with log.open("r+b") as f:
        f.write(_ckpt(99)[:-1] + b"\n")
    assert log.stat().st_size == size
    assert reader.read(ex, handle, key, now=0.0) == []
    with log.open("ab") as f:
        f.write(_ckpt(30))
    assert reader.read(ex, handle, key, now=0.0) == [CheckpointEvent(30, 130.0)]
    # A restarted control plane (a new reader) reads from the start: the caller deduplicates.
    assert [e.step for e in ProgressReader().read(ex, handle, key, now=0.0)] == [99, 20, 30]


def test_an_endless_line_is_skipped_whole_and_a_flood_is_read_from_its_newest_part(tmp_path: Path) -> None:
    attempt_dir = tmp_path / "attempt-1"
    attempt_dir.mkdir()
    log = attempt_dir / "log"
    ex, handle, key = LocalExecutor(inventory=[]), {"attempt_dir": str(attempt_dir)}, (1, 1)
    reader = ProgressReader(max_read_bytes=64 * 1024)
    # A progress-looking line that never ends, written a piece at a time.
    log.write_bytes(_ckpt(1)[:-3] + b"9" * MAX_LINE_BYTES)
    assert reader.read(ex, handle, key, now=0.0) == []
    with log.open("ab") as f:
        f.write(b"9" * 100 + b"}\n" + _ckpt(2))
    assert reader.read(ex, handle, key, now=0.0) == [CheckpointEvent(2, 102.0)]
    # Far more than one read's worth since the last look: only the newest part is read.
    with log.open("ab") as f:
        f.write(_ckpt(3) + b"noise " * 100_000 + b"\n" + _ckpt(4))
    assert reader.read(ex, handle, key, now=0.0) == [CheckpointEvent(4, 104.0)]
    reader.forget_except(set())
    assert reader._cursors == {}
