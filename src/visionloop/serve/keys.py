"""API keys of the inference server: made by `visionloop serve keys create`, checked per request.

A key is `vlk_<id>_<secret>`: `id` (8 hex digits) finds its record, `secret` (32 random
bytes, base64url) is the credential. Only a salted SHA-256 of the whole key is stored (a
random 256-bit secret needs no slow hash: nobody can guess it, and the salt keeps equal keys
from having equal hashes), in `<home>/serve/keys.json`, written atomically and owner-only
(0600) from the first byte, in an owner-only folder. Hashes are compared with
`hmac.compare_digest`.

Each key names the models it may use (`*`: all) and its scopes: `read` (inference and
metadata: every key has it) and `routing` (changing canary, shadow or rollback through
`serve.routing`'s endpoints, which check it).

The server reloads the file when it changes (inode, mtime or size; checked at most every
`poll_s`, in a worker thread: a slow disk or a large file never holds the event loop), so
`visionloop serve keys revoke` takes effect without a restart. A file that cannot be read on
reload denies every key (fail closed) until it can.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from visionloop.core.errors import ConfigError, NotFoundError
from visionloop.core.fsutil import TooLargeError, atomic_write_text, ensure_private_dir, read_capped_text

log = logging.getLogger(__name__)

KEYS_FILE: Final = Path("serve") / "keys.json"
PREFIX: Final = "vlk_"
READ: Final = "read"
ROUTING: Final = "routing"
ALL_MODELS: Final = "*"
# Thousands of keys fit in this; the server and every `serve keys` call read it whole.
MAX_KEYS_FILE_BYTES = 16 * 2**20
_KEY = re.compile(r"vlk_(?P<id>[0-9a-f]{8})_[A-Za-z0-9_-]{43}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def keys_path(home: Path) -> Path:
    return home / KEYS_FILE


@dataclass(frozen=True)
class ApiKey:
    """One key's record (never the key itself)."""

    name: str
    id: str
    salt: str  # hex
    hash: str  # hex sha256(salt || key)
    models: tuple[str, ...]
    scopes: tuple[str, ...] = (READ,)
    created_at: float = field(default=0.0, compare=False)

    def covers(self, model: str) -> bool:
        return ALL_MODELS in self.models or model in self.models

    @property
    def all_models(self) -> bool:
        return ALL_MODELS in self.models

    def allows(self, scope: str) -> bool:
        return scope in self.scopes

    def matches(self, key: str) -> bool:
        return hmac.compare_digest(_digest(bytes.fromhex(self.salt), key), self.hash)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "id": self.id,
            "salt": self.salt,
            "hash": self.hash,
            "models": list(self.models),
            "scopes": list(self.scopes),
            "created_at": self.created_at,
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> ApiKey:
        return cls(
            name=str(doc["name"]),
            id=str(doc["id"]),
            salt=str(doc["salt"]),
            hash=str(doc["hash"]),
            models=tuple(str(m) for m in doc["models"]),
            scopes=tuple(str(s) for s in doc.get("scopes", [READ])),
            created_at=float(doc.get("created_at", 0.0)),
        )


def _digest(salt: bytes, key: str) -> str:
    return hashlib.sha256(salt + key.encode("utf-8")).hexdigest()


def _read(path: Path) -> list[ApiKey]:
    """The keys in `path` ([] if it does not exist); raises ConfigError if it is unreadable."""
    damaged = (
        f"the API keys file {path} is damaged ({{}}); move it away and create the keys again with "
        "`visionloop serve keys create`."
    )
    try:
        # Capped, and a FIFO in its place refused: the server reads it at start and on change.
        text = read_capped_text(path, MAX_KEYS_FILE_BYTES, what="an API keys file")
    except FileNotFoundError:
        return []
    except OSError as e:
        raise ConfigError(f"cannot read the API keys file {path}: {e}") from e
    except TooLargeError as e:
        raise ConfigError(f"{e}: it holds only API key records (a few hundred bytes each)") from e
    except UnicodeDecodeError as e:  # NotTextError
        raise ConfigError(damaged.format(f"not UTF-8: {e.reason} at byte {e.start}")) from e
    try:
        doc = json.loads(text)
        return [ApiKey.from_json(k) for k in doc["keys"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(damaged.format(f"{type(e).__name__}: {e}")) from e


class KeyStore:
    """The keys file, as the CLI edits it (a lock serializes concurrent edits)."""

    def __init__(self, home: Path) -> None:
        self.path = keys_path(home)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        ensure_private_dir(self.path.parent.parent)
        ensure_private_dir(self.path.parent)
        fd = os.open(self.path.with_name(".keys.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _write(self, keys: list[ApiKey]) -> None:
        doc = {"version": 1, "keys": [k.to_json() for k in keys]}
        atomic_write_text(self.path, json.dumps(doc, indent=2) + "\n", mode=0o600)

    def keys(self) -> list[ApiKey]:
        return _read(self.path)

    def create(self, name: str, models: list[str], routing: bool = False) -> tuple[ApiKey, str]:
        """A new key for `models` (`*`: all); returns its record and the key (shown once)."""
        if not _NAME.fullmatch(name):
            raise ConfigError(
                f"invalid key name {name!r}: use letters, digits, '.', '_' or '-' (at most 64), "
                "e.g. `frontend-prod`."
            )
        models = [m.strip() for m in models if m.strip()]
        if not models:
            raise ConfigError("name the models the key may use: --models digits,pets (or --models '*').")
        bad = [m for m in models if m != ALL_MODELS and not _NAME.fullmatch(m)]
        if bad:
            raise ConfigError(f"invalid model name(s) {bad}; e.g. --models digits,pets or --models '*'.")
        with self._locked():
            keys = _read(self.path)
            if any(k.name == name for k in keys):
                raise ConfigError(
                    f"a key named {name!r} exists; revoke it first (`visionloop serve keys revoke {name}`) "
                    "or pick another name."
                )
            ids = {k.id for k in keys}
            key_id = secrets.token_hex(4)
            while key_id in ids:
                key_id = secrets.token_hex(4)
            secret = base64.urlsafe_b64encode(secrets.token_bytes(32)).decode().rstrip("=")
            key = f"{PREFIX}{key_id}_{secret}"
            salt = secrets.token_bytes(16)
            record = ApiKey(
                name=name,
                id=key_id,
                salt=salt.hex(),
                hash=_digest(salt, key),
                models=tuple(dict.fromkeys(models)),
                scopes=(READ, ROUTING) if routing else (READ,),
                created_at=time.time(),
            )
            self._write([*keys, record])
        return record, key

    def revoke(self, name: str) -> ApiKey:
        with self._locked():
            keys = _read(self.path)
            gone = next((k for k in keys if k.name == name), None)
            if gone is None:
                known = ", ".join(k.name for k in keys) or "none"
                raise NotFoundError(f"no API key named {name!r} (keys: {known}).")
            self._write([k for k in keys if k.name != name])
        return gone


class KeyRing:
    """The keys the server checks requests against, reloaded when the file changes."""

    def __init__(self, path: Path, poll_s: float = 1.0) -> None:
        self.path = path
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._by_id: dict[str, ApiKey] = {}
        self._stamp: tuple[int, int, int] | None = None
        self._checked = float("-inf")
        self._reload(self._stat())  # a damaged file at start-up is an error, not a silent deny

    @classmethod
    def for_home(cls, home: Path, poll_s: float = 1.0) -> KeyRing:
        return cls(keys_path(home), poll_s)

    def __len__(self) -> int:
        self._maybe_reload()
        return len(self._by_id)

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _reload(self, stamp: tuple[int, int, int] | None) -> None:
        keys = _read(self.path)
        self._by_id = {k.id: k for k in keys}
        self._stamp = stamp

    def reload_due(self) -> bool:
        """Whether `maybe_reload` would look at the file now (`poll_s` has passed)."""
        return time.monotonic() - self._checked >= self.poll_s

    def maybe_reload(self) -> None:
        """Reload the file if it changed (checked at most every `poll_s`). File I/O: the
        server runs it in a worker thread (`serve.app.ServeApp`), never on the event loop."""
        self._maybe_reload()

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.poll_s:
            return
        with self._lock:
            if now - self._checked < self.poll_s:
                return
            self._checked = now
            try:
                stamp = self._stat()
            except OSError as e:  # e.g. the folder's permissions changed: fail closed
                log.error("cannot stat the API keys file %s (%s); every API key is refused", self.path, e)
                self._by_id = {}
                self._stamp = None
                return
            if stamp == self._stamp:
                return
            try:
                self._reload(stamp)
            except ConfigError as e:
                log.error("%s; every API key is refused until it is fixed", e)
                self._by_id = {}
                self._stamp = stamp
            else:
                log.info("API keys reloaded from %s: %d key(s)", self.path, len(self._by_id))

    def authenticate(self, key: str) -> ApiKey | None:
        """The record of a valid key, or None, after reloading the file if it is due."""
        self._maybe_reload()
        return self.lookup(key)

    def lookup(self, key: str) -> ApiKey | None:
        """The record of a valid key among those loaded, or None: no file I/O, so the event
        loop may call it (a hash and a dict lookup)."""
        m = _KEY.fullmatch(key)
        if m is None:
            return None
        record = self._by_id.get(m["id"])
        if record is None or not record.matches(key):
            return None
        return record
