"""A run's checkpoints, copied to an object store so that the run resumes on any machine.

A spot instance's local disk goes with the instance; a checkpoint that only lived there is
lost with it. With `checkpoint_store` set (visionloop.toml or VISIONLOOP_CHECKPOINT_STORE,
an s3:// or file:// URI), every checkpoint, once durable on local disk, is also uploaded to

    <store>/<run key>/<spec hash>/checkpoints/step-000001234.ckpt

and the store keeps what the run directory keeps (`keep_last` and `keep_best`): the writer
thread makes the store's folder match the local one after each checkpoint (`sync`), so a
failed upload (the store unreachable for a while) is made good by the next one, and training
never stops for the store. On resume, a checkpoint that is in the store but not on local disk
is downloaded before the usual search for the newest one that verifies: a download is checked
exactly as a local file is (size, sha256, weights only), one that fails is set aside locally
and the one before it is tried.

The run key is the run directory's path under the visionloop home (`runs/job-12`), which
the control plane gives an attempt on whatever machine it runs; a run directory outside
the home is keyed by its absolute path (`abs/tmp/run-1`). The spec hash is the first 16
hex digits of the fingerprint a resumed run must match (`rundir.spec_fingerprint`): where
the run directory, and its record of the spec, is gone, a changed spec (or another user's
on another machine with the same path) finds no checkpoints instead of another run's.

Sharded checkpoints (`distributed: fsdp`) are folders written by every rank; they are not
copied (a warning says so at start).
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

from visionloop.core.errors import CheckpointError
from visionloop.core.fsutil import TooLargeError, human_bytes
from visionloop.core.objectstore import ObjectStore, ObjectStoreError
from visionloop.core.settings import Settings

log = logging.getLogger(__name__)

_NAME = re.compile(r"^step-(\d{9,})\.ckpt$")
_KEY_SEGMENT = re.compile(r"[^A-Za-z0-9._=+@-]")
# Room left on local disk after a download: a checkpoint that would fill the disk would only
# fail the next write, the log or the final weights.
DISK_MARGIN = 256 << 20


def run_key(run_dir: Path, home: Path) -> str:
    """Where a run's checkpoints live in the store: its folder under the home, else its
    absolute path, as store-safe segments."""
    path = run_dir.expanduser().resolve()
    try:
        parts = path.relative_to(home.expanduser().resolve()).parts
    except ValueError:
        parts = ("abs", *path.parts[1:])
    return "/".join(_KEY_SEGMENT.sub("_", p) or "_" for p in parts if p not in ("", ".", ".."))


class CheckpointStore:
    """The store's copy of one run's checkpoints (single-file format, checkpoint.py)."""

    def __init__(self, store: ObjectStore, key: str) -> None:
        self.store = store
        self.folder = f"{key}/checkpoints"
        self.failures = 0  # syncs that failed (each is retried by the next)
        # What this process knows the store holds: name -> sha256. A name alone says nothing:
        # a run resumed from an older checkpoint writes the same step's file again, with
        # other contents and very likely the same size.
        self.copied: dict[str, str] = {}
        self.fetched: set[str] = set()  # names downloaded by this process (said at resume)

    @classmethod
    def for_run(cls, settings: Settings, run_dir: Path, fingerprint: str) -> CheckpointStore | None:
        """The store copy of the run in `run_dir` with spec `fingerprint`, if the settings
        name a store (None otherwise)."""
        if not settings.checkpoint_store:
            return None
        store = ObjectStore.from_uri(settings.checkpoint_store, endpoint_url=settings.s3_endpoint_url)
        return cls(store, f"{run_key(run_dir, settings.home)}/{fingerprint[:16]}")

    def uri(self, name: str = "") -> str:
        return self.store.uri(f"{self.folder}/{name}" if name else self.folder)

    def listing(self) -> dict[int, tuple[str, int]]:
        """The store's checkpoints: step -> (name, size). Other objects are ignored."""
        found: dict[int, tuple[str, int]] = {}
        for name, size in self.store.list(self.folder).items():
            if m := _NAME.match(name):
                found[int(m.group(1))] = (name, size)
        return found

    def sync(self, kept: Sequence[tuple[Path, str]]) -> None:
        """Make the store hold exactly the checkpoints in `kept` (local file, sha256): upload
        those it lacks, holds at another size (a copy cut short) or this process has not
        copied itself, then delete the others. Never raises: a failure is logged, and the
        next sync tries again."""
        try:
            remote = {name: size for name, size in self.store.list(self.folder).items() if _NAME.match(name)}
            for path, sha256 in kept:
                same_size = remote.get(path.name) == path.stat().st_size
                if same_size and path.name not in self.copied and self._remote_sha256(path.name) == sha256:
                    self.copied[path.name] = sha256  # copied by an earlier process of this run
                if not same_size or self.copied.get(path.name) != sha256:
                    self.copied.pop(path.name, None)
                    self.store.put(path, f"{self.folder}/{path.name}")
                    self.copied[path.name] = sha256
            keep = {p.name for p, _ in kept}
            for name in remote:
                if name not in keep:
                    self.store.delete(f"{self.folder}/{name}")
                    self.copied.pop(name, None)
        except (ObjectStoreError, OSError) as e:
            self.failures += 1
            log.warning(
                "could not copy checkpoints to %s: %s The checkpoints are safe on local disk; the "
                "next checkpoint tries again.",
                self.uri(),
                e,
            )

    def _remote_sha256(self, name: str) -> str | None:
        """The checksum in the trailer of the store's copy of `name` (a few KiB read from its
        end), or None if it has none that parses."""
        from visionloop.train.checkpoint import read_trailer  # it imports this module

        try:
            with self.store.open(f"{self.folder}/{name}") as f:
                return str(read_trailer(f, name)[0]["sha256"])
        except (CheckpointError, ObjectStoreError, OSError) as e:
            log.info("reading the trailer of %s: %s (uploading it again)", self.uri(name), e)
            return None

    def missing(self, local_steps: Iterable[int], directory: Path) -> dict[int, tuple[str, int]]:
        """The store's checkpoints that local disk (`directory`) lacks: step -> (name, size);
        not one set aside there as corrupt (`*.corrupt`), which would only be set aside
        again. A store that cannot be listed stops the resume (CheckpointError): starting
        from an older checkpoint, or from scratch, would then replace the store's newer ones
        at the next checkpoint."""
        try:
            listing = self.listing()
        except ObjectStoreError as e:
            raise CheckpointError(
                f"cannot look for this run's checkpoints in {self.uri()}: {e} Rerun once the "
                "store is reachable; to resume from local disk only, unset checkpoint_store."
            ) from e
        have = set(local_steps)
        return {
            step: (name, size)
            for step, (name, size) in listing.items()
            if step not in have and not (directory / f"{name}.corrupt").exists()
        }

    def fetch(self, step: int, name: str, size: int, directory: Path, max_bytes: int) -> Path:
        """Download checkpoint `name` into `directory` (the run's checkpoints folder), under
        its own name once complete; CheckpointError if the store fails, or it is larger than
        `max_bytes` (this machine's memory) or the local disk's room."""
        directory.mkdir(parents=True, exist_ok=True)
        try:
            room = shutil.disk_usage(directory).free - DISK_MARGIN
            if size > room:
                raise ObjectStoreError(
                    f"cannot download {self.uri(name)}: it is {size / 2**30:.2f} GiB and {directory} "
                    f"has {max(room, 0) / 2**30:.2f} GiB free (less a {human_bytes(DISK_MARGIN)} margin). "
                    "Free disk space, then rerun to resume."
                )
            target = directory / name
            self.store.get(
                f"{self.folder}/{name}",
                target,
                max_bytes=max_bytes,
                what="a checkpoint on this machine (its memory)",
                size=size,
            )
        except TooLargeError as e:
            raise CheckpointError(
                f"cannot load checkpoint {self.uri(name)}: it is {(e.size or 0) / 2**30:.1f} GiB, "
                f"more than this machine's memory ({e.limit / 2**30:.1f} GiB). Resume on a machine with "
                "more memory."
            ) from e
        except ObjectStoreError as e:
            raise CheckpointError(
                f"cannot download checkpoint {name} (step {step}): {e} Rerun once it can be downloaded."
            ) from e
        log.info("downloaded %s (step %d) from %s", name, step, self.uri())
        self.fetched.add(name)
        return target
