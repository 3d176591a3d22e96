"""Durable file writes: temporary name, fsync, rename, fsync of the directory.

A reader never sees a half-written file under the final name, and after the call returns
the new content survives a power cut (the directory entry is synced too).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# Read once at import: os.umask can only be read by setting it, which would race with other
# threads (the checkpoint writer) creating files.
UMASK = _read_umask()


def ensure_private_dir(path: Path) -> Path:
    """Create `path` (and missing parents) owner-only (0700) if it does not exist yet."""
    if not path.is_dir():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            pass  # made meanwhile by another process: its maker chose its mode
        else:
            path.chmod(0o700)  # mkdir's mode is masked by the umask; 0700 is what we want
    return path


def atomic_write(path: Path, write: Callable[[IO[bytes]], object], mode: int | None = None) -> None:
    """Call `write(f)` on a temporary file beside `path`, then atomically replace `path`.

    `mode` None gives the file the permissions a plain open() would (0666 less the umask);
    a secret passes 0o600: mkstemp creates the temporary file 0600 (O_EXCL) and it is never
    widened, so no other user can open it at any moment, before or after the rename.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates 0600; unless asked for a mode, give the file the permissions a
        # plain open() would have, so a dataset or model written by one user can be read by
        # the team.
        os.fchmod(fd, 0o666 & ~UMASK if mode is None else mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        Path(tmp).replace(path)
    except BaseException:
        # Leave nothing behind under the final name; the temporary is ours to remove.
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes, mode: int | None = None) -> None:
    atomic_write(path, lambda f: f.write(data), mode)


def atomic_write_text(path: Path, text: str, mode: int | None = None) -> None:
    """`mode=0o600` for a secret (a token, API key hashes): owner-only from the first byte."""
    atomic_write_bytes(path, text.encode("utf-8"), mode)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def link_or_copy(src: Path, dst: Path) -> None:
    """Hard-link `src` at `dst` (no second copy on disk); copy it where links cannot be made
    (another file system, one without them, a link count at its limit)."""
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        shutil.copy2(src, dst)
