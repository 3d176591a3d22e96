"""An object store for what must outlive a machine: an S3-compatible bucket or a folder.

A store is named by a URI: `s3://bucket/prefix` (AWS S3, or any S3-compatible server such as
MinIO, SeaweedFS or Ceph, through `endpoint_url`) or `file:///mnt/nas/vl` (a folder, e.g. a
network share). fsspec does the talking (s3fs for S3, in the `[s3]` extra), so both are one
code path here. Credentials come from the usual AWS chain (AWS_ACCESS_KEY_ID and
AWS_SECRET_ACCESS_KEY, ~/.aws/credentials, an instance role); visionloop never stores them.

What this module adds to fsspec: URIs checked before any request, every call with a time
limit, downloads capped in size and landing under their final name only once complete (and
uploads to a folder too: S3 makes an object visible only once it is whole), and errors that
say what failed and what to do (`ObjectStoreError`), not a botocore traceback.
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from visionloop.core.errors import ConfigError, VisionloopError
from visionloop.core.fsutil import TooLargeError, fsync_dir

# S3's own rules for bucket names (3-63 characters, lowercase letters, digits, dots, hyphens).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SEGMENT = re.compile(r"^[A-Za-z0-9._=+@-]{1,255}$")
MAX_URI = 1024
EXAMPLE = (
    's3://my-bucket/visionloop (or file:///mnt/nas/visionloop), e.g. checkpoint_store = "s3://vl-runs/team-a"'
)


class ObjectStoreError(VisionloopError):
    """A request to the object store failed (unreachable, refused, no such object)."""


@dataclass(frozen=True)
class StoreLocation:
    """A checked store URI: its scheme, and the root every key is under."""

    uri: str
    scheme: str  # "s3" or "file"
    root: str  # "bucket/prefix" for S3, an absolute folder for "file"


def parse_store_uri(uri: str, *, what: str = "checkpoint_store") -> StoreLocation:
    """Check a store URI before any request is made; ConfigError naming what is wrong."""
    bad = f"{what} must be an s3:// or file:// URI, {EXAMPLE}"
    if not isinstance(uri, str) or not uri.strip() or len(uri) > MAX_URI or not uri.isprintable():
        raise ConfigError(f"{bad}; got {str(uri)[:80]!r}.")
    parts = urlsplit(uri.strip())
    if parts.query or parts.fragment:
        raise ConfigError(f"{what}: a store URI has no ?query or #fragment: {uri!r}. {bad}.")
    if parts.scheme == "s3":
        bucket = parts.netloc
        if not _BUCKET.match(bucket) or ".." in bucket:
            raise ConfigError(
                f"{what}: {bucket!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, "
                f"dots and hyphens). {bad}."
            )
        segments = [s for s in parts.path.split("/") if s]
        _check_segments(segments, uri, what)
        return StoreLocation(uri.rstrip("/"), "s3", "/".join([bucket, *segments]))
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise ConfigError(
                f"{what}: a file:// URI names a folder on this machine, not {parts.netloc!r}. {bad}."
            )
        if not parts.path.startswith("/"):
            raise ConfigError(f"{what}: a file:// URI needs an absolute folder (file:///mnt/nas/vl). {bad}.")
        segments = [s for s in parts.path.split("/") if s]
        _check_segments(segments, uri, what)
        return StoreLocation(uri.rstrip("/"), "file", "/" + "/".join(segments))
    raise ConfigError(f"{what}: unsupported scheme {parts.scheme or '(none)'!r}. {bad}.")


def _check_segments(segments: list[str], uri: str, what: str) -> None:
    for s in segments:
        if s in (".", "..") or not _SEGMENT.match(s):
            raise ConfigError(
                f"{what}: the path segment {s[:60]!r} of {uri!r} is not allowed (letters, digits "
                f"and ._=+@- only, no '..'). E.g. {EXAMPLE}."
            )


def check_key(key: str) -> str:
    """A key under the store's root: relative, '/'-separated segments, no '..'."""
    segments = key.split("/")
    if not key or any(s in (".", "..") or not _SEGMENT.match(s) for s in segments):
        raise ValueError(f"not a store key: {key[:120]!r}")
    return key


class ObjectStore:
    """One store: list, put, get and delete objects under its root, each call with a limit.

    Keys are relative paths ("runs/job-3/checkpoints/step-000000100.ckpt"); listings are of
    one "folder" at a time. Thread-safe as fsspec's file systems are."""

    def __init__(
        self,
        location: StoreLocation,
        *,
        endpoint_url: str | None = None,
        timeout_s: float = 30.0,
        attempts: int = 3,
    ) -> None:
        self.location = location
        self.endpoint_url = endpoint_url
        self.fs: Any
        if location.scheme == "s3":
            try:
                import s3fs
            except ImportError:
                raise ConfigError(
                    f"{location.uri} is an S3 store, which needs s3fs: pip install 'visionloop[s3]'"
                ) from None
            # Only the client's own time limits and retries: fsspec's would add up behind them.
            self.fs = s3fs.S3FileSystem(
                client_kwargs={"endpoint_url": endpoint_url} if endpoint_url else {},
                config_kwargs={
                    "connect_timeout": min(timeout_s, 10.0),
                    "read_timeout": timeout_s,
                    "retries": {"max_attempts": attempts, "mode": "standard"},
                },
                skip_instance_cache=True,
                use_listings_cache=False,
            )
        else:
            import fsspec

            self.fs = fsspec.filesystem("file")

    @classmethod
    def from_uri(
        cls, uri: str, *, endpoint_url: str | None = None, what: str = "checkpoint_store"
    ) -> ObjectStore:
        return cls(parse_store_uri(uri, what=what), endpoint_url=endpoint_url)

    def uri(self, key: str = "") -> str:
        return f"{self.location.uri}/{key}" if key else self.location.uri

    def _path(self, key: str) -> str:
        return f"{self.location.root}/{check_key(key)}"

    def _fail(self, op: str, key: str, e: BaseException) -> ObjectStoreError:
        name = type(e).__name__
        text = str(e).splitlines()[0][:300] if str(e) else name
        if name in ("NoCredentialsError", "PartialCredentialsError"):
            fix = (
                "give credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or ~/.aws/credentials "
                "(for a queue job, allow-list the variables in cluster.toml's [jobs] env_allow)"
            )
        elif isinstance(e, PermissionError) or "AccessDenied" in text or "Forbidden" in text:
            fix = "check that the credentials may read and write there"
        elif "NoSuchBucket" in text or "bucket does not exist" in text.lower():
            fix = "create the bucket first, or fix the bucket name"
        else:
            where = f" at {self.endpoint_url}" if self.endpoint_url else ""
            fix = f"check that the store{where} is reachable, then retry"
        return ObjectStoreError(f"{op} {self.uri(key)} failed ({name}: {text}); {fix}.")

    def list(self, folder: str) -> dict[str, int]:
        """The objects directly under `folder`: name -> size in bytes ({} if there are none)."""
        path = self._path(folder)
        try:
            entries = self.fs.ls(path, detail=True, refresh=True)
        except FileNotFoundError:
            return {}
        except Exception as e:
            raise self._fail("listing", folder, e) from e
        found: dict[str, int] = {}
        for entry in entries:
            if entry.get("type") != "file":
                continue
            name = str(entry["name"]).rstrip("/").rsplit("/", 1)[-1]
            found[name] = int(entry.get("size") or 0)
        return found

    def put(self, local: Path, key: str) -> None:
        """Upload `local` as `key`. It appears whole or not at all: S3 shows an object only
        once its upload completes; in a folder it is copied under a temporary name first."""
        path = self._path(key)
        try:
            if self.location.scheme == "s3":
                self.fs.put_file(str(local), path)
                return
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
            try:
                self.fs.put_file(str(local), str(tmp))
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                tmp.replace(target)
                fsync_dir(target.parent)
            finally:
                tmp.unlink(missing_ok=True)
        except Exception as e:
            raise self._fail("uploading to", key, e) from e

    def get(self, key: str, local: Path, *, max_bytes: int, what: str, size: int | None = None) -> None:
        """Download `key` to `local`, which appears only once the download is complete.
        TooLargeError, before anything is fetched, if the object is larger than `max_bytes`,
        the limit for `what` (`size`: its size from a listing, saving a request)."""
        path = self._path(key)
        tmp = local.with_name(f".{local.name}.{uuid.uuid4().hex[:8]}.download")
        try:
            if size is None:
                size = int(self.fs.info(path).get("size") or 0)
            if size > max_bytes:
                raise TooLargeError(self.uri(key), max_bytes, what, size=size)
            local.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(path, str(tmp))
            got = tmp.stat().st_size
            if got > max_bytes:  # it grew since it was listed
                raise TooLargeError(self.uri(key), max_bytes, what, size=got)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            tmp.replace(local)
            fsync_dir(local.parent)
        except TooLargeError:
            raise
        except Exception as e:
            raise self._fail("downloading", key, e) from e
        finally:
            tmp.unlink(missing_ok=True)

    def open(self, key: str, *, block_size: int = 64 << 10) -> Any:
        """`key` opened for reading, seekable, fetched `block_size` bytes at a time (ranged
        requests on S3: reading a file's end does not download the file)."""
        try:
            if self.location.scheme == "s3":
                return self.fs.open(self._path(key), "rb", block_size=block_size, cache_type="bytes")
            return self.fs.open(self._path(key), "rb")
        except Exception as e:
            raise self._fail("opening", key, e) from e

    def delete(self, key: str) -> None:
        """Remove `key`; one already gone is not an error."""
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            return
        except Exception as e:
            raise self._fail("deleting", key, e) from e
