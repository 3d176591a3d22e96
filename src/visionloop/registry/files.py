"""Durable files for registered versions: a per-model lock, fsynced copies, a staging folder
that becomes the version folder in one rename."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from visionloop.core.fsutil import UMASK, fsync_dir

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
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
