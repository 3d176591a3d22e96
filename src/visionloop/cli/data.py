"""`visionloop data ...`: build and inspect datasets."""

from __future__ import annotations

import typer

app = typer.Typer(help="Build datasets from labelled images and inspect them.", no_args_is_help=True)
