"""Who may ask the inference server what: the check `ServeApp` runs on every HTTP request
before any route (and before the body is read).

With keys on, every request needs `Authorization: Bearer <key>` except the health checks
(`/v2/health/live`, `/v2/health/ready`: load balancers probe them without credentials) and
the OpenAPI document (a description of the API, no data). Then:

- `/v2/models/NAME/...` (metadata, ready, infer, classify) needs a key that covers NAME. A key
  that does not gets 403 saying so: the answer is the same whether NAME is served or not, so
  it tells nothing about which models exist;
- `/metrics` needs a key for all models (`--models '*'`): its series name every model;
- anything else (`/v2`, `/v2/models`, unknown paths) needs any valid key; `/v2/models` lists
  only the models the key covers.

No key, a malformed header or an unknown or revoked key gets 401 with `WWW-Authenticate: Bearer`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final

from visionloop.serve.keys import ApiKey, KeyRing

OPEN_PATHS: Final = frozenset({"/v2/health/live", "/v2/health/ready", "/openapi.json"})
METRICS_PATH: Final = "/metrics"
_MODEL_PATH = re.compile(r"/v2/models/(?P<name>[^/]+)(?:/.*)?", re.DOTALL)
CHALLENGE: Final = {"WWW-Authenticate": "Bearer"}


@dataclass(frozen=True)
class Denied:
    status: int
    message: str
    headers: dict[str, str] | None = None


def bearer_token(scope: dict[str, Any]) -> str | None:
    """The token of the request's `Authorization: Bearer` header, or None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            token = token.strip()
            return token if scheme.lower() == "bearer" and token else None
    return None


def check(keys: KeyRing, path: str, token: str | None) -> ApiKey | Denied | None:
    """The key a request to `path` is made with (`token`: its bearer token, `bearer_token`),
    None for an open path, or why it is refused."""
    if path in OPEN_PATHS:
        return None
    if token is None:
        return Denied(
            401,
            "this server needs an API key: send `Authorization: Bearer <key>` "
            "(`visionloop serve keys create NAME --models M` makes one)",
            CHALLENGE,
        )
    key = keys.lookup(token)  # no file I/O here: ServeApp reloads the keys in a worker thread
    if key is None:
        return Denied(401, "unknown or revoked API key", CHALLENGE)
    if path == METRICS_PATH and not key.all_models:
        return Denied(403, f"API key {key.name!r} may not read /metrics: that needs a key for all models (*)")
    m = _MODEL_PATH.fullmatch(path)
    if m is not None and not key.covers(m["name"]):
        return Denied(403, f"API key {key.name!r} does not cover model {m['name']!r}")
    return key
