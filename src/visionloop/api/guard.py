"""Who may call the control-plane API, and how much they may send: the bearer token's
principal (a team, or an admin) as a FastAPI dependency, and `BodyLimit`, the ASGI middleware
that checks the token before reading any body byte and cuts a body off past its limit."""

from __future__ import annotations

import json
from typing import Annotated, Any

import anyio.to_thread
from fastapi import Depends, Header, HTTPException, Request

from visionloop.sched.service import ControlPlane, Principal

_MISSING_TOKEN = (
    "missing bearer token: send `Authorization: Bearer <token>` "
    "(`visionloop admin token create --team T` makes one)."
)
_UNKNOWN_TOKEN = "unknown or revoked token."


def authenticate(plane: ControlPlane, authorization: str | None) -> Principal | str:
    """The bearer token's principal, or what is wrong with the header."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return _MISSING_TOKEN
    found = plane.store.authenticate(token.strip())
    if found is None:
        return _UNKNOWN_TOKEN
    return Principal(team=found.team, admin=found.admin)


def principal(request: Request, authorization: Annotated[str | None, Header()] = None) -> Principal:
    """Who is calling (a route's `Who`); 401 without a valid bearer token."""
    # A request with a body was authenticated by BodyLimit before its body was read.
    who = request.scope.get("state", {}).get(_PRINCIPAL)
    if isinstance(who, Principal):
        return who
    result = authenticate(request.app.state.plane, authorization)
    if isinstance(result, str):
        raise HTTPException(401, result, headers={"WWW-Authenticate": "Bearer"})
    return result


_PRINCIPAL = "visionloop.principal"


# What a request body may hold once parsed: a job spec has a few dozen values, a few levels
# deep. Before, a 1 MiB body of 90,000 unknown fields took seconds of CPU, stalled every other
# request for a second and was answered with 17 MB of errors.
MAX_JSON_VALUES = 5_000
MAX_JSON_DEPTH = 32
# How long an error answer may be: the first problems say what to fix.
MAX_DETAIL_LINES = 25
MAX_DETAIL_CHARS = 8_000


def short_detail(text: str) -> str:
    """`text` cut to its first lines and characters, saying how much was left out."""
    lines = text.splitlines()
    cut = "\n".join(lines[:MAX_DETAIL_LINES])
    if len(cut) > MAX_DETAIL_CHARS:
        cut = cut[:MAX_DETAIL_CHARS] + " ..."
    if len(lines) > MAX_DETAIL_LINES:
        cut += f"\n  ... and {len(lines) - MAX_DETAIL_LINES} more lines; fix these first."
    return cut


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def json_problem(body: bytes) -> str | None:
    """What is wrong with a JSON request body (not JSON, a NaN, a number of thousands of
    digits, nested or sized past what any request needs), or None. Runs in a worker thread:
    parsing a MiB holds the event loop for milliseconds to seconds."""
    try:
        doc = json.loads(body, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        return (
            f"the body is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
            'send a JSON object, e.g. {"spec": {...}}.'
        )
    except RecursionError:
        return f"the body is nested too deeply; a request is at most {MAX_JSON_DEPTH} levels deep."
    except ValueError as e:  # not UTF-8, NaN/Infinity, an integer past Python's digit limit
        why = str(e).split(";")[0] if "digits" in str(e) else str(e)
        return f"the body cannot be read as JSON: {why}."
    count = 0
    stack: list[tuple[Any, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > MAX_JSON_VALUES:
            return (
                f"the body holds over {MAX_JSON_VALUES} values; a job spec holds a few dozen. "
                "Send only the spec's fields."
            )
        if depth > MAX_JSON_DEPTH:
            return f"the body is nested over {MAX_JSON_DEPTH} levels deep; a job spec is a few levels deep."
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return None


def _is_json(content_type: bytes | None) -> bool:
    """Whether FastAPI parses the body as JSON: application/json and application/*+json (a
    body without a content type is passed on as bytes, and refused as "not a dictionary")."""
    if content_type is None:
        return False
    kind = content_type.split(b";")[0].strip().lower()
    return kind == b"application/json" or (kind.startswith(b"application/") and kind.endswith(b"+json"))


class BodyLimit:
    """Pure ASGI middleware for requests with a body (a Content-Length above 0, or chunked):
    the bearer token is checked before any body byte is read (no token or a bad one: 401, the
    body unread, the connection closed), and the body is limited by the bytes actually
    received, chunked bodies too: past `limit`, 413. Before, an unauthenticated chunked POST of
    400 MiB was read whole (2.5 GB of process memory) to be answered 422.

    The body, read whole (at most `limit`), is then checked as JSON in a worker thread
    (`json_problem`): a malformed one is answered 400 here, naming the problem, and only a
    bounded document reaches FastAPI, whose own parse and validation run on the event loop.
    A body that is not JSON by its Content-Type is a 415."""

    def __init__(self, app: Any, plane: ControlPlane, limit: int) -> None:
        self.app = app
        self.plane = plane
        self.limit = limit

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope["headers"]}
        length = headers.get(b"content-length")
        if length is None and b"transfer-encoding" not in headers:
            await self.app(scope, receive, send)  # no body: routes authenticate as they did
            return
        if length is not None and length.strip() == b"0":
            await self.app(scope, receive, send)
            return
        authorization = headers.get(b"authorization", b"").decode("latin-1")
        who = await anyio.to_thread.run_sync(authenticate, self.plane, authorization)
        if isinstance(who, str):
            await _refuse(send, 401, who, {"WWW-Authenticate": "Bearer"})
            return
        scope.setdefault("state", {})[_PRINCIPAL] = who
        if length is not None and (not length.strip().isdigit() or int(length) > self.limit):
            await _refuse(send, 413, self._too_big())
            return
        if not _is_json(headers.get(b"content-type")):
            kind = headers.get(b"content-type")
            shown = "of no Content-Type" if kind is None else repr(kind.decode("latin-1")[:100])
            await _refuse(send, 415, f"the body is {shown}; send JSON with `Content-Type: application/json`.")
            return
        chunks: list[bytes] = []
        received = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before sending its whole body
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.limit:
                await _refuse(send, 413, self._too_big())
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        problem = await anyio.to_thread.run_sync(json_problem, body)
        if problem is not None:
            await _answer(send, 400, problem)
            return
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _too_big(self) -> str:
        return f"request body over {self.limit} bytes; a job spec is a few KiB."


async def _answer(
    send: Any, status: int, detail: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = json.dumps({"detail": detail}).encode()
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(headers or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def _refuse(send: Any, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
    """An answer before (or instead of) reading the body; `Connection: close`, so the server
    stops reading what the client still sends (uvicorn drains a kept-alive request's body)."""
    raw = [
        (b"connection", b"close"),
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()),
    ]
    await _answer(send, status, detail, raw)


def admin(who: Annotated[Principal, Depends(principal)]) -> Principal:
    """An admin caller (a route's `Admin`); 403 for a team token."""
    if not who.admin:
        raise HTTPException(403, "this needs an admin token.")
    return who


# What routes declare: `who: Who` for any caller, `_: Admin` for admin-only routes.
Who = Annotated[Principal, Depends(principal)]
Admin = Annotated[Principal, Depends(admin)]
