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
