"""The control plane's body limit and authentication over real HTTP on loopback: a request
with a body is authenticated before any of it is read, and the 1 MiB limit holds on the bytes
actually received, chunked bodies (no Content-Length) included.

The client is a raw socket that streams a chunked body and stops as soon as an answer comes
back (or the server closes the connection); what it managed to send bounds what the server
read. Loopback socket buffers hold a few MiB, so "bounded" here is far below the upload's size.
"""

from __future__ import annotations

import select
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from _cpkit import CP, TEAMS, cluster_config, control_plane
from _dbkit import fresh_database

MiB = 1024 * 1024
UPLOAD = 50 * MiB
# What may sit in the client's send buffer and the server's receive buffer when the answer
# comes back (Linux loopback autotunes them to a few MiB each).
IN_FLIGHT = 16 * MiB


@pytest.fixture
def cp(tmp_path: Path) -> Iterator[CP]:
    tmp = tmp_path
    cfg = cluster_config(
        inventory=[{"node": "local", "type": "fake", "count": 1, "price_class": "owned"}], teams=TEAMS
    )
    with fresh_database("sqlite", tmp) as url, control_plane(url, cfg, run_scheduler=False) as plane:
        yield plane


def _chunked_upload(cp: CP, token: str | None, total: int = UPLOAD) -> tuple[int, bytes, int, bool]:
    """POST /v1/jobs with a chunked body of `total` bytes → (status, body, bytes sent, whether
    the server closed the connection after answering)."""
    port = int(cp.url.rsplit(":", 1)[1])
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = (
        "POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Transfer-Encoding: chunked\r\n{auth}\r\n"
    )
    piece = b"x" * 65536
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode())
        try:
            while sent < total:
                readable, _, _ = select.select([sock], [], [], 0)
                if readable:  # the server answered: a real client stops sending here
                    break
                sock.sendall(frame)
                sent += len(piece)
            else:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while we were still sending
        raw = b""
        closed = False
        try:
            while b"\r\n\r\n" not in raw or len(raw.split(b"\r\n\r\n", 1)[1]) < _length(raw):
                data = sock.recv(65536)
                if not data:
                    closed = True
                    break
                raw += data
            if not closed:
                closed = sock.recv(65536) == b""
        except ConnectionResetError:
            closed = True
    status = int(raw.split(b" ", 2)[1])
    return status, raw.split(b"\r\n\r\n", 1)[1], sent, closed


def _length(raw: bytes) -> int:
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


@pytest.mark.parametrize("token", [None, "not-a-token"], ids=["no token", "bad token"])
def test_unauthenticated_chunked_upload_is_refused_unread(cp: CP, token: str | None) -> None:
    status, body, sent, closed = _chunked_upload(cp, token)
    assert status == 401, body
    assert b"token" in body
    assert sent < IN_FLIGHT, f"the client sent {sent / MiB:.1f} MiB before the 401"
    assert closed  # the server stops reading what a client goes on sending


def test_authenticated_chunked_upload_over_the_limit_gets_413(cp: CP) -> None:
    status, body, sent, closed = _chunked_upload(cp, cp.admin_token)
    assert status == 413, body
    assert b"over 1048576 bytes" in body
    assert sent < IN_FLIGHT, f"the client sent {sent / MiB:.1f} MiB before the 413"
    assert closed


def test_bodies_within_the_limit_still_work(cp: CP) -> None:
    # Chunked and under the limit: read whole and validated, for the principal the middleware
    # found (an admin token, then a team token).
    json_type = {"Content-Type": "application/json"}
    team = cp.team_token(str(TEAMS[0]["name"]))
    for token in (cp.admin_token, team):
        with cp.client(token) as c:
            r = c.post("/v1/jobs", content=iter([b'{"spec": {}, ', b'"nope": 1}']), headers=json_type)
            assert r.status_code == 422 and "nope" in r.json()["detail"], r.text
            r = c.post("/v1/jobs", content=b"x" * (MiB + 1), headers=json_type)
            assert r.status_code == 413
            assert c.get("/v1/jobs").status_code == 200
    with httpx.Client(base_url=cp.url) as anon:
        r = anon.post("/v1/jobs", json={"spec": {}})
        assert r.status_code == 401 and "missing bearer token" in r.json()["detail"]
        assert r.headers["www-authenticate"] == "Bearer"
        assert anon.get("/v1/health").status_code == 200
