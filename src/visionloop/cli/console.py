"""The CLI's shared Rich consoles: results to stdout, progress and diagnostics to stderr."""

from __future__ import annotations

from rich.console import Console

# soft_wrap: a path broken across lines can be neither copied nor grepped.
out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False)
