"""Routing at run time: read and change who answers a model's bare name, without a restart.

    GET  /v2/models/NAME/routing    the primary, the challenger and the canary/shadow split
    PUT  /v2/models/NAME/routing    {"canary_percent": 10, "shadow_percent": 0} (either or both)
    POST /v2/models/NAME/rollback   the alias the model follows goes back to its previous
                                    version in the registry, and the server switches now

Reading needs any key that covers the model; changing needs one made with `--routing`
(`visionloop serve keys create ops --models NAME --routing`). A split set here holds until the
server restarts (then the serving config's values apply again); a rollback is the registry's
own, so it holds for every server and is recorded in the model's alias history.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import FastAPI, Request, Response

from visionloop.core.errors import VisionloopError
from visionloop.serve.keys import ROUTING, ApiKey
from visionloop.serve.protocol import ProtocolError
from visionloop.serve.repository import RoutingError, ServedModel
from visionloop.serve.state import Server

# A routing change is two numbers; a body bigger than this is not one.
MAX_ROUTING_BODY = 4096
EXAMPLE = '{"canary_percent": 10, "shadow_percent": 0}'


def _json(doc: Any) -> Response:
    return Response(orjson.dumps(doc), media_type="application/json")


def describe(server: Server, model: ServedModel) -> dict[str, Any]:
    canary, shadow = server.repo.percents(model)
    return {
        "model": model.name,
        "follows": model.follow,
        "primary": model.primary.version,
        "challenger": None if model.challenger is None else model.challenger.version,
        "canary_percent": canary,
        "shadow_percent": shadow,
    }


def _require_routing(request: Request, model: str) -> str | None:
    """The key's name (the actor recorded by a rollback), or a 403 when the server checks keys
    and this one may not change routing. None when the server runs without keys."""
    key = request.scope.get("state", {}).get("api_key")
    if not isinstance(key, ApiKey):
        return None
    if not key.allows(ROUTING):
        raise ProtocolError(
            f"API key {key.name!r} may read {model!r} but not change its routing; use a key made with "
            f"`visionloop serve keys create NAME --models {model} --routing`",
            status=403,
        )
    return key.name


def _percent(doc: dict[str, Any], field: str, upper: float) -> float | None:
    value = doc.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= upper:
        raise ProtocolError(f"{field} must be a number from 0 to {upper:g}, got {value!r}; e.g. {EXAMPLE}")
    return float(value)


def parse_change(body: bytes) -> tuple[float | None, float | None]:
    """(canary, shadow) from a PUT body; either may be None (left as it is)."""
    if len(body) > MAX_ROUTING_BODY:
        raise ProtocolError(f"a routing change is a small JSON object like {EXAMPLE}", status=413)
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ProtocolError(f"the body is not JSON ({e}); send e.g. {EXAMPLE}") from None
    if not isinstance(doc, dict) or not doc:
        raise ProtocolError(f"send a JSON object with canary_percent and/or shadow_percent, e.g. {EXAMPLE}")
    unknown = sorted(set(doc) - {"canary_percent", "shadow_percent"})
    if unknown:
        raise ProtocolError(f"unknown field(s) {unknown}; the fields are canary_percent and shadow_percent")
    # 100% canary is a promotion, as in the serving config: say so rather than starve the champion.
    canary = _percent(doc, "canary_percent", 99.999)
    shadow = _percent(doc, "shadow_percent", 100.0)
    return canary, shadow


def add_routes(app: FastAPI, server: Server) -> None:
    @app.get("/v2/models/{name}/routing", tags=["routing"])
    async def routing(request: Request, name: str) -> Response:
        return _json(describe(server, server.model(request, name)))

    @app.put("/v2/models/{name}/routing", tags=["routing"])
    async def set_routing(request: Request, name: str) -> Response:
        m = server.model(request, name)
        _require_routing(request, name)
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > MAX_ROUTING_BODY):
            raise ProtocolError(f"a routing change is a small JSON object like {EXAMPLE}", status=413)
        canary, shadow = parse_change(await server.body(request))
        server.repo.set_percents(m, canary, shadow)
        return _json(describe(server, m))

    @app.post("/v2/models/{name}/rollback", tags=["routing"])
    async def rollback(request: Request, name: str) -> Response:
        m = server.model(request, name)
        actor = _require_routing(request, name)
        try:
            await server.repo.rollback(m, f"serve key {actor}" if actor else "serve")
        except (RoutingError, VisionloopError) as e:
            raise ProtocolError(str(e), status=409) from None
        return _json(describe(server, m))
