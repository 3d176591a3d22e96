"""Build a folder beside its final place, then move it in whole.

A dataset is many files; no single rename makes them appear together unless they are built in
a sibling folder first. `building(out)` gives that sibling and removes it on any failure
(Ctrl-C included), so `out` only ever holds a complete dataset. `publish` makes the finished
folder durable and moves it in: a plain rename when `out` is free, otherwise an atomic
exchange (Linux `renameat2(RENAME_EXCHANGE)`), so a crash at any instant leaves either the old
or the new dataset at `out`, never neither.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import secrets
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from visionloop.core.errors import DataError
from visionloop.core.fsutil import fsync_dir

log = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _sibling(out: Path, tag: str) -> Path:
    return out.parent / f".{out.name}.{tag}-{os.getpid()}-{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def remove_stale_partials(out: Path) -> list[Path]:
    """Delete `.NAME.partial-PID-*` folders left beside `out` by an ingest that was killed
    (SIGKILL, power loss) before it could clean up. A folder whose process still runs (a
    concurrent ingest on this machine) is left alone."""
    removed = []
    for p in out.parent.glob(f".{out.name}.partial-*"):
        try:
            pid = int(p.name.rsplit(".partial-", 1)[1].split("-", 1)[0])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
            log.info("removed %s, left by an interrupted ingest", p)
    return removed


@contextmanager
def building(out: Path) -> Iterator[Path]:
    """Yield an empty folder beside `out` (same filesystem, so it can be renamed into place);
    remove it if the body raises. The body calls `publish` when the folder is complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    tmp = _sibling(out, "partial")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root`: the rename that publishes it must not reach
    the disk before the data it points to."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(Path(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False where the OS or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)  # glibc >= 2.28
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def publish(tmp: Path, out: Path, *, replace: bool) -> None:
    """Move the finished folder `tmp` to `out`. With `replace`, an existing non-empty `out`
    is swapped out and then deleted; without it, that is an error."""
    _fsync_tree(tmp)
    try:
        tmp.rename(out)  # POSIX: succeeds when `out` is missing or an empty folder
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        if not replace:
            raise DataError(
                f"{out} appeared (not empty) while ingest was running; pass --overwrite to replace it, "
                "or choose another --out."
            ) from e
        if _exchange(tmp, out):
            shutil.rmtree(tmp)  # `tmp` now names the old dataset
        else:
            # No atomic exchange here: two renames. A crash between them leaves `out` missing
            # and the old dataset under the hidden `.NAME.old-*` name beside it.
            old = _sibling(out, "old")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
    fsync_dir(out.parent)
    log.debug("published %s", out)
