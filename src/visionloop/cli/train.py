"""`visionloop train SPEC.yaml`: train, or resume, a model from a spec."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
from pathlib import Path

import typer

from visionloop.cli.console import err, out
from visionloop.core.errors import TrainingError
from visionloop.train.signals import EXIT_PAUSED, EXIT_PREEMPTED


def train(
    spec: Path = typer.Argument(..., help="The YAML train spec (see README for every field)."),
    run_dir: Path | None = typer.Option(
        None,
        "--run-dir",
        help="Where checkpoints, logs and the final model go. Rerunning on the same directory resumes it. "
        "Default: $VISIONLOOP_HOME/runs/<spec name>-<spec hash>.",
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="Override a spec field, e.g. --set optimizer.lr=0.01 --set epochs=20 (repeatable)."
    ),
    nproc_per_node: int = typer.Option(
        1,
        "--nproc-per-node",
        min=1,
        help="Run N DDP processes on this machine (gloo on CPU, NCCL on GPU); data.batch_size stays "
        "the global batch. Under torchrun, leave this out.",
    ),
    no_track: bool = typer.Option(False, "--no-track", help="Do not record the run in MLflow."),
    until_epoch: int | None = typer.Option(
        None,
        "--until-epoch",
        min=1,
        help="Stop after this many epochs are done and evaluated, with a checkpoint, and exit 76; "
        "rerun with a later --until-epoch (or none) to go on. What a tuning trial does at a rung.",
    ),
) -> None:
    """Train a model from SPEC, or resume it from its latest valid checkpoint.

    SIGTERM, SIGUSR1 or Ctrl-C: finish the current step, write a checkpoint, exit with code 75.

    Running the same command again resumes exactly where it stopped.

    Exit codes: 0 done, 75 stopped and resumable, 76 paused at --until-epoch (resumable),
    anything else failed.
    """
    from visionloop.train.signals import StopRequest

    stop = StopRequest().install() if nproc_per_node == 1 else None
    from visionloop.core.settings import load_settings
    from visionloop.spec_files import read_spec_text
    from visionloop.specs import load_train_spec
    from visionloop.train.rundir import spec_fingerprint

    settings = load_settings()
    spec_text = read_spec_text(spec)
    model, _ = load_train_spec(spec, overrides)
    resolved = model.model_dump(mode="json")
    if run_dir is None:
        run_dir = settings.runs_dir / f"{spec.stem}-{spec_fingerprint(resolved)[:8]}"
    run_dir = run_dir.expanduser().resolve()

    if nproc_per_node > 1:
        if os.environ.get("WORLD_SIZE"):
            raise TrainingError(
                "--nproc-per-node cannot be used inside torchrun; the launcher already set WORLD_SIZE."
            )
        # The launcher ignores stop signals as soon as the workers' exits decide the status
        # (as below for one process).
        code = _launch(spec, run_dir, overrides, nproc_per_node, no_track, until_epoch)
        raise typer.Exit(code)

    from visionloop.cli.progress import RichReporter
    from visionloop.train import dist
    from visionloop.train.api import train as run_training
    from visionloop.train.report import Reporter

    # Not RANK alone: one process per node (a job across nodes) has its rank in the node layout.
    is_main = dist.from_env().is_main
    if is_main:
        err.print(f"run dir: {run_dir}")
    reporter = RichReporter(err) if is_main else Reporter()
    with reporter if isinstance(reporter, RichReporter) else contextlib.nullcontext():
        result = run_training(
            model,
            run_dir,
            spec_text=spec_text,
            resolved=resolved,
            settings=settings,
            reporter=reporter,
            track=not no_track,
            stop=stop,
            until_epoch=until_epoch,
        )
    _ignore_stop_signals()
    if is_main:
        extra = [f"--nproc-per-node {os.environ['WORLD_SIZE']}"] if "WORLD_SIZE" in os.environ else []
        _summary(result, spec, overrides, extra + (["--no-track"] if no_track else []))
    if int(os.environ.get("WORLD_SIZE") or 1) > 1:
        _exit_distributed_worker(result.exit_code)
    raise typer.Exit(result.exit_code)


def _ignore_stop_signals() -> None:
    """From here on the run is saved and its exit status decided: a SIGTERM or SIGUSR1 that
    comes while the process winds down (the scheduler preempting a trial that has just paused
    at its rung) has nothing left to stop. Ignored, not left to the handler: the interpreter
    restores the default action for Python handlers during its shutdown, and a late SIGTERM
    then turned a saved run's exit 75 or 76 into 143, which the queue reads as a failure."""
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def _exit_distributed_worker(code: int) -> None:
    """End a rank of a distributed run without the interpreter's and C++ runtime's teardown.

    torch (2.14) keeps gloo's C++ threads running after the process group is destroyed: the
    DDP and FSDP wrappers hold references to it that outlive the model. About one run in 15
    then aborted at exit ("terminate called without an active exception", exit 134) after
    its work was done and saved, and the launcher reported the run as failed. By now train()
    has written its checkpoints and closed its tracked run and the process group; the
    `atexit` handlers still run, then the process exits with its own code."""
    import atexit
    import logging

    atexit._run_exitfuncs()  # what a normal exit runs first (CPython's own hook; multiprocessing uses it)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def resume_command(spec: Path, run_dir: Path, overrides: list[str], flags: list[str] | None = None) -> str:
    sets = "".join(f" --set {shlex.quote(o)}" for o in overrides)
    more = "".join(f" {f}" for f in flags or [])
    return f"visionloop train {shlex.quote(str(spec))} --run-dir {shlex.quote(str(run_dir))}{sets}{more}"


def _summary(result: object, spec: Path, overrides: list[str], flags: list[str]) -> None:
    from visionloop.train.report import TrainResult

    assert isinstance(result, TrainResult)
    if result.exit_code == EXIT_PAUSED:
        out.print(f"[yellow]paused at step {result.step}/{result.total_steps}; checkpoint written.[/]")
        out.print(f"go on with: {resume_command(spec, result.run_dir, overrides, flags)}")
        return
    if result.exit_code == EXIT_PREEMPTED:
        out.print(f"[yellow]stopped at step {result.step}/{result.total_steps}; checkpoint written.[/]")
        out.print(f"resume with: {resume_command(spec, result.run_dir, overrides, flags)}")
        return
    if result.already_finished:
        out.print(f"[green]this run already finished[/] at step {result.step} ({result.run_dir}).")
        out.print("To train again, pass a new --run-dir.")
    else:
        out.print(
            f"[bold green]done[/]: {result.step} steps in {result.train_seconds:.1f} s "
            f"({result.images_per_s:,.0f} img/s)"
        )
    acc = result.final_metrics.get("accuracy")
    if acc is not None:
        out.print(f"  val accuracy   {acc:.2%}")
    out.print(f"  run dir        {result.run_dir}")
    if result.final_weights:
        out.print(f"  final model    {result.final_weights}")
    if result.model_card:
        out.print(f"  model card     {result.model_card}")
    if result.checkpoints:
        out.print(f"  checkpoints    {result.checkpoints[0].parent} ({len(result.checkpoints)} kept)")
    if result.run_id:
        out.print(f"  MLflow run     {result.run_id}")
    if result.ui_command:
        out.print(f"  open the UI    {result.ui_command}")


def _launch(
    spec: Path, run_dir: Path, overrides: list[str], n: int, no_track: bool, until_epoch: int | None
) -> int:
    """Run this same command in n DDP processes (see visionloop.train.launch)."""
    from visionloop.train.launch import launch

    cmd = [sys.executable, "-m", "visionloop", "train", str(spec), "--run-dir", str(run_dir)]
    for o in overrides:
        cmd += ["--set", o]
    if no_track:
        cmd.append("--no-track")
    if until_epoch is not None:
        cmd += ["--until-epoch", str(until_epoch)]
    err.print(f"launching {n} DDP processes on this machine", style="dim")
    return launch(cmd, n, ignore_stop_after=True)
