"""The evaluations file the control plane keeps per job, which the tuner reads: appended
whole, a line torn by a crash skipped without swallowing the next one, duplicates kept in
order (readers keep the first of a step)."""

from __future__ import annotations

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
