"""Durable file writes: temporary name, fsync, rename, fsync of the directory.

A reader never sees a half-written file under the final name, and after the call returns
the new content survives a power cut (the directory entry is synced too).

And safe reads: `open_regular` opens a file a user handed in, refusing a FIFO, device,
socket or folder named like one (a FIFO would hang the reader, /dev/zero never ends);
`read_capped` (bytes) and `read_capped_text` (strict UTF-8) read such a file whole, refusing
one past a size limit with `TooLargeError`. `capped_lines` reads a log line by line with at
most one line's limit in memory, `json_objects` the objects of a JSON-lines file that way, and
`tail_lines` the end of a log of any size.
"""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, Literal


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


class NotRegularFileError(OSError):
    """A FIFO, device, socket or folder where a regular file was expected."""

    def __str__(self) -> str:
        return f"{self.filename} {self.strerror}"


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_regular(path: str | os.PathLike[str]) -> io.BufferedReader:
    """Open `path` for reading in binary, refusing anything but a regular file (links followed)
    with `NotRegularFileError`, before a byte is read. Opened non-blocking, so that opening a
    FIFO cannot wait for a writer; reads of a regular file are unaffected."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(
                errno.EINVAL,
                f"is {_kind(mode)}, not a regular file; remove it or replace it",
                os.fspath(path),
            )
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def human_bytes(n: int) -> str:
    """A size limit in the largest binary unit that divides it: 1048576 is "1 MiB", 65536
    "64 KiB", 1536 "1536 bytes" (a limit is shown exactly, never rounded)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return "1 byte" if n == 1 else f"{n} bytes"


class TooLargeError(ValueError):
    """A file past the size its reader accepts (`read_capped`). A ValueError, as a file's
    content the reader cannot use is (not an OSError: the file could be read). `size` is the
    file's size where it was known before reading (from fstat), else None (it grew, or its
    size is not reported, as in /proc)."""

    def __init__(self, path: str | os.PathLike[str], limit: int, what: str, size: int | None = None) -> None:
        self.filename = os.fspath(path)
        self.limit = limit
        self.what = what
        self.size = size
        super().__init__(
            f"{self.filename} is larger than {human_bytes(limit)}, the limit for {what}; "
            "check that it is the right file"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # picklable, to cross a process pool
        return (type(self), (self.filename, self.limit, self.what, self.size))


class NotTextError(UnicodeDecodeError):
    """A file `read_capped_text` read is not UTF-8. Still a UnicodeDecodeError (and so a
    ValueError), with the codec's position and reason; its message names the file and says
    what to do. `detail` is the codec's message alone."""

    def __init__(self, path: str | os.PathLike[str], error: UnicodeDecodeError) -> None:
        super().__init__(error.encoding, error.object, error.start, error.end, error.reason)
        self.filename = os.fspath(path)

    def __reduce__(self) -> tuple[Any, ...]:  # picklable, to cross a process pool
        cause = UnicodeDecodeError(self.encoding, self.object, self.start, self.end, self.reason)
        return (type(self), (self.filename, cause))

    @property
    def detail(self) -> str:
        return UnicodeDecodeError.__str__(self)

    def __str__(self) -> str:
        return f"{self.filename} is not UTF-8 text ({self.detail}); save it as UTF-8."


def read_capped(path: str | os.PathLike[str], limit: int, *, what: str) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them.

    Raises what `open_regular` raises (NotRegularFileError for a FIFO, device, socket or
    folder, before a byte is read; FileNotFoundError, PermissionError, ... as OSError) and
    TooLargeError, naming `what` the file should be ("a cluster config"), for a file over
    `limit` bytes: refused from its size before reading where the file system reports it,
    else after reading `limit + 1` bytes (never more)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise TooLargeError(path, limit, what, size)
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew since the fstat
        raise TooLargeError(path, limit, what)
    return data


def read_capped_text(
    path: str | os.PathLike[str],
    limit: int,
    *,
    what: str,
    encoding: Literal["utf-8", "utf-8-sig"] = "utf-8",
) -> str:
    """`read_capped`, decoded as strict UTF-8 (utf-8-sig: a leading byte-order mark, which
    spreadsheets and Windows editors write, is dropped). Raises as `read_capped` does, and
    NotTextError (a UnicodeDecodeError) for bytes that are not UTF-8."""
    data = read_capped(path, limit, what=what)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise NotTextError(path, e) from None


# ----------------------------------------------------------------------------- logs, line by line

_SKIP_BLOCK = 64 * 1024  # readline joins its pieces: a few blocks are alive at once


@dataclass(frozen=True)
class LongLine:
    """A line of a log past its reader's limit, read past a block at a time, never held whole
    (a crash can leave gigabytes of NULs without a newline). `size` counts its bytes."""

    size: int


def capped_lines(f: BinaryIO, limit: int) -> Iterator[tuple[int, bytes | LongLine]]:
    """The lines of `f` with their numbers (from 1), each with its newline where it has one.
    A line of more than `limit` bytes (the newline not counted) comes as a `LongLine`, so a
    reader can count it as skipped: at most `limit + 1` bytes of any line are in memory."""
    number = 0
    while line := f.readline(limit + 1):
        number += 1
        body = len(line) - line.endswith(b"\n")
        if body <= limit:
            yield number, line
            continue
        size = len(line)
        while not line.endswith(b"\n") and (line := f.readline(_SKIP_BLOCK)):
            size += len(line)
        yield number, LongLine(size)


def tail_lines(path: str | os.PathLike[str], lines: int, *, max_bytes: int = 1 << 20) -> list[str]:
    """The last `lines` lines of the regular file `path`, from at most its last `max_bytes`
    (a log grows without bound: reading it whole to show its end could exhaust memory). Bytes
    that are not UTF-8 are replaced; a first line cut by the window is dropped. Raises what
    `open_regular` raises."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        start = max(0, size - max_bytes)
        f.seek(start)
        data = f.read(max_bytes)
    if start > 0:
        data = data.partition(b"\n")[2]  # the first line began before the window
    return data.decode("utf-8", "replace").splitlines()[-lines:] if lines > 0 else []


def json_objects(f: BinaryIO, limit: int) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, one a line, in order. A line that is not one (torn
    by a crash, past `limit` bytes, not UTF-8, too deeply nested, a list) is skipped: for files
    read as a record of what happened, where one bad line must not hide the rest."""
    for _, line in capped_lines(f, limit):
        if isinstance(line, LongLine):
            continue
        try:
            doc = json.loads(line)
        except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            continue
        if isinstance(doc, dict):
            yield doc
