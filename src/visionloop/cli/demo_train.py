"""The training step every demo shares: write its spec, train with live progress, and on a
stop (Ctrl-C, SIGTERM) print how to resume instead of going on with a half-trained model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from visionloop.cli.console import err, out

if TYPE_CHECKING:
    from visionloop.core.settings import Settings
    from visionloop.train.report import TrainResult


def train_demo_spec(settings: Settings, spec_path: Path, spec_text: str, run_dir: Path) -> TrainResult:
    """Write `spec_text` to `spec_path` (so the user can rerun it) and train it into `run_dir`.
    Exits with the trainer's code, after printing the resume command, if training stopped early."""
    from visionloop.cli.progress import RichReporter
    from visionloop.specs import load_train_spec
    from visionloop.train.api import train

    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(spec_text)
    spec, _ = load_train_spec(spec_path)
    with RichReporter(err) as reporter:
        result = train(
            spec,
            run_dir,
            spec_text=spec_text,
            resolved=spec.model_dump(mode="json"),
            settings=settings,
            reporter=reporter,
        )
    if result.exit_code != 0:
        out.print(f"[yellow]the demo's training was stopped at step {result.step}; resume it with:[/]")
        out.print(
            f"  VISIONLOOP_HOME={settings.home} visionloop train {spec_path} --run-dir {run_dir}",
            soft_wrap=True,
        )
        raise typer.Exit(result.exit_code)
    return result
