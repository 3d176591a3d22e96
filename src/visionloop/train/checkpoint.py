"""Checkpoints: verified, atomic, written in the background, pruned by policy.

File format (`step-000001234.ckpt`)::

    payload (torch.save zip of the state) | trailer JSON | u32 trailer length | b"VLCKPT2\n"

The trailer holds the step, the eval metric (for "keep best"), the payload's sha256 and size.
It sits at the end so that torch's own C++ writer can stream the payload straight into the
file (no in-memory copy of a multi-GB state); a write cut short has no magic at the end and
is never mistaken for a checkpoint. A checkpoint is trusted only after its checksum matches;
a corrupt or partial latest file is renamed `*.corrupt` and the previous one is used, with a
warning.

The training loop is blocked only while the state is copied into host buffers (`Snapshotter`,
which reuses its buffers from one checkpoint to the next: no allocation, no page faults);
serialisation, hashing, fsync and rename run on a writer thread. One write is in flight at a
time: a new save waits for the previous one, so checkpoints land in step order.

A run with `distributed: fsdp` writes sharded checkpoints instead: directories written by every
rank through torch.distributed.checkpoint, under the same rules (sharded_checkpoint.py).
"""

from __future__ import annotations

import abc
import contextlib
import functools
import hashlib
import io
import json
import logging
import math
import os
import pickle
import re
import shutil
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from visionloop.core.errors import CheckpointError
from visionloop.core.fsutil import UMASK as _UMASK
from visionloop.core.fsutil import NotRegularFileError, TooLargeError, fsync_dir, open_regular
from visionloop.train import progress
from visionloop.train.checkpoint_store import CheckpointStore

log = logging.getLogger(__name__)

MAGIC = b"VLCKPT2\n"
FORMAT = 2
_TAIL = struct.Struct("<I")
_NAME = re.compile(r"^step-(\d{9,})\.ckpt$")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_HASH_CHUNK = 16 << 20  # hashlib releases the GIL on large updates: training keeps running


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    metric: float | None
    sha256: str
    size: int


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}.ckpt"


class Snapshotter:
    """Copies every tensor of a nested state into host buffers kept between calls.

    The copy must be taken before training mutates the live tensors again, so it is the one
    part of checkpointing the loop waits for. Reusing the buffers makes it a plain memcpy
    (a fresh allocation of a few hundred MB costs as much again in page faults); CUDA
    tensors go to pinned buffers with one synchronisation at the end."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def __call__(self, state: Any) -> Any:
        self._i = 0
        self._cuda = False
        with torch.no_grad():
            frozen = self._copy(state)
        if self._cuda:
            torch.cuda.synchronize()
        del self._buffers[self._i :]
        return frozen

    def _buffer_for(self, t: torch.Tensor) -> torch.Tensor:
        i = self._i
        self._i += 1
        if i < len(self._buffers):
            b = self._buffers[i]
            if b.shape == t.shape and b.dtype == t.dtype and b.is_contiguous():
                return b
        b = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
        if i < len(self._buffers):
            self._buffers[i] = b
        else:
            self._buffers.append(b)
        return b

    def _copy(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            buf = self._buffer_for(obj)
            buf.copy_(obj.detach(), non_blocking=obj.is_cuda)
            self._cuda |= obj.is_cuda
            return buf
        if isinstance(obj, Mapping):
            return {k: self._copy(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._copy(v) for v in obj]
        if isinstance(obj, tuple):
            return tuple(self._copy(v) for v in obj)
        return obj


def _trailer(sha256: str, size: int, step: int, metric: float | None) -> bytes:
    body = json.dumps(
        {
            "format": FORMAT,
            "step": step,
            "metric": metric,
            "sha256": sha256,
            "size": size,
            "created": time.time(),
        }
    ).encode()
    return body + _TAIL.pack(len(body)) + MAGIC


def write_checkpoint(
    path: Path,
    state: Mapping[str, Any],
    step: int,
    metric: float | None,
    before_commit: Callable[[], object] | None = None,
) -> None:
    """Serialise `state` to `path` atomically: temporary file, trailer, fsync, rename.

    `before_commit` runs after the data is durable and before the rename that makes the
    checkpoint visible (the trainer flushes its queued metrics there: a resumed run replays
    only steps after its checkpoint, so every step before it must already be stored)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; teammates must be able to resume
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        try:
            torch.save(dict(state), tmp)  # a path: torch's C++ writer streams it, no Python copy
        except RuntimeError as e:  # torch reports a full disk as an "enforce fail", not OSError
            free = shutil.disk_usage(path.parent).free
            raise OSError(f"torch.save failed ({str(e).splitlines()[0]}); {free / 2**20:.0f} MiB free") from e
        digest = hashlib.sha256()
        size = 0
        with open(tmp, "r+b") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
                size += len(chunk)
            f.write(_trailer(digest.hexdigest(), size, step, metric))
            f.flush()
            os.fsync(f.fileno())
        if before_commit is not None:
            before_commit()
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def encode(state: Mapping[str, Any], step: int, metric: float | None) -> bytes:
    """The bytes of a checkpoint file, built in memory (for tools and tests; the trainer
    streams with `write_checkpoint`)."""
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    payload = buf.getvalue()
    return payload + _trailer(hashlib.sha256(payload).hexdigest(), len(payload), step, metric)


def read_trailer(f: Any, name: str) -> tuple[dict[str, Any], int]:
    """(trailer, payload length) from an open checkpoint file."""
    end = f.seek(0, os.SEEK_END)
    tail = len(MAGIC) + _TAIL.size
    if end < tail:
        raise CheckpointError(f"{name}: truncated (only {end} bytes)")
    f.seek(end - tail)
    raw = f.read(tail)
    if raw[_TAIL.size :] != MAGIC:
        raise CheckpointError(f"{name}: not a complete visionloop checkpoint (no end marker; cut short?)")
    (n,) = _TAIL.unpack(raw[: _TAIL.size])
    if n > 1 << 20 or n > end - tail:
        raise CheckpointError(f"{name}: trailer length {n} is implausible")
    f.seek(end - tail - n)
    try:
        trailer = json.loads(f.read(n))
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested past the parser's depth
        raise CheckpointError(f"{name}: corrupt trailer ({str(e)[:200]})") from e
    if not isinstance(trailer, dict) or trailer.get("format") != FORMAT:
        raise CheckpointError(f"{name}: unsupported checkpoint format {trailer!r:.80}")
    return _checked_trailer(trailer, name), end - tail - n


def _checked_trailer(trailer: dict[str, Any], name: str) -> dict[str, Any]:
    """The trailer, its fields of the types the readers rely on (anything else is damage: a
    string step or metric would fail retention's comparisons on the writer thread). A metric
    that is not a finite number ranks no checkpoint as best: it is read as none."""
    step, size, sha = trailer.get("step"), trailer.get("size"), trailer.get("sha256")
    for field, value in (("step", step), ("size", size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CheckpointError(f"{name}: the trailer's {field} is {value!r:.40}, not a count")
    if not isinstance(sha, str) or not _SHA256.fullmatch(sha):
        raise CheckpointError(f"{name}: the trailer's sha256 is {sha!r:.80}, not a checksum")
    metric = trailer.get("metric")
    if not (isinstance(metric, int | float) and not isinstance(metric, bool) and math.isfinite(metric)):
        metric = None
    return {**trailer, "metric": metric}


def _open_checkpoint(path: Path) -> io.BufferedReader:
    """Open a checkpoint file; anything but a regular file (a FIFO would hang the reader,
    /dev/zero never ends) is a damaged checkpoint."""
    try:
        return open_regular(path)
    except NotRegularFileError as e:
        raise CheckpointError(f"{path.name} is not a checkpoint file ({e.strerror})") from e


def read_header(path: Path) -> dict[str, Any]:
    """The trailer of a checkpoint file (cheap: reads only the end)."""
    with _open_checkpoint(path) as f:
        return read_trailer(f, path.name)[0]


def memory_bytes() -> int:
    """This machine's physical memory: a checkpoint is read whole, so no larger one can load."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not reported: no limit beyond the allocator's
        return 1 << 62


def load_verified(path: Path) -> dict[str, Any]:
    """Read a checkpoint, verify size and sha256, and unpickle it with weights_only=True.

    A sharded checkpoint (a directory, `distributed: fsdp`) is verified file by file; what
    comes back is its trainer state, with `dcp_dir` naming the directory whose model and
    optimizer shards the loop then loads collectively."""
    if path.is_dir():
        from visionloop.train.sharded_checkpoint import load_verified_dir

        return load_verified_dir(path)
    with _open_checkpoint(path) as f:
        trailer, payload_len = read_trailer(f, path.name)
        if payload_len != trailer["size"]:  # before reading it: the size is all that is known
            raise CheckpointError(
                f"{path.name}: payload is {payload_len} bytes, the trailer says {trailer['size']}"
            )
        limit = memory_bytes()
        if payload_len > limit:  # maybe genuine, from a bigger machine: never set aside for this
            raise TooLargeError(path, limit, "a checkpoint on this machine (its memory)", payload_len)
        f.seek(0)
        payload = f.read(payload_len)
    if len(payload) != payload_len:  # cut short while being read
        raise CheckpointError(f"{path.name}: truncated while being read")
    if hashlib.sha256(payload).hexdigest() != trailer["sha256"]:
        raise CheckpointError(f"{path.name}: checksum mismatch (the file is corrupt)")
    try:
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except (RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"{path.name}: the payload does not unpickle ({e})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{path.name}: payload is not a state dict")
    return state


def lower_thread_priority() -> None:
    """Run the writer at low CPU priority (Linux: nice is per thread). Training's OpenMP threads
    wait for each other at every parallel op, so a writer that takes one of their cores slows
    every step, not just one thread; at low priority it uses the cores when training leaves
    them idle (data waits, GPU-bound steps)."""
    # Not Linux, or not permitted: run at normal priority.
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 15)


class _ManagerBase(abc.ABC):
    """What the single-file and the sharded manager share: the writer thread with one write in
    flight, finding the newest checkpoint that verifies, setting damaged ones aside, and the
    keep_last / keep_best retention. Subclasses say how a checkpoint of their format is named,
    read, loaded and deleted."""

    def __init__(
        self,
        directory: Path,
        *,
        keep_last: int,
        keep_best: int,
        best_mode: str = "max",
        store: CheckpointStore | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.store = store  # the object store's copy (checkpoint_store.py), if one is set
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.best_mode = best_mode
        self._pool = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="ckpt-writer", initializer=lower_thread_priority
        )
        self._pending: Future[Path] | None = None
        self._lock = threading.Lock()
        self.last_stall_s = 0.0
        self.last_write_s = 0.0
        self.last_copy_s = 0.0

    # ---------------------------------------------------------------- per format
    @abc.abstractmethod
    def _step_of(self, path: Path) -> int | None:
        """The step `path` is named for, or None if it is not a checkpoint of this format."""

    @abc.abstractmethod
    def _read_info(self, path: Path) -> CheckpointInfo:
        """The checkpoint's header, cheaply (payloads not verified)."""

    @abc.abstractmethod
    def _load(self, step: int, path: Path) -> tuple[CheckpointInfo, dict[str, Any]]:
        """Verify and load one checkpoint; CheckpointError if it is damaged."""

    @abc.abstractmethod
    def _delete(self, path: Path) -> None:
        """Remove one checkpoint (OSError if it cannot)."""

    @abc.abstractmethod
    def remove_stale_temporaries(self) -> None: ...

    # ---------------------------------------------------------------- discovery
    def infos(self) -> list[CheckpointInfo]:
        """Checkpoints whose header parses, oldest first (payloads are not verified here)."""
        if not self.dir.is_dir():
            return []
        found: list[CheckpointInfo] = []
        for p in self.dir.iterdir():
            if self._step_of(p) is None:
                continue
            try:
                info = self._read_info(p)
            except (CheckpointError, OSError) as e:
                log.warning("ignoring checkpoint %s: %s", p.name, e)
                continue
            found.append(info)
        return sorted(found, key=lambda c: c.step)

    def load_latest(self) -> tuple[CheckpointInfo, dict[str, Any]] | None:
        """The newest checkpoint that verifies. Unusable ones (cut short, corrupt, garbled) are
        set aside (renamed `*.corrupt`) with a warning; if files exist but none verifies, that
        is an error, not a silent restart."""
        self.remove_stale_temporaries()
        local = (
            [(step, p) for p in self.dir.iterdir() if (step := self._step_of(p)) is not None]
            if self.dir.is_dir()
            else []
        )
        # The store's copies that local disk lacks (a run resumed on another machine), as
        # (step, None) until fetched: downloaded one at a time, newest first, only as far
        # as the search needs.
        remote = self.store.missing([step for step, _ in local], self.dir) if self.store is not None else {}
        named: list[tuple[int, Path | None]] = sorted(
            [*local, *((step, None) for step in remote)], reverse=True
        )
        bad: list[str] = []
        for step, found in named:
            path = found if found is not None else self._fetch(step, remote[step])
            try:
                return self._load(step, path)
            except CheckpointError as e:  # the checkpoint itself is damaged: set it aside
                bad.append(path.name)
                log.warning("checkpoint %s is unusable (%s); trying the previous one", path.name, e)
                self._quarantine(path)
                continue
            except TooLargeError as e:
                raise CheckpointError(
                    f"cannot load checkpoint {path}: it is {(e.size or 0) / 2**30:.1f} GiB, more than this "
                    f"machine's memory ({e.limit / 2**30:.1f} GiB). If it is genuine, resume on a machine "
                    f"with more memory; if not, move it out of {self.dir} to resume from the previous one."
                ) from e
            except (OSError, MemoryError) as e:
                # Says nothing about the file (permissions, NFS, a smaller machine): never
                # quarantine a possibly good checkpoint for it.
                raise CheckpointError(
                    f"cannot read checkpoint {path} ({type(e).__name__}: {e}). Fix access to the run "
                    f"directory or use a machine with more memory, then rerun to resume."
                ) from e
        if bad:
            raise CheckpointError(
                f"no valid checkpoint in {self.dir} (unusable: {', '.join(bad)}). "
                f"To start this run over, move the run directory away and train again."
            )
        return None

    def _fetch(self, step: int, entry: tuple[str, int]) -> Path:
        assert self.store is not None
        return self.store.fetch(step, *entry, self.dir, memory_bytes() + (1 << 20))

    def _quarantine(self, path: Path) -> None:
        try:
            path.rename(path.with_name(path.name + ".corrupt"))
        except OSError as e:
            log.warning("could not rename corrupt checkpoint %s: %s", path, e)

    # ---------------------------------------------------------------- writer thread
    def _submit(self, fn: Callable[..., Path], *args: Any) -> None:
        with self._lock:
            self._pending = self._pool.submit(fn, *args)

    def _committed(self, step: int, t0: float) -> None:
        progress.checkpoint(step)  # durable now: renamed, and its folder synced
        self.last_write_s = time.perf_counter() - t0
        infos = self.infos()
        removed = set(self._prune(infos))
        if self.store is not None:
            # On the writer thread, so a stop waits for it (`wait`); the store then holds
            # what the run directory keeps.
            t1 = time.perf_counter()
            self.store.sync([(c.path, c.sha256) for c in infos if c.path not in removed])
            self.last_copy_s = time.perf_counter() - t1

    def wait(self) -> Path | None:
        """Block until the in-flight write (if any) is durable; re-raise its error."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return None
        try:
            return pending.result()
        except OSError as e:
            raise CheckpointError(
                f"writing a checkpoint to {self.dir} failed: {e}. Free disk space or fix permissions, "
                f"then rerun the same command to resume from the last good checkpoint."
            ) from e

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    # ---------------------------------------------------------------- retention
    def prune(self) -> list[Path]:
        """Keep the newest `keep_last` plus the best `keep_best` by metric; delete the rest."""
        return self._prune(self.infos())

    def _prune(self, infos: list[CheckpointInfo]) -> list[Path]:
        """`prune` over `infos` (the checkpoints found, oldest first); the paths deleted."""
        keep = {c.path for c in infos[-self.keep_last :]}
        scored = [c for c in infos if c.metric is not None]
        if self.keep_best and scored:
            best_first = sorted(scored, key=lambda c: c.metric or 0.0, reverse=self.best_mode == "max")
            keep |= {c.path for c in best_first[: self.keep_best]}
        removed = []
        for c in infos:
            if c.path not in keep:
                try:
                    self._delete(c.path)
                    removed.append(c.path)
                except OSError as e:
                    # A failed deletion must not kill the writer: the next prune retries it.
                    log.warning("could not delete old checkpoint %s: %s", c.path, e)
        return removed

    def best(self) -> CheckpointInfo | None:
        scored = [c for c in self.infos() if c.metric is not None]
        if not scored:
            return None
        return sorted(scored, key=lambda c: c.metric or 0.0, reverse=self.best_mode == "max")[0]


class CheckpointManager(_ManagerBase):
    """Owns `<run_dir>/checkpoints/`: save (async), find the latest valid, prune."""

    @functools.cached_property
    def _snapshot(self) -> Snapshotter:
        """Its host buffers, reused from one checkpoint to the next."""
        return Snapshotter()

    # ---------------------------------------------------------------- format
    def _step_of(self, path: Path) -> int | None:
        m = _NAME.match(path.name)
        return int(m.group(1)) if m else None

    def _read_info(self, path: Path) -> CheckpointInfo:
        h = read_header(path)
        return CheckpointInfo(path, int(h["step"]), h.get("metric"), h["sha256"], int(h["size"]))

    def _load(self, step: int, path: Path) -> tuple[CheckpointInfo, dict[str, Any]]:
        state = load_verified(path)
        trailer = read_header(path)
        if int(trailer["step"]) != step:
            raise CheckpointError(f"{path.name}: the trailer says step {trailer['step']}")
        info = CheckpointInfo(path, step, trailer.get("metric"), trailer["sha256"], int(trailer["size"]))
        return info, state

    def _delete(self, path: Path) -> None:
        path.unlink()

    def remove_stale_temporaries(self) -> None:
        """Temporary files left by a writer that was killed mid-write."""
        if self.dir.is_dir():
            for p in self.dir.glob(".step-*.tmp"):
                p.unlink(missing_ok=True)

    # ---------------------------------------------------------------- saving
    def save(
        self,
        state: Mapping[str, Any],
        step: int,
        metric: float | None = None,
        *,
        block: bool = False,
        before_commit: Callable[[], object] | None = None,
    ) -> None:
        """Snapshot `state` now; write it on the writer thread. `block=True` waits until it is
        durable (used before exiting). `before_commit` runs on the writer thread just before
        the checkpoint becomes visible (see `write_checkpoint`)."""
        t0 = time.perf_counter()
        self.wait()  # one write in flight: checkpoints land in order, and the buffers are free
        frozen = self._snapshot(state)
        self.last_stall_s = time.perf_counter() - t0
        self._submit(self._write, frozen, step, metric, before_commit)
        if block:
            self.wait()

    def _write(
        self,
        state: dict[str, Any],
        step: int,
        metric: float | None,
        before_commit: Callable[[], object] | None,
    ) -> Path:
        t0 = time.perf_counter()
        path = self.dir / checkpoint_name(step)
        write_checkpoint(path, state, step, metric, before_commit)
        self._committed(step, t0)
        return path
