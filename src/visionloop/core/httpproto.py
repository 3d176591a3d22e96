"""uvicorn's HTTP protocols with two limits no request may pass before anyone reads its token:
the bytes of a request head (line and headers) and the time it takes to arrive.

Without them, one unauthenticated connection sending headers without end grew a server by as
much as it sent (200 MiB sent: +200 MiB, with httptools and h11 alike), and a connection that
trickled its head, or sent nothing, was held open for ever (slowloris). A head past the size
limit is answered 431 and the connection closed; one not complete within the deadline (from
the connection's start, or from the first byte of a later request on a kept-alive one, which
uvicorn's keep-alive timeout closes while it stays idle), 408 and closed.

`bounded_protocol` picks the implementation uvicorn would: httptools when installed (the
inference server's speed depends on it), else h11."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 10.0


def _refusal(status: int, reason: str, detail: str) -> bytes:
    body = json.dumps({"detail": detail}).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body


class _HeadWatch:
    """The deadline on a request head, shared by both protocols: armed while a head is
    awaited, stopped once it is complete."""

    head_timeout_s = HEAD_TIMEOUT_S
    max_head_bytes = MAX_HEAD_BYTES
    _head_timer: asyncio.TimerHandle | None = None
    _head_bytes = 0
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def _watch_head(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_overdue)

    def _stop_watching(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_overdue(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or not self._awaiting_head():
            return
        detail = f"no complete request head within {self.head_timeout_s:g} s; send it at once."
        self.transport.write(_refusal(408, "Request Timeout", detail))
        self.transport.close()

    def _refuse_big_head(self) -> None:
        self._stop_watching()
        detail = (
            f"the request line and headers are over {self.max_head_bytes} bytes; "
            "send fewer or shorter headers."
        )
        self.transport.write(_refusal(431, "Request Header Fields Too Large", detail))
        self.transport.close()

    def _awaiting_head(self) -> bool:
        raise NotImplementedError


class BoundedH11Protocol(_HeadWatch, H11Protocol):
    """uvicorn's h11 protocol, whose buffer already holds at most
    `h11_max_incomplete_event_size` of an unfinished head (past it, 400), with the deadline."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head():
            self._head_bytes += len(data)
            self._watch_head()
        super().data_received(data)
        if not self._awaiting_head():  # a whole head came in: the app has it
            self._stop_watching()
            self._head_bytes = 0

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_watching()
        super().connection_lost(exc)

    def _awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE


def _httptools_protocol() -> type[Any] | None:
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # httptools not installed: uvicorn uses h11
        return None

    class BoundedHttpToolsProtocol(_HeadWatch, HttpToolsProtocol):
        """uvicorn's httptools protocol, which buffers a head without limit, with both limits:
        the bytes received while a head is awaited are counted (a chunk that also holds
        the body is fed first, so only a head still unfinished after it is refused)."""

        _in_head = True

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._watch_head()

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._head_bytes += len(data)
                self._watch_head()
            super().data_received(data)
            if self._in_head and self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
                self._refuse_big_head()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._head_bytes = 0
            self._stop_watching()
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._in_head = True  # the next request's head, on a kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_watching()
            super().connection_lost(exc)

        def _awaiting_head(self) -> bool:
            # Between requests uvicorn's keep-alive timer closes an idle connection; a head
            # deadline applies once the next one has begun, or on a fresh connection.
            return self._in_head and (self.cycle is None or self.cycle.response_complete)

    return BoundedHttpToolsProtocol


def bounded_protocol(
    head_timeout_s: float = HEAD_TIMEOUT_S, max_head_bytes: int = MAX_HEAD_BYTES
) -> type[Any]:
    """The protocol class to give uvicorn (`http=`): httptools' when installed, else h11's
    (with `h11_max_incomplete_event_size=max_head_bytes` in the config), with these limits."""
    base = _httptools_protocol() or BoundedH11Protocol
    return type(
        "Bounded" + base.__name__.removeprefix("Bounded"),
        (base,),
        {"head_timeout_s": head_timeout_s, "max_head_bytes": max_head_bytes},
    )
