"""`visionloop tune` as a user runs it, for what needs no control plane."""

from __future__ import annotations

from pathlib import Path

from _trainkit import cli

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tune" / "digits-lr.yaml"


def test_a_budget_is_accepted_and_no_study_is_made_without_a_control_plane(
    tmp_path: Path, vl_home: Path
) -> None:
    text = EXAMPLE.read_text().replace("# budget: {gpu_hours: 2, usd: 5}", "budget: {gpu_hours: 2, usd: 5}")
    assert "\nbudget:" in text  # the example still carries the commented-out line
    spec = tmp_path / "tune.yaml"
    spec.write_text(text)
    r = cli("tune", "run", str(spec), "--db", f"sqlite:///{tmp_path / 'state.db'}")
    assert r.returncode == 1, r.stdout + r.stderr
    message = " ".join(r.stderr.split())
    assert "no control plane known" in message and "visionloop up --detach" in message
    assert "budget" not in message  # the budget itself is fine
    assert not (tmp_path / "state.db").exists()  # refused before any study was made


def test_tune_help_explains_itself() -> None:
    r = cli("tune", "run", "--help")
    assert r.returncode == 0
    assert "exactly `trials` finished" in " ".join(r.stdout.split())


def test_tune_run_waits_for_a_control_plane_that_does_not_answer(tmp_path: Path, vl_home: Path) -> None:
    import os
    import subprocess
    import sys
    import time

    from _cpkit import free_port

    spec = tmp_path / "tune.yaml"
    spec.write_text(EXAMPLE.read_text())
    log = tmp_path / "tune.log"
    env = {**os.environ, "VISIONLOOP_API_URL": f"http://127.0.0.1:{free_port()}", "VISIONLOOP_TOKEN": "t"}
    cmd = [
        sys.executable,
        "-m",
        "visionloop",
        "tune",
        "run",
        str(spec),
        "--db",
        f"sqlite:///{tmp_path / 's.db'}",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "Waiting for it" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]  # it must not give up
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(4)  # a few retries later: still waiting, and said so once
        assert proc.poll() is None, log.read_text()[-3000:]
        text = " ".join(log.read_text().split())
        assert text.count("Waiting for it") == 1, text
        assert "cannot reach the control plane" in text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
