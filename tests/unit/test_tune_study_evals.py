"""The evaluations file the control plane keeps per job, which the tuner reads: appended
whole, a line torn by a crash skipped without swallowing the next one, duplicates kept in
order (readers keep the first of a step)."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

from visionloop.sched.progress import EvalEvent
from visionloop.sched.service_reconcile import append_evals, read_evals


def test_appended_evaluations_read_back_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "job-1" / "evals.jsonl"
    assert list(read_evals(path)) == []
    append_evals(path, 1, [EvalEvent(10, 1.0, {"accuracy": 0.5}), EvalEvent(20, 2.0, {"accuracy": 0.7})])
    with path.open("ab") as f:
        f.write(b'{"attempt":1,"step":30,"epo')  # a crash mid-write
    append_evals(path, 2, [EvalEvent(30, 3.0, {"accuracy": 0.8, "loss": 0.1})])
    assert list(read_evals(path)) == [
        EvalEvent(10, 1.0, {"accuracy": 0.5}),
        EvalEvent(20, 2.0, {"accuracy": 0.7}),
        EvalEvent(30, 3.0, {"accuracy": 0.8, "loss": 0.1}),
    ]


def test_a_long_or_undecodable_line_is_skipped_without_being_held(tmp_path: Path) -> None:
    path = tmp_path / "job-1" / "evals.jsonl"
    append_evals(path, 1, [EvalEvent(10, 1.0, {"accuracy": 0.5})])
    with path.open("ab") as f:
        # A crash's NULs: one line, skipped a block at a time (under MAX_EVALS_BYTES, past which
        # append_evals stops appending).
        f.write(b"\0" * (3 << 20) + b"\n")
        f.write(b'{"attempt":1,"step":15,"epoch":1.5,"metrics":{"accuracy":0.6}}\xff\n')
    append_evals(path, 1, [EvalEvent(20, 2.0, {"accuracy": 0.7})])
    tracemalloc.start()
    try:
        got = list(read_evals(path))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == [EvalEvent(10, 1.0, {"accuracy": 0.5}), EvalEvent(20, 2.0, {"accuracy": 0.7})]
    assert peak < 2 << 20, f"{peak} bytes held"
