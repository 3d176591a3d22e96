"""The control-plane API attacked over real HTTP on loopback, as a hostile or careless client
would: ids and offsets past any store, NUL bytes, malformed and oversized JSON, content-type
lies, request heads sent without end or never finished, and the CLI reading long logs and
long queues. Each answer is a 4xx (or a 503 for a failing store) whose detail names the
problem; none is a 500, a hang or a page of errors.

One control plane for the module (SQLite, no scheduler: jobs and attempts are put in the
store directly), served as `visionloop up` serves it, with a 1 s deadline on request heads;
a second one on PostgreSQL for the NUL-byte checks (its text columns refuse NUL).
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from _cpkit import CP, TEAMS, cluster_config, control_plane, train_doc
from _dbkit import fresh_database, submit_doc
from visionloop.sched.states import JobState

MiB = 1024 * 1024
HEAD_TIMEOUT_S = 1.0
GPUS = [{"node": "local", "type": "fake", "count": 8, "price_class": "owned"}]
JSON = {"Content-Type": "application/json"}


def _plane(backend: str, tmp: Path) -> Iterator[CP]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VISIONLOOP_HOME", str(tmp / "home"))
        cfg = cluster_config(inventory=GPUS, teams=TEAMS)
        with (
            fresh_database(backend, tmp) as url,
            control_plane(url, cfg, run_scheduler=False, head_timeout_s=HEAD_TIMEOUT_S) as plane,
        ):
            yield plane


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CP]:
    yield from _plane("sqlite", tmp_path_factory.mktemp("hostile-sqlite"))


@pytest.fixture(scope="module")
def pg_cp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CP]:
    yield from _plane("postgresql", tmp_path_factory.mktemp("hostile-pg"))


def _job(cp: CP, log: bytes | None = None, team: str = "vision") -> int:
    """A queued job of `team`, straight through the store; with `log`, running, with an
    attempt whose log holds those bytes."""
    doc = train_doc(Path("/nonexistent/dataset"))
    job = submit_doc(cp.plane.store, {"train": doc}, now=time.time(), team=team)
    if log is not None:
        held = {a.gpu_id for att in cp.plane.store.active_attempts() for a in att.allocations}
        gpu = next(g for g in cp.plane.store.list_gpus() if g.id not in held)
        attempt = cp.plane.store.start_attempt(job.id, cp.plane.executor.name, [gpu], now=time.time())
        folder = Path(os.environ["VISIONLOOP_HOME"]).parent / f"attempt-{job.id}"
        folder.mkdir()
        (folder / "log").write_bytes(log)
        handle = {"executor": cp.plane.executor.name, "attempt_dir": str(folder)}
        cp.plane.store.set_attempt_handle(job.id, attempt.number, handle)
    return int(job.id)


def _detail(r: httpx.Response) -> str:
    return str(r.json()["detail"])


# --------------------------------------------------------------------------- ids, offsets


@pytest.mark.parametrize("job_id", [2**31, 2**63, 10**30])
def test_ids_past_any_store_are_a_missing_job_not_a_500(cp: CP, job_id: int) -> None:
    # Before: 500 (SQLite: "Python int too large to convert to SQLite INTEGER"); on
    # PostgreSQL a 422 blaming the database ("integer out of range ... check the database is
    # reachable") with its URL.
    with cp.client(cp.team_token("vision")) as c:
        calls: list[tuple[str, str, dict[str, Any] | None]] = [
            ("GET", f"/v1/jobs/{job_id}", None),
            ("GET", f"/v1/jobs/{job_id}/logs", None),
            ("GET", f"/v1/jobs/{job_id}/evals", None),
            ("POST", f"/v1/jobs/{job_id}/cancel", None),
            ("POST", f"/v1/jobs/{job_id}/resume", {}),
            ("POST", f"/v1/jobs/{job_id}/prune", {}),
        ]
        for method, path, body in calls:
            r = c.request(method, path, json=body)
            assert r.status_code == 404, (path, r.text)
            assert _detail(r) == f"no job {job_id} visible to you; `visionloop jobs list` shows yours."
        assert c.get("/v1/health").status_code == 200


def test_offsets_past_any_store_are_422_naming_the_parameter(cp: CP) -> None:
    job = _job(cp, log=b"hello\n")
    with cp.client() as c:
        for path in ("/v1/jobs", f"/v1/jobs/{job}/logs"):
            r = c.get(path, params={"offset": 2**63})
            assert r.status_code == 422, (path, r.text)
            assert "offset" in _detail(r) and "less than or equal to" in _detail(r)
        # A far but representable offset is past the end: nothing, and where to go on from.
        r = c.get(f"/v1/jobs/{job}/logs", params={"offset": 2**40})
        assert r.status_code == 200 and r.content == b"" and r.headers["X-Next-Offset"] == str(2**40)


def test_another_teams_job_and_log_answer_like_a_missing_one(cp: CP) -> None:
    job = _job(cp, log=b"vision's secret\n", team="vision")
    with cp.client(cp.team_token("research")) as c:
        for method, path in [
            ("GET", f"/v1/jobs/{job}"),
            ("GET", f"/v1/jobs/{job}/logs"),
            ("GET", f"/v1/jobs/{job}/evals"),
            ("POST", f"/v1/jobs/{job}/cancel"),
        ]:
            r = c.request(method, path)
            assert r.status_code == 404 and "secret" not in r.text, (path, r.text)
    assert cp.plane.store.get_job(job).state == JobState.RUNNING  # not cancelled by the other team


# --------------------------------------------------------------------------- NUL, names


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_nul_bytes_and_bad_team_names_are_422_naming_the_field(
    request: pytest.FixtureRequest, backend: str
) -> None:
    cp: CP = request.getfixturevalue("cp" if backend == "sqlite" else "pg_cp")
    tokens_before = len(cp.plane.store.list_tokens())
    version = "a" * 64
    cases: list[tuple[str, str, dict[str, Any] | None, dict[str, Any] | None, str]] = [
        ("POST", "/v1/admin/tokens", {"team": "vision", "label": "ci\x00"}, None, "label"),
        ("POST", "/v1/admin/tokens", {"team": "vi\x00sion"}, None, "team"),
        ("POST", "/v1/admin/spot-interrupt", {"target": "local/0\x00"}, None, "target"),
        ("POST", "/v1/admin/spot-restore", {"target": "\x00"}, None, "target"),
        ("GET", "/v1/jobs", None, {"team": "vision\x00"}, "team"),
        ("GET", "/v1/cost", None, {"team": "../vision"}, "team"),
        ("POST", "/v1/jobs", {"spec": {}, "idempotency_key": "k\x00"}, None, "idempotency_key"),
        (
            "POST",
            "/v1/cost/labelling",
            {
                "dataset_version": version,
                "dataset_path": "/d\x00",
                "images": 1,
                "cost": 1.0,
                "team": "vision",
            },
            None,
            "dataset_path",
        ),
    ]
    with cp.client() as c:
        for method, path, body, params, field in cases:
            r = c.request(method, path, json=body, params=params)
            assert r.status_code == 422, (path, body, params, r.text)
            detail = _detail(r)
            assert field in detail and ("NUL" in detail or "not a team name" in detail), detail
            assert "job store" not in detail
    assert len(cp.plane.store.list_tokens()) == tokens_before  # no token was made


def test_a_failing_store_is_a_503_that_does_not_show_its_url(cp: CP, monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlalchemy.exc import OperationalError

    from visionloop.core.errors import StoreError

    def broken(*_a: Any, **_k: Any) -> Any:
        # What the store raises when its database fails (StoreBase._session).
        cause = OperationalError("SELECT ...", {}, Exception("disk I/O error"))
        raise StoreError(f"the job store at {cp.plane.store.url} failed: disk I/O error.") from cause

    monkeypatch.setattr(cp.plane.store, "list_jobs", broken)
    with cp.client(cp.team_token("vision")) as c:
        r = c.get("/v1/jobs")
    # Before: 422 (a client's mistake, by its status) showing every team the store's URL.
    assert r.status_code == 503, r.text
    assert "error id" in _detail(r) and "try again" in _detail(r)
    assert cp.plane.store.url not in r.text and "sqlite" not in r.text


# --------------------------------------------------------------------------- JSON bodies


def _keys(n: int) -> bytes:
    return b"{" + b",".join(b'"k%d":1' % i for i in range(n)) + b"}"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"spec": {', "not valid JSON (Expecting"),
        (b'{"spec": {}, "gpus": NaN}', "NaN is not a JSON number"),
        (b'{"spec": {}, "gpus": 1' + b"0" * 5000 + b"}", "4300 digits"),
        (b'{"spec": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (b'{"spec": {"a": ' + b"[" * 100 + b"]" * 100 + b"}}", "nested over 32 levels"),
        (b'{"spec": ' + _keys(90_000) + b"}", "over 5000 values"),
        (_keys(90_000), "over 5000 values"),
        (b'{"spec": "\xff"}', "cannot be read as JSON: 'utf-8' codec can't decode"),
    ],
    ids=[
        "truncated",
        "nan",
        "huge-int",
        "deep",
        "deeper-than-a-spec",
        "many-keys",
        "many-fields",
        "not-utf8",
    ],
)
def test_malformed_json_is_a_400_naming_the_problem(cp: CP, body: bytes, expected: str) -> None:
    # Before: deep nesting and huge integers were "There was an error parsing the body"; NaN
    # went through to the validators; 90,000 unknown fields took seconds on the event loop and
    # came back as 3.5 MB (top level) or 17 MB (in the spec) of errors.
    with cp.client(cp.team_token("vision")) as c:
        started = time.monotonic()
        r = c.post("/v1/jobs", content=body, headers=JSON)
        took = time.monotonic() - started
    assert r.status_code == 400, r.text[:500]
    assert expected in _detail(r), _detail(r)
    assert len(r.content) < 1000 and took < 2.0


def test_a_spec_with_thousands_of_problems_lists_the_first(cp: CP) -> None:
    with cp.client(cp.team_token("vision")) as c:
        r = c.post("/v1/jobs", content=b'{"spec": ' + _keys(3000) + b"}", headers=JSON)
        assert r.status_code == 422, r.text[:500]
        detail = _detail(r)
        # Before: 3,000 lines (600 KB) naming every unknown field.
        assert detail.startswith("the job spec is not a valid JobSpec:")
        assert len(detail) <= 9000 and detail.endswith("more lines; fix these first.")
        r = c.post("/v1/jobs", content=_keys(3000), headers=JSON)
        assert r.status_code == 422 and len(r.content) < 3000, r.text[:500]
        assert _detail(r).endswith("more problems")


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_that_is_not_json_by_its_content_type_is_a_415(cp: CP, content_type: str | None) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    with cp.client(cp.team_token("vision")) as c:
        r = c.post("/v1/jobs", content=b'{"spec": {}}', headers=headers)
    # Before: 422 "body: Input should be a valid dictionary or object to extract fields from".
    assert r.status_code == 415, r.text
    assert "Content-Type: application/json" in _detail(r)


def test_weights_and_since_must_be_finite(cp: CP) -> None:
    with cp.client() as c:
        r = c.get("/v1/cost", params={"since": "nan"})
        assert r.status_code == 422 and "since" in _detail(r) and "finite" in _detail(r), r.text
        r = c.put("/v1/admin/teams/vision", content=b'{"nominal_gpus": 1, "weight": 1e400}', headers=JSON)
        assert r.status_code == 422 and "weight" in _detail(r) and "finite" in _detail(r), r.text


# --------------------------------------------------------------------------- request heads


def _port(cp: CP) -> int:
    return int(cp.url.rsplit(":", 1)[1])


def test_a_request_head_without_end_is_cut_off(cp: CP) -> None:
    # Before (httptools): every header byte was kept; 200 MiB sent grew the server by 200 MiB,
    # without a token and without an answer.
    line = b"X-Pad: " + b"a" * 8000 + b"\r\n"
    sent = 0
    with socket.create_connection(("127.0.0.1", _port(cp)), timeout=30) as sock:
        sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")
        try:
            while sent < 64 * MiB:
                if select.select([sock], [], [], 0)[0]:
                    break  # answered
                sock.sendall(line)
                sent += len(line)
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            answer = sock.recv(4096)
        except ConnectionResetError:
            answer = b""
    assert sent < 16 * MiB, f"{sent / MiB:.0f} MiB of headers were read"
    # 431 naming the limit (or a reset, when the server closed before the client's last send).
    assert answer == b"" or (answer.startswith(b"HTTP/1.1 431") and b"over 65536 bytes" in answer), answer


def test_a_trickled_or_silent_request_head_is_answered_408_and_closed(cp: CP) -> None:
    # Before: both connections stayed open for ever (a few thousand of them use up the
    # control plane's file descriptors).
    port = _port(cp)
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as silent,
        socket.create_connection(("127.0.0.1", port), timeout=10) as trickler,
    ):
        started = time.monotonic()
        head = b"GET /v1/health HTTP/1.1\r\nHost: x\r\n" + b"X-A: b\r\n" * 100
        closed_after = None
        try:
            for byte in head:
                trickler.sendall(bytes([byte]))
                time.sleep(0.05)
                if select.select([trickler], [], [], 0)[0]:
                    closed_after = time.monotonic() - started
                    break
        except (BrokenPipeError, ConnectionResetError):
            closed_after = time.monotonic() - started
        assert closed_after is not None and closed_after < HEAD_TIMEOUT_S + 3, closed_after
        for sock in (silent, trickler):
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408"), answer
            assert b"no complete request head within 1 s" in answer
    # A kept-alive client pausing between requests longer than the deadline is not cut off.
    with httpx.Client(base_url=cp.url) as c:
        assert c.get("/v1/health").status_code == 200
        time.sleep(HEAD_TIMEOUT_S + 0.5)
        assert c.get("/v1/health").status_code == 200


# --------------------------------------------------------------------------- the CLI


def _cli(cp: CP, *args: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "VISIONLOOP_API_URL": cp.url, "VISIONLOOP_TOKEN": cp.admin_token}
    return subprocess.run(
        [sys.executable, "-m", "visionloop", *args], capture_output=True, env=env, timeout=120, check=False
    )


def test_cli_prints_a_whole_long_log_and_a_missing_job_in_one_line(cp: CP) -> None:
    log = b"".join(b"line %d of a long training log\n" % i for i in range(120_000))  # 3.6 MiB
    job = _job(cp, log=log)
    p = _cli(cp, "jobs", "logs", str(job))
    assert p.returncode == 0, p.stderr
    # Before: the first 1 MiB, cut mid-line, and nothing said.
    assert p.stdout == log
    p = _cli(cp, "jobs", "show", str(2**63))
    # Before: "error: internal error, id ...; see the control plane log" (a 500).
    assert p.returncode != 0
    assert (
        p.stderr.decode().strip()
        == f"error: no job {2**63} visible to you; `visionloop jobs list` shows yours."
    )


def test_cli_jobs_list_shows_the_newest_jobs(cp: CP) -> None:
    ids = [_job(cp) for _ in range(3)]
    p = _cli(cp, "jobs", "list", "--limit", "2", "--json")
    assert p.returncode == 0, p.stderr
    # Before: the two oldest jobs of the store, whatever was submitted since.
    assert [j["id"] for j in json.loads(p.stdout)] == [ids[2], ids[1]]
