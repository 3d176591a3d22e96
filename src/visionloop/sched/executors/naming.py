"""How an executor names what it submits for an attempt, and finds the attempt again from its
folder alone: `{prefix}-job-{job_id}-attempt-{attempt}` (the Ray executor's submission id, the
Slurm executor's job name). A control plane killed between submitting and storing the handle
has only the attempt's folder, `.../job-N/attempt-M`, and rebuilds the name from it."""

from __future__ import annotations

import re
from pathlib import Path

from visionloop.core.errors import ExecutorError

_ATTEMPT_DIR = re.compile(r"job-(\d+)[/\\]attempt-(\d+)[/\\]?$")
# What a name may start with; sched/config.py checks `executor.prefix` with it too.
PREFIX_PATTERN = re.compile(r"[a-z0-9][a-z0-9-]*")


def check_prefix(prefix: str, owner: str) -> str:
    """`prefix`, if it can start a name; ExecutorError naming `owner` (the executor) otherwise."""
    if not PREFIX_PATTERN.fullmatch(prefix):
        raise ExecutorError(
            f"{owner} prefix {prefix!r} is invalid; use lower-case letters, digits and '-', e.g. 'vl'."
        )
    return prefix


def attempt_name(prefix: str, job_id: int, attempt: int) -> str:
    return f"{prefix}-job-{job_id}-attempt-{attempt}"


def attempt_of(attempt_dir: str | Path) -> tuple[int, int] | None:
    """(job id, attempt number) from an attempt folder `.../job-N/attempt-M`; None otherwise."""
    m = _ATTEMPT_DIR.search(str(attempt_dir))
    return (int(m.group(1)), int(m.group(2))) if m else None
