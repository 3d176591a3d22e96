"""The CLI's shared Rich consoles: results to stdout, progress and diagnostics to stderr."""

from __future__ import annotations

from rich.console import Console

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)
