"""The run directory: one training run's home on disk.

    RUN_DIR/
      .lock                 held (flock) by the trainer while it runs
      run.json              uid, status, the spec hash, the MLflow run id
      spec.yaml             the spec as the user wrote it (verbatim)
      spec.resolved.yaml    the effective spec after --set and path resolution
      checkpoints/          step-*.ckpt (see checkpoint.py)
      eval/                 per-epoch evaluation reports and plots
      final.safetensors     the final weights
      model_card.json       what a consumer needs to use them
      train.log             what the trainer printed

Running `visionloop train` again on the same directory resumes it, provided the spec is the
same in every field that affects the result.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import stat
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import yaml

from visionloop.core.errors import TrainingError
from visionloop.core.fsutil import (
    NotRegularFileError,
    TooLargeError,
    atomic_write_json,
    atomic_write_text,
    read_capped_text,
)
from visionloop.core.safeyaml import load_untrusted

# Fields that may change between a run and its resumption: they change how the run is
# executed or recorded, not what it computes.
RESUMABLE_CHANGES = {
    "data.workers",
    "data.eval_batch_size",
    "device",
    "eval.every_epochs",
    "checkpoint.every_steps",
    "checkpoint.every_minutes",
    "checkpoint.keep_last",
    "checkpoint.keep_best",
    "checkpoint.best_metric",
    "checkpoint.best_mode",
    "tracking.enabled",
    "tracking.log_every_steps",
    "tracking.system_metrics_every_s",
}


def _flatten(d: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            yield from _flatten(v, key + ".")
        else:
            yield key, v


def _is_default(dotted: str, value: Any) -> bool:
    """Whether `value` is the train spec's default for the field at `dotted` (False for a
    path the train spec does not have, or a field without a default)."""
    from pydantic import BaseModel

    from visionloop.specs import TrainSpec

    model: Any = TrainSpec
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        field = (
            model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        )
        if field is None:
            return False
        default = field.get_default(call_default_factory=True)
        if i == len(parts) - 1:
            if isinstance(default, BaseModel):
                return False
            return not field.is_required() and bool(default == value)
        model = field.annotation
    return False


def spec_fingerprint(resolved: Mapping[str, Any]) -> str:
    relevant = {k: v for k, v in _flatten(resolved) if k not in RESUMABLE_CHANGES}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()


# run.json holds ids, a status, the final metrics and an error message of at most 2000 characters.
MAX_META_BYTES = 1 << 20
# spec.resolved.yaml is written by the trainer from a spec; read back when a resumed spec differs.
MAX_RESOLVED_SPEC_BYTES = 16 << 20

# What a run writes in its folder after run.json: a folder without run.json holding any of
# them is not a new run's (`RunDir._refuse_foreign_files`).
_RUN_OUTPUTS = ("final.safetensors", "model_card.json", "checkpoints", "eval")


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = Path(path).expanduser().resolve()
        self._lock_file: IO[str] | None = None

    checkpoints = property(lambda self: self.path / "checkpoints")
    eval_dir = property(lambda self: self.path / "eval")
    final_weights = property(lambda self: self.path / "final.safetensors")
    model_card = property(lambda self: self.path / "model_card.json")
    log_file = property(lambda self: self.path / "train.log")
    meta_file = property(lambda self: self.path / "run.json")

    # ------------------------------------------------------------------ locking
    def lock(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            f = self._open_lock_file()
        except TrainingError:
            raise
        except OSError as e:
            reason = "it is a file" if self.path.is_file() else (e.strerror or str(e))
            raise TrainingError(
                f"cannot use {self.path} as the run directory ({reason}). Pass --run-dir a folder "
                f"you can write to (it is created if missing)."
            ) from e
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise TrainingError(
                f"{self.path} is in use by {holder}. Wait for it to finish (or stop it), "
                f"or pass a different --run-dir."
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        f.flush()
        self._lock_file = f

    def _open_lock_file(self) -> IO[str]:
        """`.lock`, opened for writing without following a link (the trainer writes its pid into
        it: a `.lock` that links elsewhere, in a copied or crafted folder, must not have its
        target overwritten) and refused unless it is a regular file (a FIFO, a device)."""
        path = self.path / ".lock"
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o666)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise self._not_a_file(path, "a symbolic link") from e
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise self._not_a_file(path, "not a regular file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "a+")

    def check_own_file(self, path: Path) -> None:
        """Refuse a file of the run's own (train.log) that is a link or not a regular file: the
        trainer appends to it, and would write through a link or wait for ever on a FIFO."""
        if os.path.lexists(path) and not stat.S_ISREG(os.lstat(path).st_mode):
            raise self._not_a_file(path, "a symbolic link" if path.is_symlink() else "not a regular file")

    @staticmethod
    def taken_by_other(path: Path) -> bool:
        """True when something other than a plain folder (a file, a FIFO, a link) is at `path`,
        where the trainer keeps a folder of its own."""
        return os.path.lexists(path) and not stat.S_ISDIR(os.lstat(path).st_mode)

    def check_own_dirs(self) -> None:
        """Refuse checkpoints/ or eval/ that is not a plain folder (a file, a FIFO, a link): the
        run would start, train until its first save or evaluation, and fail there."""
        for path in (self.checkpoints, self.eval_dir):
            if self.taken_by_other(path):
                kind = "a symbolic link" if path.is_symlink() else "not a folder"
                raise TrainingError(
                    f"{path} is {kind}; the trainer keeps its {path.name} there. Remove it, then rerun "
                    f"(nothing else in {self.path} is changed)."
                )

    def _not_a_file(self, path: Path, kind: str) -> TrainingError:
        return TrainingError(
            f"{path} is {kind}; the trainer writes it as its own file. Remove it, then rerun "
            f"(nothing else in {self.path} is changed)."
        )

    @property
    def locked(self) -> bool:
        """True while this process holds the run directory's lock."""
        return self._lock_file is not None

    def unlock(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    # ------------------------------------------------------------------ metadata
    def read_meta(self) -> dict[str, Any] | None:
        """run.json, or None if there is none. Anything else that is not a run's record (a FIFO,
        a huge file, bytes that are not UTF-8 JSON, JSON that is no object or nests without end,
        ids that are not strings) is a TrainingError naming the file and what to do: never None,
        which would make the trainer start the run over and write a new record in its place."""
        if not os.path.lexists(self.meta_file):
            return None
        try:
            meta = json.loads(read_capped_text(self.meta_file, MAX_META_BYTES, what="a run's run.json"))
        except FileNotFoundError:
            return None  # a dangling link: no record
        except (NotRegularFileError, TooLargeError) as e:
            raise self._damaged(str(e)) from e
        except OSError as e:
            raise TrainingError(
                f"{self.meta_file} is unreadable ({e}). Fix access to the run directory, then rerun."
            ) from e
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, nested past the parser's depth
            raise self._damaged(f"not JSON: {str(e)[:200]}") from e
        if not isinstance(meta, dict):
            raise self._damaged(f"a JSON {type(meta).__name__}, not an object")
        for key in ("uid", "spec_sha256", "status", "mlflow_run_id"):
            if key in meta and not isinstance(meta[key], str):
                raise self._damaged(f"its {key} is {meta[key]!r:.40}, not a string")
        return meta

    def _damaged(self, problem: str) -> TrainingError:
        return TrainingError(
            f"{self.meta_file} is damaged ({problem}). Restore it from a copy of the run directory "
            f"to resume this run, or train into a new --run-dir (nothing in this one is changed)."
        )

    def write_meta(self, meta: Mapping[str, Any]) -> None:
        atomic_write_json(self.meta_file, dict(meta))

    def update_meta(self, **fields: Any) -> dict[str, Any]:
        meta = self.read_meta() or {}
        meta.update(fields)
        meta["updated"] = time.time()
        self.write_meta(meta)
        return meta

    def prepare(self, spec_text: str, resolved: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """Create the run's metadata or check that a resumed run uses a compatible spec.

        Returns (meta, resuming). The uid is written here, before any MLflow run exists, so a
        crash at any later point still finds the same tracking run on the next start.
        """
        fingerprint = spec_fingerprint(resolved)
        meta = self.read_meta()
        if meta is None:
            self._refuse_foreign_files(spec_text)
            meta = {
                "uid": uuid.uuid4().hex,
                "created": time.time(),
                "spec_sha256": fingerprint,
                "status": "created",
            }
            atomic_write_text(self.path / "spec.yaml", spec_text)
            atomic_write_text(
                self.path / "spec.resolved.yaml", yaml.safe_dump(dict(resolved), sort_keys=False)
            )
            self.write_meta(meta)
            return meta, False
        if not meta.get("uid"):
            raise self._damaged("it records no uid")
        if meta.get("spec_sha256") != fingerprint:
            if not self._only_new_fields_at_their_defaults(resolved):
                raise TrainingError(self._describe_spec_change(resolved))
            # Made by a release whose train spec lacked fields that this one adds (e.g.
            # `distributed`), all at their defaults, which compute what the old release did.
            meta["spec_sha256"] = fingerprint
            self.write_meta(meta)
        # Allowed changes (workers, device, ...) are recorded so the run directory tells the truth.
        atomic_write_text(self.path / "spec.resolved.yaml", yaml.safe_dump(dict(resolved), sort_keys=False))
        return meta, True

    def _refuse_foreign_files(self, spec_text: str) -> None:
        """A folder without run.json is a new run's: it must not hold files a run writes, or
        the run overwrites them (`train configs/a.yaml --run-dir configs` replaced the folder's
        own spec.yaml). Only a spec.yaml with this very spec is let through: a crash between
        writing it and run.json leaves one, and the rerun must start."""
        clash = [name for name in _RUN_OUTPUTS if (self.path / name).exists()]
        spec = self.path / "spec.yaml"
        if os.path.lexists(spec):
            same = (
                spec.is_file()
                and not spec.is_symlink()
                and spec.stat().st_size <= 2 * len(spec_text.encode()) + 1024
                and spec.read_bytes() == spec_text.encode()
            )
            if not same:
                clash.insert(0, "spec.yaml")
        if clash:
            raise TrainingError(
                f"{self.path} is not a visionloop run directory (it has no run.json) but holds "
                f"{', '.join(clash)}, which a run would overwrite. Pass --run-dir a new or empty "
                "folder, or the folder of the run to resume."
            )

    def _only_new_fields_at_their_defaults(self, resolved: Mapping[str, Any]) -> bool:
        """Whether the spec differs from the one this run started with only in fields the
        old one did not have at all, each at the train spec's default."""
        old_spec = self._read_resolved()
        if old_spec is None:
            return False
        old = dict(_flatten(old_spec))
        new = dict(_flatten(resolved))
        changed = [k for k in set(old) | set(new) if k not in RESUMABLE_CHANGES and old.get(k) != new.get(k)]
        return bool(changed) and all(k not in old and _is_default(k, new.get(k)) for k in changed)

    def _read_resolved(self) -> Mapping[str, Any] | None:
        """The spec.resolved.yaml the run started with, or None if it cannot be used (missing,
        not a regular file, too big, not UTF-8, not YAML, aliases, not a mapping): only the
        explanation of a refused spec change is poorer for it."""
        try:
            text = read_capped_text(
                self.path / "spec.resolved.yaml", MAX_RESOLVED_SPEC_BYTES, what="a resolved spec"
            )
            doc = load_untrusted(text)
        except (OSError, ValueError, yaml.YAMLError):
            return None
        return doc if isinstance(doc, dict) else None

    def _describe_spec_change(self, resolved: Mapping[str, Any]) -> str:
        changed: list[str] = []
        old_spec = self._read_resolved()
        if old_spec is not None:
            old = dict(_flatten(old_spec))
            new = dict(_flatten(resolved))
            for key in sorted(set(old) | set(new)):
                if key not in RESUMABLE_CHANGES and old.get(key) != new.get(key):
                    changed.append(f"{key}: {old.get(key)!r:.80} -> {new.get(key)!r:.80}")
        detail = ("\n  " + "\n  ".join(changed[:10])) if changed else ""
        return (
            f"{self.path} holds a run started with a different spec; resuming it would not reproduce "
            f"that run.{detail}\nUse a new --run-dir for the new spec, or restore the original spec. "
            f"Fields that may change on resume: {', '.join(sorted(RESUMABLE_CHANGES))}."
        )
