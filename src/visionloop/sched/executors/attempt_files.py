"""Reading an attempt folder, which the job's own process can write in: its log, and the
shim's status files (shim.json, exit.json) and heartbeat. Each is read only as a regular file,
never through a link and within a size: a job could point its log at the admin token, or put a
FIFO where the control plane's thread would wait on it for ever."""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

from visionloop.core.errors import ExecutorError

# shim.json and exit.json hold a few hundred bytes; past this, not what the shim wrote.
MAX_STATUS_BYTES = 1 << 20
READ_CHUNK = 64 * 1024  # a log is handed out in pieces of this size


def open_attempt_file(path: Path, what: str) -> BinaryIO:
    """An attempt folder's file, opened for reading only if it is a regular file and not a
    symbolic link: the job's process writes in that folder, and could make its log point at the
    admin token, or put a FIFO where the control plane's thread would wait on it for ever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ExecutorError(f"the {what} {path} is a symbolic link; it is not read.") from e
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ExecutorError(f"the {what} {path} is not a regular file; it is not read.")
    return os.fdopen(fd, "rb")


def read_status(path: Path) -> dict[str, Any] | None:
    """The file's JSON object, or None if it does not exist (yet). Files are written
    atomically, so a present file is complete."""
    try:
        with open_attempt_file(path, "status file") as f:
            raw = f.read(MAX_STATUS_BYTES + 1)
        if len(raw) > MAX_STATUS_BYTES:
            raise ValueError(f"larger than {MAX_STATUS_BYTES} bytes; the shim writes a few hundred")
        data = json.loads(raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ExecutorError(f"{path} is unreadable ({e}); inspect it, or remove the attempt dir.") from e
    if not isinstance(data, dict):
        raise ExecutorError(f"{path} does not hold a JSON object; inspect it, or remove the attempt dir.")
    return data


def mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def log_tail(path: Path, limit: int = 4000) -> str:
    """The end of an attempt's log, for an error message: its last `limit` bytes only."""
    try:
        with open_attempt_file(path, "log") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            data = f.read(limit)
    except (OSError, ExecutorError) as e:
        return "(no output)" if isinstance(e, FileNotFoundError) else f"(its output is not shown: {e})"
    text = data.decode("utf-8", errors="replace").rstrip()
    return text or "(no output)"


def read_log(path: Path, offset: int = 0) -> Iterator[bytes]:
    """An attempt's log from byte `offset` to its current end, in chunks; nothing if there is no
    log yet. A follower remembers offset + bytes received and calls again."""
    try:
        f = open_attempt_file(path, "log")
    except FileNotFoundError:
        return
    with f:
        f.seek(max(offset, 0))
        while chunk := f.read(READ_CHUNK):
            yield chunk
