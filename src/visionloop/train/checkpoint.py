"""Checkpoints: verified, atomic, written in the background, pruned by policy.

File format (`step-000001234.ckpt`)::

    b"VLCKPT1\\n" | u32 header length | header JSON | payload (torch.save of the state)

The header holds the step, the eval metric (for "keep best"), the payload's sha256 and size.
A checkpoint is trusted only after its checksum matches; a corrupt or partial latest file is
renamed `*.corrupt` and the previous one is used, with a warning.

The training loop is blocked only while the state is copied to host memory (`snapshot`);
serialisation, hashing, fsync and rename run on a writer thread. One write is in flight at a
time: a new save waits for the previous one, so checkpoints land in step order.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import struct
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from visionloop.core.errors import CheckpointError
from visionloop.core.fsutil import atomic_write

log = logging.getLogger(__name__)

MAGIC = b"VLCKPT1\n"
FORMAT = 1
_NAME = re.compile(r"^step-(\d{9,})\.ckpt$")


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    metric: float | None
    sha256: str
    size: int


def checkpoint_name(step: int) -> str:
    return f"step-{step:09d}.ckpt"


def snapshot(obj: Any) -> Any:
    """Deep-copy every tensor in a nested state to CPU memory, so the writer thread sees a
    frozen copy while training keeps mutating the live tensors."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(snapshot(v) for v in obj)
    return obj


def encode(state: Mapping[str, Any], step: int, metric: float | None) -> bytes:
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    payload = buf.getvalue()
    header = json.dumps(
        {
            "format": FORMAT,
            "step": step,
            "metric": metric,
            "sha256": hashlib.sha256(payload).hexdigest(),
            "size": len(payload),
            "created": time.time(),
        }
    ).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def read_header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise CheckpointError(f"{path.name}: not a visionloop checkpoint (bad magic)")
        raw_len = f.read(4)
        if len(raw_len) != 4:
            raise CheckpointError(f"{path.name}: truncated header")
        (n,) = struct.unpack("<I", raw_len)
        if n > 1 << 20:
            raise CheckpointError(f"{path.name}: header length {n} is implausible")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path.name}: corrupt header ({e})") from e
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CheckpointError(f"{path.name}: unsupported checkpoint format {header!r:.80}")
    return header


def load_verified(path: Path) -> dict[str, Any]:
    """Read a checkpoint, verify size and sha256, and unpickle it with weights_only=True."""
    header = read_header(path)
    data = path.read_bytes()
    offset = len(MAGIC) + 4 + struct.unpack("<I", data[len(MAGIC) : len(MAGIC) + 4])[0]
    payload = data[offset:]
    if len(payload) != header["size"]:
        raise CheckpointError(f"{path.name}: payload is {len(payload)} bytes, header says {header['size']}")
    if hashlib.sha256(payload).hexdigest() != header["sha256"]:
        raise CheckpointError(f"{path.name}: checksum mismatch (the file is corrupt)")
    state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    if not isinstance(state, dict):
        raise CheckpointError(f"{path.name}: payload is not a state dict")
    return state


class CheckpointManager:
    """Owns `<run_dir>/checkpoints/`: save (async), find the latest valid, prune."""

    def __init__(self, directory: Path, *, keep_last: int, keep_best: int, best_mode: str = "max") -> None:
        self.dir = Path(directory)
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.best_mode = best_mode
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-writer")
        self._pending: Future[Path] | None = None
        self._lock = threading.Lock()
        self.last_stall_s = 0.0
        self.last_write_s = 0.0

    # ---------------------------------------------------------------- discovery
    def infos(self) -> list[CheckpointInfo]:
        """Checkpoints whose header parses, oldest first (payloads are not verified here)."""
        if not self.dir.is_dir():
            return []
        found: list[CheckpointInfo] = []
        for p in self.dir.iterdir():
            m = _NAME.match(p.name)
            if not m:
                continue
            try:
                h = read_header(p)
            except (CheckpointError, OSError) as e:
                log.warning("ignoring checkpoint %s: %s", p.name, e)
                continue
            found.append(CheckpointInfo(p, int(h["step"]), h.get("metric"), h["sha256"], int(h["size"])))
        return sorted(found, key=lambda c: c.step)

    def load_latest(self) -> tuple[CheckpointInfo, dict[str, Any]] | None:
        """The newest checkpoint that verifies. Corrupt ones are set aside (renamed) with a
        warning; if files exist but none verifies, that is an error, not a silent restart."""
        self.remove_stale_temporaries()
        candidates = self.infos()
        bad: list[str] = []
        for info in reversed(candidates):
            try:
                return info, load_verified(info.path)
            except Exception as e:  # any failure to read means "not trustworthy"
                bad.append(info.path.name)
                log.warning("checkpoint %s is unusable (%s); trying the previous one", info.path.name, e)
                self._quarantine(info.path)
        unparsable = [p.name for p in self.dir.glob("step-*.ckpt")] if self.dir.is_dir() else []
        if bad or unparsable:
            raise CheckpointError(
                f"no valid checkpoint in {self.dir} (unusable: {', '.join(bad + unparsable)}). "
                f"To start this run over, move the run directory away and train again."
            )
        return None

    def _quarantine(self, path: Path) -> None:
        try:
            path.rename(path.with_name(path.name + ".corrupt"))
        except OSError as e:
            log.warning("could not rename corrupt checkpoint %s: %s", path, e)

    def remove_stale_temporaries(self) -> None:
        """Temporary files left by a writer that was killed mid-write."""
        if self.dir.is_dir():
            for p in self.dir.glob(".step-*.tmp"):
                p.unlink(missing_ok=True)

    # ---------------------------------------------------------------- saving
    def save(
        self, state: Mapping[str, Any], step: int, metric: float | None = None, *, block: bool = False
    ) -> None:
        """Snapshot `state` now; write it on the writer thread. `block=True` waits until it is
        durable (used before exiting)."""
        t0 = time.perf_counter()
        self.wait()  # one write in flight: checkpoints land in order, memory stays bounded
        frozen = snapshot(state)
        self.last_stall_s = time.perf_counter() - t0
        with self._lock:
            self._pending = self._pool.submit(self._write, frozen, step, metric)
        if block:
            self.wait()

    def _write(self, state: dict[str, Any], step: int, metric: float | None) -> Path:
        t0 = time.perf_counter()
        data = encode(state, step, metric)
        path = self.dir / checkpoint_name(step)
        atomic_write(path, lambda f: f.write(data))
        self.last_write_s = time.perf_counter() - t0
        self.prune()
        return path

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
        infos = self.infos()
        keep = {c.path for c in infos[-self.keep_last :]}
        scored = [c for c in infos if c.metric is not None]
        if self.keep_best and scored:
            best_first = sorted(scored, key=lambda c: c.metric or 0.0, reverse=self.best_mode == "max")
            keep |= {c.path for c in best_first[: self.keep_best]}
        removed = []
        for c in infos:
            if c.path not in keep:
                try:
                    c.path.unlink()
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
