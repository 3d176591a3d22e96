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


class BodyLimit:
    """Pure ASGI middleware for requests with a body (a Content-Length above 0, or chunked):
    the bearer token is checked before any body byte is read (no token or a bad one: 401, the
    body unread, the connection closed), and the body is limited by the bytes actually
    received, chunked bodies too: past `limit`, 413. Before, an unauthenticated chunked POST of
    400 MiB was read whole (2.5 GB of process memory) to be answered 422."""

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
        received = 0
        refused = False
        started = False

        async def limited_receive() -> Any:
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    if not started and not refused:
                        refused = True
                        await _refuse(send, 413, self._too_big())
                    raise _BodyTooLargeError
            return message

        async def guarded_send(message: Any) -> None:
            nonlocal started
            if refused:
                return  # the 413 went out; the app's own answer to the cut body is dropped
            started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLargeError:
            if not refused:
                raise

    def _too_big(self) -> str:
        return f"request body over {self.limit} bytes; a job spec is a few KiB."


class _BodyTooLargeError(Exception):
    """Raised out of `receive` once the body is over the limit (the 413 is already sent)."""


async def _refuse(send: Any, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
    """An answer before (or instead of) reading the body; `Connection: close`, so the server
    stops reading what the client still sends (uvicorn drains a kept-alive request's body)."""
    body = json.dumps({"detail": detail}).encode()
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()),
    ]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def admin(who: Annotated[Principal, Depends(principal)]) -> Principal:
    """An admin caller (a route's `Admin`); 403 for a team token."""
    if not who.admin:
        raise HTTPException(403, "this needs an admin token.")
    return who


# What routes declare: `who: Who` for any caller, `_: Admin` for admin-only routes.
Who = Annotated[Principal, Depends(principal)]
Admin = Annotated[Principal, Depends(admin)]
