"""`visionloop runs ...`: list and show runs from the tracking store."""

from __future__ import annotations

import typer

app = typer.Typer(help="List and inspect training runs recorded in the tracking store.", no_args_is_help=True)
