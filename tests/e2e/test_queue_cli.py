"""The queue the way a user drives it: `visionloop up --detach`, `submit`, `jobs ...`,
`admin ...`, `cost report`, `down` — and a control plane SIGKILLed mid-job and restarted."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from _cpkit import FAST, free_port, job_roots
from _trainkit import cli, spec_doc, write_spec

CLUSTER_TOML = """
[scheduler]
{timings}

[jobs]
allowed_roots = {roots}
env_allow = ["VISIONLOOP_PACE_EVERY_S"]

[[teams]]
name = "vision"
nominal_gpus = 2
borrow_limit = 1

[[inventory]]
node = "local"
type = "fake"
count = 1
price_class = "owned"

[[inventory]]
node = "spot-a"
type = "fake"
count = 2
price_class = "spot"
"""


def _ok(*args: str) -> str:
    p = cli(*args)
    assert p.returncode == 0, f"visionloop {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
    return p.stdout


def _show(job_id: int) -> dict[str, Any]:
    return dict(json.loads(_ok("jobs", "show", str(job_id), "--json")))


def _wait(job_id: int, pred: Any, timeout: float = 240) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    show: dict[str, Any] = {}
    while time.monotonic() < deadline:
        show = _show(job_id)
        if pred(show["job"]):
            return show
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} never got there; last seen:\n{json.dumps(show, indent=1)[:4000]}")


@pytest.fixture
def up(vl_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    # Jobs tell their pace every second instead of every 30 (passed on through env_allow above).
    monkeypatch.setenv("VISIONLOOP_PACE_EVERY_S", "1")
    timings = "\n".join(f"{k} = {v}" for k, v in FAST.items())
    (vl_home / "cluster.toml").write_text(CLUSTER_TOML.format(timings=timings, roots=json.dumps(job_roots())))
    port = str(free_port())
    _ok("up", "--detach", "--port", port)
    yield port
    cli("down")
    # Jobs outlive the control plane by design; the test must not leave any behind.
    for state in (vl_home / "jobs").glob("job-*/attempt-*/shim.json"):
        with contextlib.suppress(ProcessLookupError, KeyError, ValueError, PermissionError):
            os.killpg(json.loads(state.read_text())["child_pid"], signal.SIGKILL)


def test_submit_follow_spot_interrupt_and_cost_from_the_cli(
    up: str, tmp_path: Path, digits_dataset: Path
) -> None:
    doc = spec_doc(digits_dataset, epochs=None, steps=300, tracking__enabled=False)
    spec = write_spec(
        tmp_path / "job.yaml", {"train": doc, "team": "vision", "spot": "preferred", "name": "digits"}
    )
    job_id = int(_ok("submit", str(spec)).strip())
    follower = subprocess.Popen(
        [sys.executable, "-m", "visionloop", "jobs", "logs", str(job_id), "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    show = _wait(
        job_id,
        lambda j: j["state"] == "running" and j["last_checkpoint_at"] is not None and j["expected_end"],
    )
    (alloc,) = show["attempts"][0]["allocations"]
    assert alloc["price_class"] == "spot"  # `preferred` takes spot first
    # Its pace, as the trainer reported it: step of total, and the end that follows from it.
    j = show["job"]
    assert j["pace_total"] == 300 and 0 < j["pace_step"] <= 300 and j["pace_rate"] > 0
    assert j["expected_end"] == pytest.approx(j["pace_at"] + (300 - j["pace_step"]) / j["pace_rate"], abs=1)
    listed = _ok("jobs", "list")
    assert "digits" in listed and "running" in listed and "of 300 at" in listed
    human = _ok("jobs", "show", str(job_id))
    assert "progress: step" in human and "expected end" in human, human

    p = cli("admin", "spot-interrupt", "spot-a")
    assert p.returncode == 0 and str(job_id) in p.stderr
    show = _wait(job_id, lambda j: j["state"] in ("succeeded", "failed"), timeout=300)
    assert show["job"]["state"] == "succeeded"
    first, second = show["attempts"]
    assert first["outcome"] == "interrupted" and first["exit_code"] == 75
    # With spot gone, `preferred` falls back to the owned GPU.
    assert [a["price_class"] for a in second["allocations"]] == ["owned"]
    gpus = _ok("admin", "gpus")
    assert "spot interruption" in gpus

    # The follower saw both attempts and stopped by itself when the job ended.
    followed, follow_err = follower.communicate(timeout=60)
    assert follower.returncode == 0, follow_err
    first_part, _, second_part = followed.decode().partition("--- attempt 2 ---")
    assert "resuming from" not in first_part and "resuming from" in second_part

    assert show["job"]["expected_end"] is None  # over
    assert show["job"]["pace_at"] >= second["started_at"]  # the resumed attempt told its own
    human = _ok("jobs", "show", str(job_id))
    assert "interrupted" in human and "spot saved" in human and "progress:" not in human
    report = json.loads(_ok("cost", "report", "--json"))
    line = report["by_team"]["vision"]
    assert line["gpu_hours"] > 0 and line["spot_gpu_hours"] > 0 and line["spot_saved"] > 0
    assert 0 < line["lost_gpu_hours_interruption"] <= first_hours(first)
    assert "step" in _ok("jobs", "logs", str(job_id), "--attempt", "1").lower()


def _wait_gone(pid: int, timeout: float = 60) -> None:
    """Until `pid` has exited: gone, or a zombie (dead, its resources freed, not yet reaped by
    whoever adopted it), with a bounded deadline instead of a guess at how long a kill takes."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        assert time.monotonic() < deadline, f"process {pid} still alive {timeout:.0f} s after SIGKILL"
        time.sleep(0.05)


def first_hours(attempt: dict[str, Any]) -> float:
    return float(attempt["ended_at"] - attempt["started_at"]) / 3600


def _as_shown(job_id: int, shows: Callable[[str, str], bool], *command: str) -> tuple[str, str]:
    """`visionloop <command>`'s output and the job's waiting reason as stored while it ran,
    once the output `shows` that reason. The estimate moves with the running job's pace, and
    can cross a minute and come back between two reads (a CI run saw 06:44, 06:43, 06:44), so
    equal reads before and after are not enough: retried, up to 20 times."""
    out, before = "", ""
    for _ in range(20):
        before = _show(job_id)["job"]["waiting_reason"]
        out = _ok(*command)
        if _show(job_id)["job"]["waiting_reason"] == before and shows(out, before):
            return out, before
    return out, before  # the caller's assertion says what differs


def test_a_waiting_job_is_told_its_expected_start_from_the_running_jobs_pace(
    up: str, vl_home: Path, tmp_path: Path, digits_dataset: Path
) -> None:
    """Like `squeue --start`: the first job that waits for GPUs gets the time the running
    job's reported pace frees them, first in its reason, in `jobs list` and `jobs show`."""
    long_run = spec_doc(digits_dataset, epochs=None, steps=100_000, tracking__enabled=False)
    spec = write_spec(tmp_path / "long.yaml", {"train": long_run, "team": "vision", "name": "long"})
    first = int(_ok("submit", str(spec), "--spot", "preferred").strip())
    _wait(first, lambda j: j["state"] == "running" and j["expected_end"])
    # 2 GPUs on one node: only spot-a has 2, and the first job holds one of them.
    second = int(_ok("submit", str(spec), "--spot", "preferred", "--gpus", "2").strip())

    def agrees(j: dict[str, Any]) -> bool:
        """The reason's start is the running job's expected end rounded up to the minute
        (give or take five: its pace, noisy as the run starts, moves between the reads)."""
        reason = j["waiting_reason"] or ""
        end = _show(first)["job"]["expected_end"]
        starts = {
            time.strftime("%H:%M:%S UTC", time.gmtime(math.ceil((end + d) / 60) * 60))
            for d in range(-300, 301, 60)
        }
        return (
            reason.startswith("expected start ") and reason[len("expected start ") :].split(";")[0] in starts
        )

    show = _wait(second, agrees, timeout=120)
    reason = show["job"]["waiting_reason"]
    said = reason[len("expected start ") :].split(";")[0]
    assert reason == (
        f"expected start {said}; waiting for 2 GPUs: 2 free; no single node has 2 free; "
        f"2 GPUs reserved for it as job {first} end"
    )

    # What the user reads: the stored reason, its start first (`jobs list` cuts it at 100
    # characters), the same in both commands.
    def listed_as_stored(out: str, stored: str) -> bool:
        return any(f"│ {stored[:100]}" in line for line in out.splitlines() if "queued" in line)

    listed, stored = _as_shown(second, listed_as_stored, "jobs", "list")
    rows = [line for line in listed.splitlines() if "queued" in line]
    assert stored.startswith("expected start ") and len(rows) == 1 and f"│ {stored[:100]}" in rows[0], rows
    shown, stored = _as_shown(
        second, lambda out, stored: f"\nwaiting: {stored}\n" in out, "jobs", "show", str(second)
    )
    assert f"\nwaiting: {stored}\n" in shown, shown

    # SIGKILL the control plane and blank the stored reason while it is down: the restarted
    # one derives the reservation again from what is stored (the running job's attempt and
    # pace), not from the reason it wrote before.
    state = json.loads((vl_home / "control-plane.json").read_text())
    os.kill(state["pid"], signal.SIGKILL)
    _wait_gone(state["pid"])
    with contextlib.closing(sqlite3.connect(vl_home / "state.db")) as db, db:
        db.execute("UPDATE jobs SET waiting_reason = 'stale' WHERE id = ?", (second,))
        assert db.execute("SELECT waiting_reason FROM jobs WHERE id = ?", (second,)).fetchall() == [
            ("stale",)
        ]
    _ok("up", "--detach", "--port", up)
    _wait(second, agrees, timeout=120)
    for job in (second, first):
        _ok("jobs", "cancel", str(job))
    _wait(first, lambda j: j["state"] == "cancelled", timeout=120)


def test_control_plane_sigkilled_mid_job_readopts_it(
    up: str, vl_home: Path, tmp_path: Path, digits_dataset: Path
) -> None:
    spec = write_spec(
        tmp_path / "train.yaml", spec_doc(digits_dataset, epochs=None, steps=150, tracking__enabled=False)
    )
    job_id = int(_ok("submit", str(spec), "--team", "vision", "--spot", "never").strip())
    _wait(job_id, lambda j: j["state"] == "running")
    state = json.loads((vl_home / "control-plane.json").read_text())
    os.kill(state["pid"], signal.SIGKILL)
    _wait_gone(state["pid"])  # its port and locks are free before the restart binds them
    _ok("up", "--detach", "--port", up)  # same home, same store: it must find the running job
    show = _wait(job_id, lambda j: j["state"] in ("succeeded", "failed"), timeout=300)
    assert show["job"]["state"] == "succeeded"
    # Re-adopted, not restarted: one attempt, never requeued.
    assert len(show["attempts"]) == 1 and show["attempts"][0]["outcome"] == "succeeded"
    assert [t["to_state"] for t in show["transitions"]] == ["queued", "running", "succeeded"]


def test_cli_errors_are_one_clear_line(up: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2]\n")
    p = cli("submit", str(bad))
    assert p.returncode != 0 and "Traceback" not in p.stderr and "train" in p.stderr
    p = cli("jobs", "show", "424242")
    assert p.returncode != 0 and "no job 424242" in p.stderr
    p = cli("submit", str(tmp_path / "missing.yaml"))
    assert p.returncode != 0 and "does not exist" in p.stderr
    p = cli("jobs", "list", env={"VISIONLOOP_TOKEN": "wrong"})
    assert p.returncode != 0 and "unknown or revoked token" in p.stderr
