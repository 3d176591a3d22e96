"""Sharded checkpoints (`distributed: fsdp`): directories written by every rank through
`torch.distributed.checkpoint` (DCP), held to the same rules as the single-file ones.

Layout of `checkpoints/step-000001234.dcp/`::

    .metadata, __<rank>_<n>.distcp   DCP's files: every rank writes its own shards
    trainer.pt                       the rest of the state (position, scheduler, every rank's RNG,
                                     spec hash, ...), written by rank 0, read with weights_only
    manifest.json                    written last: format, step, metric, world size, and the size
                                     and sha256 of every other file

- **Atomic**: everything is written into `.step-000001234.dcp.tmp/` and the directory is renamed
  when complete, so a directory under its final name was whole when it got it. Replacing a
  checkpoint of the same step renames the old one to `*.old` first and deletes it after; a
  crash in between is repaired on the next start.
- **Verified before trusted**: every file in the manifest must have its size and sha256;
  otherwise the directory is set aside (`*.corrupt`) and the previous checkpoint is used.
- **No unpickling of what is on disk**: DCP reads its `.metadata` with `pickle.load` and
  non-tensor values with `torch.load(weights_only=False)`. This module reads the first with
  an unpickler that can build only DCP's metadata classes, and the second with
  `weights_only=True`.
- **Pruned** by the same keep_last / keep_best policy.

Writing is collective (every rank writes its shards; the loop waits for that); rank 0 then
hashes the files, writes the manifest and renames the directory on a writer thread, as the
single-file manager does. DCP needs every rank to see the same directory: on several nodes the
run directory must be on a filesystem they share.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from visionloop.core.errors import CheckpointError
from visionloop.core.fsutil import (
    NotRegularFileError,
    TooLargeError,
    atomic_write_bytes,
    fsync_dir,
    open_regular,
    read_capped,
)
from visionloop.train import dist
from visionloop.train.checkpoint import CheckpointInfo, _ManagerBase

log = logging.getLogger(__name__)

FORMAT = "visionloop-dcp-1"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.pt"
_NAME = re.compile(r"^step-(\d{9,})\.dcp$")
_HASH_CHUNK = 16 << 20
# What this module puts in DCP; everything else of the loop's state goes to trainer.pt.
SHARDED_KEYS = ("model", "optimizer")
# Read whole: DCP's metadata (sizes and offsets of every chunk) and the trainer state (position,
# scheduler, RNG of every rank) are small beside the shards.
MAX_METADATA_BYTES = 1 << 30
MAX_TRAINER_STATE_BYTES = 1 << 30
_SHA256 = re.compile(r"[0-9a-f]{64}")


def checkpoint_dir_name(step: int) -> str:
    return f"step-{step:09d}.dcp"


def is_sharded_checkpoint(path: Path) -> bool:
    return path.is_dir() and _NAME.match(path.name) is not None


# ----------------------------------------------------------------------------- safe reading


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's `.metadata` (dataclasses of sizes, dtypes and file offsets) and nothing
    else: any other global in the stream is refused, so a crafted file cannot run code."""

    _ALLOWED: ClassVar[dict[str, set[str]]] = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "BytesStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
        "collections": {"OrderedDict"},
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in self._ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's DCP metadata")


def _safe_reader(directory: Path, files: Mapping[str, int] | None = None) -> Any:
    """A DCP reader of `directory` that unpickles nothing but DCP's metadata classes. With
    `files` (name: size, from the verified manifest), the metadata may point only into those
    files, within their sizes: a crafted one must not make DCP read outside the checkpoint
    (`../../secret`, an absolute path) or from a file nobody verified (an extra FIFO)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            try:
                raw = read_capped(Path(self.path) / ".metadata", MAX_METADATA_BYTES, what="DCP metadata")
            except (NotRegularFileError, TooLargeError) as e:
                raise CheckpointError(f"{directory.name}: unusable DCP metadata ({e})") from e
            try:
                metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError) as e:
                raise CheckpointError(f"{directory.name}: unreadable DCP metadata ({e})") from e
            except Exception as e:  # garbage makes the unpickler fail in many ways (KeyError, ...)
                raise CheckpointError(
                    f"{directory.name}: unreadable DCP metadata ({type(e).__name__}: {str(e)[:200]})"
                ) from e
            if not isinstance(metadata, Metadata):
                raise CheckpointError(f"{directory.name}: the DCP metadata is a {type(metadata).__name__}")
            if files is not None:
                _check_storage(directory, metadata, files)
            storage_meta = metadata.storage_meta or StorageMeta()
            storage_meta.load_id = self.load_id
            metadata.storage_meta = storage_meta
            return metadata

    return SafeReader(str(directory))


def _check_storage(directory: Path, metadata: Any, files: Mapping[str, int]) -> None:
    """Every chunk DCP's metadata names lies in a shard file of the manifest, within its size,
    stored as written (no transforms: a compressed chunk could be a decompression bomb)."""
    shards = {n: size for n, size in files.items() if n not in (".metadata", TRAINER_STATE, MANIFEST)}
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, Mapping):
        raise CheckpointError(f"{directory.name}: the DCP metadata has no storage table")
    for where in storage.values():
        name = getattr(where, "relative_path", None)
        offset, length = getattr(where, "offset", None), getattr(where, "length", None)
        problem = None
        if not isinstance(name, str) or name not in shards:
            problem = f"points into {name!r:.80}, not a shard file of its manifest"
        elif not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
            problem = f"gives {name} a bad offset or length ({offset!r:.20}, {length!r:.20})"
        elif offset + length > shards[name]:  # type: ignore[operator]
            problem = f"reads past the end of {name}"
        elif getattr(where, "transform_descriptors", None):
            problem = f"asks for transforms {where.transform_descriptors!r:.80} of {name}"
        if problem:
            raise CheckpointError(f"{directory.name}: the DCP metadata {problem}; the checkpoint is damaged")


def _safe_planner() -> Any:
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafePlanner(DefaultLoadPlanner):
        """DCP's default planner, loading non-tensor values (learning rates, betas) with
        weights_only=True; and every key the run needs must be in the checkpoint (a silently
        half-loaded model would be a silent restart)."""

        def __init__(self) -> None:
            super().__init__(allow_partial_load=False)

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            value.seek(0)
            safe = io.BytesIO(value.read())
            obj = torch.load(safe, map_location="cpu", weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafePlanner()


def dcp_load(state: dict[str, Any], directory: Path) -> None:
    """`dcp.load` into `state` (in place) with the safe reader and planner. Collective."""
    import torch.distributed as tdist
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    no_dist = not (tdist.is_available() and tdist.is_initialized())  # one process: said, not guessed
    reader = _safe_reader(directory, _file_sizes(read_manifest(directory)))
    reader.read_metadata()  # a damaged one is refused here in its own words, not as a DCP failure
    try:
        with _one_process_is_intended():
            load(state, storage_reader=reader, planner=_safe_planner(), no_dist=no_dist)
    except CheckpointException as e:  # a BaseException: raised on every rank, with each one's failure
        raise CheckpointError(
            f"{directory.name}: its shards do not load into this run's model and optimizer "
            f"({_first_failure(e)}). It was written by another version of visionloop or another spec; "
            f"train into a new --run-dir."
        ) from e


@contextlib.contextmanager
def _one_process_is_intended() -> Iterator[None]:
    # DCP warns on every call without a process group, even when told no_dist=True.
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def _first_failure(e: BaseException) -> str:
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, err = sorted(failures.items())[0]
        text = str(err).strip().splitlines()
        return f"rank {rank}: {type(err).__name__}: {text[-1][:300] if text else ''}"
    return str(e)[:300]


# ----------------------------------------------------------------------------- manifest


def _sha256_file(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open_regular(path) as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _tree_sha256(files: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _expected_shard_files(directory: Path) -> set[str]:
    """The data files DCP's metadata refers to (every rank's shards)."""
    reader = _safe_reader(directory)
    metadata = reader.read_metadata()
    return {str(info.relative_path) for info in metadata.storage_data.values()}


def write_manifest(directory: Path, step: int, metric: float | None, world_size: int) -> dict[str, Any]:
    """Hash every file of a completely written checkpoint directory and write its manifest."""
    needed = _expected_shard_files(directory) | {".metadata", TRAINER_STATE}
    missing = sorted(n for n in needed if not (directory / n).is_file())
    if missing:
        raise CheckpointError(
            f"{directory.name}: {', '.join(missing[:5])} missing after every rank wrote its shards. "
            f"With distributed: fsdp every process writes into the run directory: on several nodes "
            f"it must be on a filesystem they all share."
        )
    files: dict[str, dict[str, Any]] = {}
    for p in sorted(directory.iterdir()):
        if p.is_file() and p.name != MANIFEST:
            sha, size = _sha256_file(p)
            files[p.name] = {"sha256": sha, "size": size}
    manifest = {
        "format": FORMAT,
        "step": step,
        "metric": metric,
        "world_size": world_size,
        "created": time.time(),
        "files": files,
    }
    atomic_write_bytes(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
    return manifest


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory (cheap: its files are not hashed here)."""
    path = directory / MANIFEST
    try:
        raw = read_capped(path, 16 << 20, what="a checkpoint manifest")
    except FileNotFoundError as e:
        raise CheckpointError(f"{directory.name}: no {MANIFEST} (never completed)") from e
    except TooLargeError as e:
        raise CheckpointError(f"{directory.name}: {MANIFEST} is implausibly large") from e
    except NotRegularFileError as e:
        raise CheckpointError(f"{directory.name}: {MANIFEST} {e.strerror}") from e
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested past the parser's depth
        raise CheckpointError(f"{directory.name}: corrupt {MANIFEST} ({str(e)[:200]})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{directory.name}: unsupported checkpoint format {manifest!r:.80}")
    files = manifest.get("files")
    if not isinstance(files, dict) or ".metadata" not in files or TRAINER_STATE not in files:
        raise CheckpointError(f"{directory.name}: the manifest lists no DCP metadata or trainer state")
    for name, entry in files.items():
        if "/" in name or "\0" in name or name in ("", ".", "..", MANIFEST) or not isinstance(entry, dict):
            raise CheckpointError(f"{directory.name}: the manifest names a bad file {name!r:.80}")
        size, sha = entry.get("size"), entry.get("sha256")
        if not _is_count(size) or not isinstance(sha, str) or not _SHA256.fullmatch(sha):
            raise CheckpointError(f"{directory.name}: the manifest's entry for {name!r:.80} is garbled")
    if not _is_count(manifest.get("step")):
        raise CheckpointError(f"{directory.name}: the manifest holds no step")
    metric = manifest.get("metric")
    if not (isinstance(metric, int | float) and not isinstance(metric, bool) and math.isfinite(metric)):
        manifest["metric"] = None  # not a score: ranks no checkpoint as best
    return manifest


def _file_sizes(manifest: Mapping[str, Any]) -> dict[str, int]:
    return {name: int(entry["size"]) for name, entry in manifest["files"].items()}


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def verify(directory: Path) -> dict[str, Any]:
    """Check every file of the manifest (size, then sha256); return the manifest."""
    manifest = read_manifest(directory)
    for name, entry in manifest["files"].items():
        path = directory / name
        if not os.path.lexists(path):
            raise CheckpointError(f"{directory.name}: {name} is missing")
        if path.is_symlink() or not path.is_file():  # DCP writes neither: nothing outside is read
            raise CheckpointError(f"{directory.name}: {name} is not a regular file")
        size = path.stat().st_size
        if size != entry.get("size"):
            raise CheckpointError(
                f"{directory.name}: {name} is {size} bytes, the manifest says {entry.get('size')}"
            )
        try:
            digest = _sha256_file(path)[0]
        except NotRegularFileError as e:  # replaced since the check above
            raise CheckpointError(f"{directory.name}: {name} {e.strerror}") from e
        if digest != entry.get("sha256"):
            raise CheckpointError(f"{directory.name}: checksum mismatch in {name} (the file is corrupt)")
    return manifest


def load_verified_dir(directory: Path) -> dict[str, Any]:
    """Verify a checkpoint directory and return its trainer state, with `dcp_dir` naming the
    directory the loop loads the model and optimizer shards from (collectively)."""
    manifest = verify(directory)
    m = _NAME.match(directory.name)
    if m and int(m.group(1)) != manifest["step"]:
        raise CheckpointError(f"{directory.name}: the manifest says step {manifest['step']}")
    # DCP's metadata too (what it unpickles, where it points): a damaged one is found here, where
    # the previous checkpoint can still be used, not when the shards are loaded.
    _safe_reader(directory, _file_sizes(manifest)).read_metadata()
    # Loaded from the very bytes checked here (verify hashed the file; it may have changed since).
    entry = manifest["files"][TRAINER_STATE]
    try:
        raw = read_capped(directory / TRAINER_STATE, MAX_TRAINER_STATE_BYTES, what="a trainer state")
    except (NotRegularFileError, TooLargeError) as e:
        raise CheckpointError(f"{directory.name}: unusable {TRAINER_STATE} ({e})") from e
    if len(raw) != entry["size"] or hashlib.sha256(raw).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"{directory.name}: {TRAINER_STATE} changed while being read")
    try:
        state = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except (RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"{directory.name}: {TRAINER_STATE} does not unpickle ({e})") from e
    if not isinstance(state, dict):
        raise CheckpointError(f"{directory.name}: {TRAINER_STATE} is not a state dict")
    state["dcp_dir"] = str(directory)
    return state


# ----------------------------------------------------------------------------- manager


def _info(directory: Path, manifest: dict[str, Any], step: int | None = None) -> CheckpointInfo:
    """A checkpoint directory's CheckpointInfo: its "sha256" is that of the manifest's file list,
    its size that of all its files."""
    files = manifest["files"]
    size = sum(int(e.get("size", 0)) for e in files.values())
    at = int(manifest["step"]) if step is None else step
    return CheckpointInfo(directory, at, manifest.get("metric"), _tree_sha256(files), size)


class ShardedCheckpointManager(_ManagerBase):
    """Owns `<run_dir>/checkpoints/` for an FSDP run: the same interface as
    `CheckpointManager`, but `save` is collective (every rank calls it), and `load_latest` and
    `wait` concern rank 0 (the one that verifies and commits checkpoint directories)."""

    def __init__(
        self,
        directory: Path,
        *,
        keep_last: int,
        keep_best: int,
        best_mode: str = "max",
        info: dist.DistInfo,
    ) -> None:
        super().__init__(directory, keep_last=keep_last, keep_best=keep_best, best_mode=best_mode)
        self.info = info

    # ---------------------------------------------------------------- format
    def _step_of(self, path: Path) -> int | None:
        m = _NAME.match(path.name)
        return int(m.group(1)) if m and path.is_dir() else None

    def _read_info(self, path: Path) -> CheckpointInfo:
        return _info(path, read_manifest(path))

    def _load(self, step: int, path: Path) -> tuple[CheckpointInfo, dict[str, Any]]:
        state = load_verified_dir(path)
        return _info(path, read_manifest(path), step), state

    def _delete(self, path: Path) -> None:
        # Renamed first: a deletion cut short must not leave a half directory under a
        # checkpoint's name (it would fail verification and be reported as corrupt).
        doomed = path.with_name(f".{path.name}.tmp")
        path.rename(doomed)
        shutil.rmtree(doomed)

    def remove_stale_temporaries(self) -> None:
        """Directories left by a save that was killed: unfinished ones are deleted; a checkpoint
        set aside to be replaced (`*.old`) whose replacement never landed is put back."""
        if not self.dir.is_dir():
            return
        for p in self.dir.glob(".step-*.dcp.tmp"):
            shutil.rmtree(p, ignore_errors=True)
        for p in self.dir.glob(".step-*.dcp.old"):
            final = self.dir / p.name[1:].removesuffix(".old")
            if final.exists():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.rename(final)

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
        """Collective: every rank writes its shards of `state["model"]` and
        `state["optimizer"]` (None before the optimizer has state); rank 0 writes the rest of
        `state` and commits the directory on the writer thread (`block=True` waits for that)."""
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.filesystem import FileSystemWriter
        from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

        t0 = time.perf_counter()
        self.wait()
        tmp = self.dir / f".{checkpoint_dir_name(step)}.tmp"
        if self.info.is_main:
            self.dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a writer killed at this same step
        dist.barrier(self.info)
        sharded = {k: state[k] for k in SHARDED_KEYS if state.get(k) is not None}
        try:
            with _one_process_is_intended():
                dcp_save(
                    sharded,
                    storage_writer=FileSystemWriter(str(tmp), sync_files=True),
                    no_dist=not self.info.enabled,
                )
        except (OSError, RuntimeError, CheckpointException) as e:
            free = shutil.disk_usage(self.dir).free if self.dir.is_dir() else 0
            raise CheckpointError(
                f"writing the sharded checkpoint {tmp.name} failed ({_first_failure(e)}; "
                f"{free / 2**20:.0f} MiB free). Free disk space or fix permissions, then rerun the same "
                f"command to resume from the last good checkpoint."
            ) from e
        if self.info.is_main:
            rest = {k: v for k, v in state.items() if k not in SHARDED_KEYS}
            rest["has_optimizer_state"] = state.get("optimizer") is not None
            with open(tmp / TRAINER_STATE, "wb") as f:
                torch.save(rest, f)
                f.flush()
                os.fsync(f.fileno())
            self.last_stall_s = time.perf_counter() - t0
            self._submit(self._commit, tmp, step, metric, before_commit)
            if block:
                self.wait()
        else:
            self.last_stall_s = time.perf_counter() - t0

    def _commit(
        self, tmp: Path, step: int, metric: float | None, before_commit: Callable[[], object] | None
    ) -> Path:
        t0 = time.perf_counter()
        write_manifest(tmp, step, metric, self.info.world_size)
        fsync_dir(tmp)
        if before_commit is not None:
            before_commit()
        final = self.dir / checkpoint_dir_name(step)
        old = self.dir / f".{final.name}.old"
        if final.exists():  # the same step again (an evaluation after a resume): replace it
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        fsync_dir(self.dir)
        shutil.rmtree(old, ignore_errors=True)
        self._committed(step, t0)
        return final
