"""Entry point of the `visionloop` command.

Heavy imports (torch, mlflow, litdata) happen inside the commands, so `--help` stays instant.
Errors raised on purpose (`VisionloopError`) are printed as one message without a traceback.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys

import typer
from rich.markup import escape

from visionloop.cli import alerts as alerts_cli
from visionloop.cli import archs as archs_cli
from visionloop.cli import bench as bench_cli
from visionloop.cli import data as data_cli
from visionloop.cli import data_add as _data_add  # noqa: F401  (registers `data add` on data_cli.app)
from visionloop.cli import demo as demo_cli
from visionloop.cli import evaluate as eval_cli
from visionloop.cli import export as export_cli
from visionloop.cli import label as label_cli
from visionloop.cli import loop as loop_cli
from visionloop.cli import models as models_cli
from visionloop.cli import monitor as monitor_cli
from visionloop.cli import queue as queue_cli
from visionloop.cli import queue_admin
from visionloop.cli import runs as runs_cli
from visionloop.cli import serve as serve_cli
from visionloop.cli import size as size_cli
from visionloop.cli import train as train_cli
from visionloop.cli import tune as tune_cli
from visionloop.cli.console import err
from visionloop.core.errors import VisionloopError

app = typer.Typer(
    name="visionloop",
    help=(
        "visionloop: labelled images in; a trained, tracked, optimized and served model out.\n\n"
        "Start with `visionloop demo`. Share GPUs between jobs with `visionloop up`, `submit` and "
        "`jobs`; take a run to an endpoint with `models register`, `export`, `bench` and `serve`; "
        "find how a model fails with `eval`. "
        "State lives under $VISIONLOOP_HOME (default ~/.visionloop)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(data_cli.app, name="data")
app.add_typer(runs_cli.app, name="runs")
app.command("train", context_settings={"help_option_names": ["-h", "--help"]})(train_cli.train)
app.command("demo", context_settings={"help_option_names": ["-h", "--help"]})(demo_cli.demo)
app.command("archs", context_settings={"help_option_names": ["-h", "--help"]})(archs_cli.archs)
for _name, _fn in (("up", queue_cli.up), ("down", queue_cli.down), ("submit", queue_cli.submit)):
    app.command(_name, context_settings={"help_option_names": ["-h", "--help"]})(_fn)
app.add_typer(queue_cli.jobs_app, name="jobs")
app.add_typer(queue_admin.admin_app, name="admin")
app.add_typer(queue_admin.cost_app, name="cost")
app.add_typer(models_cli.app, name="models")
app.add_typer(alerts_cli.app, name="alerts")
app.add_typer(label_cli.app, name="label")
app.add_typer(loop_cli.app, name="loop")
app.add_typer(tune_cli.app, name="tune")
app.add_typer(size_cli.app, name="size")
app.command("export", context_settings={"help_option_names": ["-h", "--help"]})(export_cli.export)
app.command("bench", context_settings={"help_option_names": ["-h", "--help"]})(bench_cli.bench)
app.command("eval", context_settings={"help_option_names": ["-h", "--help"]})(eval_cli.evaluate)
app.command("monitor", context_settings={"help_option_names": ["-h", "--help"]})(monitor_cli.monitor)
app.command("serve", cls=serve_cli.ServeCommand, context_settings={"help_option_names": ["-h", "--help"]})(
    serve_cli.serve
)


@app.callback()
def _root(
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Show debug logs and full tracebacks."),
) -> None:
    level = logging.DEBUG if verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    # visionloop's own loggers run at INFO so that train.log gets everything; the terminal
    # shows only warnings and errors (unless --verbose), the rest is rendered by Rich.
    for handler in logging.getLogger().handlers:
        handler.setLevel(level)
    if verbose:
        os.environ["VISIONLOOP_TRACEBACK"] = "1"
    # MLflow and litdata log routine progress at INFO (database migrations, cache dirs);
    # it buries what visionloop prints, so they speak only when something is wrong.
    for name in ("mlflow", "alembic", "litdata"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbose else logging.WARNING)


def _unwrap(text: str | None) -> str | None:
    """A docstring with its source line breaks joined within each paragraph: Typer's Rich help
    keeps them, which breaks sentences mid-line at whatever width the terminal has. Paragraphs
    with indented lines or list items keep their lines (examples, formats)."""
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    kept = []
    for para in paragraphs:
        lines = para.split("\n")
        if any(line.startswith((" ", "\t", "- ", "* ", "\b")) for line in lines):
            kept.append(para)
        else:
            kept.append(" ".join(line.strip() for line in lines))
    return "\n\n".join(kept)


def _unwrap_help(group: typer.Typer) -> None:
    """Unwrap every command's docstring (and each group's help) before Typer reads them."""
    for command in group.registered_commands:
        if command.callback is not None:
            command.callback.__doc__ = _unwrap(command.callback.__doc__)
        command.help = _unwrap(command.help) if isinstance(command.help, str) else command.help
    for sub in group.registered_groups:
        sub.help = _unwrap(sub.help) if isinstance(sub.help, str) else sub.help
        if sub.typer_instance is not None:
            info = sub.typer_instance.info
            info.help = _unwrap(info.help) if isinstance(info.help, str) else info.help
            _unwrap_help(sub.typer_instance)


def main() -> None:
    _unwrap_help(app)
    try:
        app()
    except VisionloopError as e:
        if os.environ.get("VISIONLOOP_TRACEBACK"):
            raise
        # Escaped: messages quote TOML and YAML ("[executor] kind = ...", "[1e-4, 0.1]"), which
        # Rich would otherwise read as markup and drop.
        err.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
        sys.exit(e.exit_code)
    except OSError as e:
        # Disk full, permissions, a path that is a file: the message says what and where; the
        # traceback would only bury it (and -v shows it).
        if os.environ.get("VISIONLOOP_TRACEBACK"):
            raise
        err.print(
            f"[bold red]error:[/] {escape(str(e))}. Run with -v for the full traceback.", soft_wrap=True
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
