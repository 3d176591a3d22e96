"""The CLI's shared Rich consoles: results to stdout, progress and diagnostics to stderr."""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console

# soft_wrap: a path broken across lines can be neither copied nor grepped.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False)

_PIPE_WIDTH = 240


def print_wide(renderable: Any) -> None:
    """Print a wide table to stdout. Piped output (a file, a test) gets wide lines instead of
    Rich's 80 columns, so the table is not folded into unreadable slivers (Console.print's
    own `width` can only narrow). COLUMNS, when set, still wins."""
    if out.is_terminal or "COLUMNS" in os.environ:
        out.print(renderable)
    else:
        Console(highlight=False, soft_wrap=False, width=_PIPE_WIDTH).print(renderable)
