"""`visionloop train --until-epoch N`: a tuning trial's stop at a rung.

The trainer stops once N epochs are done and evaluated, writes a checkpoint and exits 76
(EXIT_PAUSED, not 75: nobody asked it to stop); run again with a later N, or none, it goes
on from that checkpoint. Paused twice and continued, a run ends bitwise identical to one
never paused (the learning-rate schedule is always the whole run's), and each evaluation is
in MLflow once.
"""

from __future__ import annotations

import json
from pathlib import Path

from test_train_resume import assert_bitwise_equal, metric_steps, weights

from _trainkit import cli, spec_doc, write_spec
from visionloop.train.signals import EXIT_PAUSED


def _train(spec: Path, run_dir: Path, *extra: str) -> tuple[int, str]:
    p = cli("train", str(spec), "--run-dir", str(run_dir), *extra, timeout=300)
    return p.returncode, p.stdout + p.stderr


def test_paused_at_each_rung_then_continued_matches_an_unpaused_run(
    tmp_path: Path, digits_dataset: Path
) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_doc(digits_dataset, epochs=3))
    code, out = _train(spec, tmp_path / "reference")
    assert code == 0, out

    run = tmp_path / "trial"
    code, out = _train(spec, run, "--until-epoch", "1")
    assert code == EXIT_PAUSED, out
    meta = json.loads((run / "run.json").read_text())
    assert meta["status"] == "paused"
    steps_per_epoch = meta["step"]
    assert steps_per_epoch > 0
    assert not (run / "final.safetensors").exists()
    assert "paused at step" in out

    # Asked again for the same rung: it is already there, so it pauses at once, unchanged.
    code, out = _train(spec, run, "--until-epoch", "1")
    assert code == EXIT_PAUSED, out
    assert json.loads((run / "run.json").read_text())["step"] == steps_per_epoch

    code, out = _train(spec, run, "--until-epoch", "2")
    assert code == EXIT_PAUSED, out
    assert json.loads((run / "run.json").read_text())["step"] == 2 * steps_per_epoch

    code, out = _train(spec, run)
    assert code == 0, out
    assert json.loads((run / "run.json").read_text())["status"] == "succeeded"
    assert_bitwise_equal(weights(tmp_path / "reference"), weights(run))
    # One evaluation per epoch, each recorded once although the run was started four times.
    assert metric_steps(run, "val/accuracy") == [steps_per_epoch * k for k in (1, 2, 3)]


def test_until_epoch_at_or_past_the_end_finishes_normally(tmp_path: Path, digits_dataset: Path) -> None:
    spec = write_spec(tmp_path / "spec.yaml", spec_doc(digits_dataset, epochs=1))
    code, out = _train(spec, tmp_path / "run", "--until-epoch", "1")
    assert code == 0, out
    assert (tmp_path / "run" / "final.safetensors").is_file()
