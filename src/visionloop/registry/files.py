"""Durable files for registered versions: a per-model lock, fsynced copies, a staging folder
that becomes the version folder in one rename."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from visionloop.core.fsutil import (
    UMASK,
    NotRegularFileError,
    TooLargeError,
    fsync_dir,
    open_regular,
    read_capped,
)

_CHUNK = 1 << 20
# Ceilings for the small JSON files beside a version (lineage, alias history, export and eval
# reports, run.json): far above what visionloop writes, far below what would exhaust memory.
MAX_JSON_BYTES = 16 * 2**20


class UnreadableFileError(Exception):
    """A small JSON file that cannot be used; str() names the file and what is wrong with it.
    Callers turn it into their own error, or into "absent" where a file is optional."""


def read_json(path: Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON document in `path`, read with a limit on everything that could run away.

    FileNotFoundError passes through (the caller decides what a missing file means); anything
    else wrong raises UnreadableFileError: a FIFO or device (open_regular: never waits on a
    writer), a file over `max_bytes`, bytes that are not UTF-8 JSON, a number past Python's
    4300-digit limit, nesting too deep to parse (RecursionError).
    """
    try:
        data = read_capped(path, max_bytes, what="a registry JSON file")
    except FileNotFoundError:
        raise
    except NotRegularFileError as e:
        raise UnreadableFileError(str(e)) from e  # "<path> is a FIFO (named pipe), not a ..."
    except OSError as e:
        raise UnreadableFileError(f"{path}: {e.strerror or e}") from e
    except TooLargeError as e:
        raise UnreadableFileError(
            f"{path} is over {max_bytes // 2**20} MiB, far more than it should hold"
        ) from e
    try:
        return json.loads(data.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError, JSONDecodeError, a 5000-digit number
        why = str(e).split("; use sys.set_int_max_str_digits")[0]  # advice for programmers only
        raise UnreadableFileError(f"{path} cannot be read as UTF-8 JSON ({why})") from e
    except RecursionError as e:
        raise UnreadableFileError(f"{path} nests too deeply to be read") from e


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    # open_regular: a weights file swapped for a FIFO must not hang the registration.
    with open_regular(path) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@contextlib.contextmanager
def model_lock(model_root: Path) -> Iterator[None]:
    """Serialise changes to one model (registrations, alias moves) between processes.

    MLflow's SQL store already refuses a duplicate version number, but the version folder, the
    alias history file and SQLite's single writer all need one change at a time; an flock is
    released by the kernel if the holder dies, so a crash never leaves the model locked.
    """
    model_root.mkdir(parents=True, exist_ok=True)
    with open(model_root / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def copy_durable(src: Path, dst: Path) -> None:
    """Copy `src` to `dst` and fsync it (the folder is synced once, by the caller)."""
    shutil.copyfile(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_staging(model_root: Path) -> Path:
    """A fresh hidden folder beside the version folders; renamed into place when complete."""
    path = Path(tempfile.mkdtemp(prefix=".staging-", dir=model_root))
    # mkdtemp makes 0700; a registered model is for the whole team to read.
    path.chmod(0o777 & ~UMASK)
    return path


def publish(staging: Path, final: Path) -> None:
    """Make `staging` visible as `final` atomically: a reader sees the whole folder or none."""
    fsync_dir(staging)
    # The caller checked under the model lock that `final` does not exist; a non-empty `final`
    # would make the rename fail rather than be overwritten.
    staging.rename(final)
    fsync_dir(final.parent)


def remove_stale_staging(model_root: Path) -> None:
    """Delete staging folders left by registrations that died (called under the model lock,
    so none of them belongs to a live registration)."""
    for p in model_root.glob(".staging-*"):
        shutil.rmtree(p, ignore_errors=True)
