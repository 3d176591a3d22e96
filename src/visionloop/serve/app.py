"""The HTTP face of the server: KServe v2 REST routes, the image endpoint and /metrics.

Handlers take the raw request (no pydantic validation on the hot path: `protocol` checks
the body and answers every mistake with a 4xx and {"error": "..."}); the OpenAPI document
still describes every body, for clients and for schemathesis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from visionloop import __version__
from visionloop.serve import auth, openapi, routing
from visionloop.serve.batcher import InferenceError, NonFiniteOutputError
from visionloop.serve.config import ServeConfig
from visionloop.serve.keys import ApiKey, KeyRing
from visionloop.serve.metrics import UNKNOWN
from visionloop.serve.protocol import (
    HEADER_LENGTH,
    InferRequest,
    ProtocolError,
    parse_header_length,
    parse_infer_request,
)
from visionloop.serve.response import encode_cost, encode_infer_response
from visionloop.serve.source import ModelSource
from visionloop.serve.state import INLINE_ENCODE_BYTES, INLINE_PARSE_BYTES, Server
from visionloop.tasks import get_task, list_tasks
from visionloop.tasks.serving import AnswerOptions, ImageContext

log = logging.getLogger(__name__)

JSON = "application/json"
# A request with a key waits this long, at most, for a reload of the keys file under way (a
# stat and, when it changed, the read of a small file).
RELOAD_WAIT_S = 2.0


def _json(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type=JSON, headers=headers)


# The hot path: both infer routes, matched as Starlette matches `{name}` and `{version}`.
_INFER_PATH = re.compile(r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer")


class ServeApp:
    """What uvicorn serves: a POST to an infer route goes straight to its handler, everything
    else (health, metadata, the image endpoint, /metrics, OpenAPI, lifespan) through FastAPI.

    Why: at saturation FastAPI's routing, middleware and dependency solving took about 40% of
    the event loop per infer request, as much as the request's own work (py-spy, small
    model). The fast path runs the same handler with the same error answers and metrics; the
    infer routes stay registered with FastAPI, so the OpenAPI document still describes them.
    """

    def __init__(self, api: FastAPI, server: Server, keys: KeyRing | None = None) -> None:
        self.api = api
        self.server = server
        self.state = api.state
        self.keys = keys  # None: no API keys (loopback, or --insecure-no-auth)
        self._reloading: asyncio.Future[None] | None = None

    def _reload_keys(self, keys: KeyRing) -> None:
        """Start reloading the keys file in a worker thread when it is due (one at a time).
        Requests meanwhile are checked against the keys loaded so far: before, the stat and,
        when the file had changed, its read and parse ran on the event loop inside the
        request that found the check due, holding every other request (a health check too)
        for as long as the disk took."""
        if keys.reload_due() and (self._reloading is None or self._reloading.done()):
            self._reloading = asyncio.ensure_future(asyncio.to_thread(keys.maybe_reload))

    async def _settled(self) -> None:
        """Wait for the keys file's reload under way, if any: on the loop without blocking it,
        at most RELOAD_WAIT_S. A request that presents a key is checked against the file as
        the reload finds it, so a key made a moment ago is taken and a key just revoked is
        refused at the first request after the poll; before, that request was still checked
        against the keys loaded earlier."""
        reloading = self._reloading
        if reloading is None or reloading.done():
            return
        with contextlib.suppress(Exception):  # failed or slow: checked against the keys as they stand
            await asyncio.wait_for(asyncio.shield(reloading), RELOAD_WAIT_S)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.keys is not None:
            self._reload_keys(self.keys)
            token = auth.bearer_token(scope)  # read once: the wait and the check both need it
            if token and scope["path"] not in auth.OPEN_PATHS:
                await self._settled()
            # Every HTTP request, fast path and FastAPI routes alike, before its body is read.
            verdict = auth.check(self.keys, scope["path"], token)
            if isinstance(verdict, auth.Denied):
                request = Request(scope, receive)
                await _error(self.server, request, verdict.status, verdict.message, verdict.headers)(
                    scope, receive, send
                )
                return
            scope.setdefault("state", {})["api_key"] = verdict
        if scope["type"] == "http" and scope["method"] == "POST":
            match = _INFER_PATH.fullmatch(scope["path"])
            if match is not None:
                request = Request(scope, receive)
                try:
                    response = await _infer(self.server, request, match["name"], match["version"])
                except Exception as e:
                    response = _error_response(self.server, request, e)
                await response(scope, receive, send)
                return
        await self.api(scope, receive, send)


def create_app(
    config: ServeConfig,
    source: ModelSource,
    predictions: Path | None = None,
    on_ready: Callable[[Server], None] | None = None,
    on_stop: Callable[[Server], None] | None = None,
    keys: KeyRing | None = None,
    collected: Path | None = None,
) -> ServeApp:
    """The server's ASGI app. Models load in its lifespan: the app answers once they are in.
    `on_ready` runs once they are; `on_stop` once it has drained and closed, on shutdown.
    With `keys`, every request but the health checks needs an API key (see serve.auth).
    `collected`: where collected images go when `collect.enabled` and `collect.dir` is unset."""
    server = Server(config, source, predictions, collected)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watcher = await server.startup()
        if on_ready is not None:
            on_ready(server)
        try:
            yield
        finally:
            await server.shutdown(watcher)
            if on_stop is not None:
                on_stop(server)

    app = FastAPI(
        title="visionloop inference server",
        version=__version__,
        description="Open Inference Protocol (KServe v2) REST, with Triton's binary tensor data extension.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.server = server
    _handlers(app, server)
    _routes(app, server)
    routing.add_routes(app, server)
    # Last: `/v2/models/{name}/{endpoint}` would otherwise take the routing API's POSTs.
    _image_routes(app, server)
    return ServeApp(app, server, keys)


def _error(
    server: Server, request: Request, status: int, message: str, headers: dict[str, str] | None = None
) -> Response:
    """The protocol's error body, counted per model and status."""
    model = getattr(request.state, "model", UNKNOWN)
    server.metrics.errors.labels(model, str(status)).inc()
    return _json({"error": message}, status, headers)


def _error_response(server: Server, request: Request, e: Exception) -> Response:
    """The answer to an exception out of a handler: the same on FastAPI's routes and on
    ServeApp's fast path."""
    if isinstance(e, ProtocolError):
        return _error(server, request, e.status, str(e), e.headers)
    if isinstance(e, ClientDisconnect):
        # The client left mid-body: not an error of ours, and nobody reads the answer
        # (uvicorn drops what is sent on a closed connection).
        return Response(status_code=499)  # nginx's "client closed request"
    # A 500 says only an error id: the exception's text (an ONNX Runtime message names files
    # and nodes, a bug's message anything) goes to the server log under that id.
    error_id = secrets.token_hex(6)
    if isinstance(e, NonFiniteOutputError):
        # Our own message (the model, version and output names): said to the client too. The
        # inputs were finite and in range (the protocol checks them), so it is the server's 500.
        log.error("%s (error id %s) answering %s %s", e, error_id, request.method, request.url.path)
        return _error(
            server,
            request,
            500,
            f"inference failed: {e}; a non-finite answer is never sent (error id {error_id}; see the "
            "server log)",
        )
    what = "inference failed" if isinstance(e, InferenceError) else "internal error"
    log.error(
        "%s (error id %s) answering %s %s", what, error_id, request.method, request.url.path, exc_info=e
    )
    return _error(server, request, 500, f"{what}, error id {error_id}; see the server log")


def _handlers(app: FastAPI, server: Server) -> None:
    def error(request: Request, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        return _error(server, request, status, message, headers)

    async def mapped(request: Request, e: Exception) -> Response:
        return _error_response(server, request, e)

    for cls in (ProtocolError, InferenceError, ClientDisconnect, Exception):
        app.add_exception_handler(cls, mapped)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> Response:
        detail = (
            e.detail if e.status_code != 404 else f"no such endpoint: {request.method} {request.url.path}"
        )
        return error(request, e.status_code, str(detail), dict(e.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> Response:
        return error(request, 400, "; ".join(str(x.get("msg")) for x in e.errors()))


def _routes(app: FastAPI, server: Server) -> None:
    cfg = server.config

    @app.get("/v2/health/live", tags=["health"])
    async def live() -> Response:
        return _json({"live": True})

    @app.get("/v2/health/ready", tags=["health"])
    async def ready() -> Response:
        return _json({"ready": server.ready}, 200 if server.ready else 503)

    @app.get("/v2", tags=["metadata"])
    async def server_metadata() -> Response:
        return _json(
            {
                "name": "visionloop",
                "version": __version__,
                "extensions": ["binary_tensor_data", "classification"],
            }
        )

    @app.get("/v2/models", tags=["metadata"])
    async def models(request: Request) -> Response:
        key: ApiKey | None = getattr(request.state, "api_key", None)  # set by ServeApp
        return _json(
            {
                "models": [
                    {
                        "name": m.name,
                        "follows": m.follow,
                        "versions": [
                            {"version": str(v.version), "roles": sorted(v.roles)} for v in m.loaded().values()
                        ],
                    }
                    for m in server.repo.models.values()
                    if key is None or key.covers(m.name)
                ]
            }
        )

    def metadata(request: Request, name: str, version: str | None) -> Response:
        m = server.model(request, name)
        v = server.version(m, version)
        sv = m.primary if v is None else m.loaded()[v]
        return _json(
            {
                "name": m.name,
                "versions": [str(x) for x in sorted(m.loaded())],
                "platform": "onnxruntime_onnx",
                "inputs": [t.metadata() for t in sv.model.inputs],
                "outputs": [t.metadata() for t in sv.model.outputs],
                "parameters": {
                    "version": str(sv.version),
                    "classes": sv.labels,
                    "max_batch_size": cfg.max_batch_size,
                },
            }
        )

    @app.get("/v2/models/{name}", tags=["metadata"])
    async def model_metadata(request: Request, name: str) -> Response:
        return metadata(request, name, None)

    @app.get("/v2/models/{name}/versions/{version}", tags=["metadata"])
    async def version_metadata(request: Request, name: str, version: str) -> Response:
        return metadata(request, name, version)

    def model_ready(request: Request, name: str, version: str | None) -> Response:
        m = server.model(request, name)
        server.version(m, version)
        return _json({"name": name, "ready": True})

    @app.get("/v2/models/{name}/ready", tags=["health"])
    async def ready_model(request: Request, name: str) -> Response:
        return model_ready(request, name, None)

    @app.get("/v2/models/{name}/versions/{version}/ready", tags=["health"])
    async def ready_version(request: Request, name: str, version: str) -> Response:
        return model_ready(request, name, version)

    @app.post("/v2/models/{name}/infer", tags=["inference"], openapi_extra=openapi.INFER)
    async def infer_model(request: Request, name: str) -> Response:
        return await _infer(server, request, name, None)  # ServeApp answers first; kept for OpenAPI

    @app.post("/v2/models/{name}/versions/{version}/infer", tags=["inference"], openapi_extra=openapi.INFER)
    async def infer_version(request: Request, name: str, version: str) -> Response:
        return await _infer(server, request, name, version)

    @app.get("/metrics", tags=["metrics"])
    async def metrics() -> Response:
        for m in server.repo.models.values():
            for sv in m.loaded().values():
                server.metrics.queue_depth.labels(sv.name, str(sv.version)).set(sv.batcher.depth)
        # The text of every series (20 models: 250 KB, 21 ms on the 2-core CI VM): rendered in
        # a worker thread, so health checks and requests are answered meanwhile.
        text = await asyncio.to_thread(server.metrics.render)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


def _image_routes(app: FastAPI, server: Server) -> None:
    """The image endpoint, `POST /v2/models/NAME[/versions/V]/<endpoint>`, where <endpoint> is
    the served model's task's (`Task.image_endpoint`: classify, detect). Each registered
    task's endpoint is a documented route; any other last segment reaches the same handler,
    which answers with the endpoint the model does have."""
    endpoints = sorted({get_task(t).image_endpoint for t in list_tasks()})

    async def handle(request: Request, name: str, version: str | None, endpoint: str) -> Response:
        return await _image(server, request, name, version, endpoint, endpoints)

    for endpoint in endpoints:
        extra = openapi.image_endpoint(endpoint)

        def model_route(endpoint: str = endpoint) -> Callable[[Request, str], Any]:
            async def route(request: Request, name: str) -> Response:
                return await handle(request, name, None, endpoint)

            return route

        def version_route(endpoint: str = endpoint) -> Callable[[Request, str, str], Any]:
            async def route(request: Request, name: str, version: str) -> Response:
                return await handle(request, name, version, endpoint)

            return route

        app.post(
            f"/v2/models/{{name}}/{endpoint}",
            tags=["inference"],
            openapi_extra=extra,
            operation_id=f"{endpoint}_model",
            summary=f"{endpoint.capitalize()} an image",
        )(model_route())
        app.post(
            f"/v2/models/{{name}}/versions/{{version}}/{endpoint}",
            tags=["inference"],
            openapi_extra=extra,
            operation_id=f"{endpoint}_version",
            summary=f"{endpoint.capitalize()} an image with one version",
        )(version_route())

    @app.post("/v2/models/{name}/{endpoint}", include_in_schema=False)
    async def other_model(request: Request, name: str, endpoint: str) -> Response:
        return await handle(request, name, None, endpoint)

    @app.post("/v2/models/{name}/versions/{version}/{endpoint}", include_in_schema=False)
    async def other_version(request: Request, name: str, version: str, endpoint: str) -> Response:
        return await handle(request, name, version, endpoint)


async def _image(
    server: Server, request: Request, name: str, version: str | None, endpoint: str, known: list[str]
) -> Response:
    """One image in, the task's answer out (`Task.served_answer`), for the served model whose
    task answers at `endpoint`."""
    cfg = server.config
    started = time.perf_counter()
    m = server.model(request, name)
    v = server.version(m, version)
    # Checked before the body is read: the endpoint is the primary's task's (a challenger of
    # another task is not served through the image endpoint; see pick below).
    target = m.primary if v is None else m.loaded()[v]
    want = target.task.image_endpoint
    if endpoint != want:
        prefix = f"/v2/models/{name}" + ("" if v is None else f"/versions/{v}")
        hint = f"{name} is a {target.task.name} model: POST {prefix}/{want} with the image"
        if endpoint in known:
            raise ProtocolError(f"{name} has no /{endpoint} endpoint; {hint}", status=400)
        raise ProtocolError(f"no such endpoint: POST {request.url.path}; {hint}", status=404)
    options = _answer_options(request, cfg.top_k)
    body = await server.body(request)
    sv, shadow = server.pick(m, v)
    # The form's parse, the decode and the resize: in the bounded decode pool.
    decoded = await server.decode(body, request.headers.get("content-type", ""), sv)
    if sv.batcher.closed:  # promoted away while decoding: ask again (same card, or redo)
        old, (sv, shadow) = sv, server.pick(m, v)
        if sv.resolved.card.eval_preprocess() != old.resolved.card.eval_preprocess():
            decoded = await server.decode(decoded.data, "", sv)
    x, size = decoded.input, decoded.size
    if sv.task.image_endpoint != endpoint:
        # A canary of another task (or an alias moved to one) cannot answer this request.
        raise ProtocolError(
            f"{sv.name}/{sv.version} answers at /{sv.task.image_endpoint}, not /{endpoint}; retry", 409
        )
    spec = sv.model.inputs[0]
    if len(sv.model.inputs) != 1 or any(
        w >= 0 and w != g for w, g in zip(spec.shape[1:], x.shape[1:], strict=False)
    ):
        raise ProtocolError(
            f"{sv.name}/{sv.version} takes {[t.metadata() for t in sv.model.inputs]}, which the image "
            "endpoint cannot build from its model card; use the infer endpoint",
            status=400,
        )
    req = InferRequest(None, {spec.name: x}, 1, [], decoded.stats)
    # The image file goes with the request only while the server collects (serve.collect).
    result = await server.run(sv, req, shadow, decoded.data if server.collector is not None else None)
    image = ImageContext(
        width=size[0], height=size[1], input_height=int(x.shape[2]), input_width=int(x.shape[3])
    )
    outputs = result.outputs
    if sv.resolved.temperature is not None:
        outputs = dict(sv.task.calibrate(outputs, sv.resolved.temperature))
    answer = sv.task.served_answer(outputs, sv.labels, options=options, image=image)
    server.count(sv, endpoint, started)
    return _json({"model_name": sv.name, "model_version": str(sv.version), **answer})


async def _infer(server: Server, request: Request, name: str, version: str | None) -> Response:
    cfg = server.config
    started = time.perf_counter()
    m = server.model(request, name)
    v = server.version(m, version)
    body = await server.body(request)
    header_length = parse_header_length(request.headers.get(HEADER_LENGTH), len(body))
    # No await from pick to submit: a promotion cannot slip in between (see repository).
    sv, shadow = server.pick(m, v)
    if len(body) >= INLINE_PARSE_BYTES:  # a large body is parsed off the loop, then picked again
        while True:
            specs = (sv.model.inputs, sv.model.outputs)
            req = await server.parse(parse_infer_request, body, header_length, *specs, cfg.max_batch_size)
            sv, shadow = server.pick(m, v)
            if (sv.model.inputs, sv.model.outputs) == specs:
                break
    else:
        req = parse_infer_request(body, header_length, sv.model.inputs, sv.model.outputs, cfg.max_batch_size)
    result = await server.run(sv, req, shadow)
    encode = (sv.name, sv.version, req.id, result.outputs, req.outputs, sv.labels)
    if encode_cost(result.outputs, req.outputs) >= INLINE_ENCODE_BYTES:  # a large one: off the loop
        out, hl = await server.parse(encode_infer_response, *encode)
    else:
        out, hl = encode_infer_response(*encode)
    server.count(sv, "infer", started)
    if hl is None:
        return Response(out, media_type=JSON)
    return Response(
        out, media_type="application/octet-stream", headers={"Inference-Header-Content-Length": str(hl)}
    )


def _answer_options(request: Request, default_top_k: int | None) -> AnswerOptions:
    """The image endpoint's query parameters: `top_k` (1 to 1000; else the serving config's,
    else the task's default) and `score_threshold` (0 to 1; else the task's default)."""
    query = request.query_params
    top_k = _top_k(query.get("top_k"), default_top_k)
    threshold = _score_threshold(query.get("score_threshold"))
    return AnswerOptions(top_k=top_k, score_threshold=threshold)


def _top_k(value: str | None, default: int | None) -> int | None:
    if value is None:
        return default
    if not value.isdigit() or not 1 <= int(value) <= 1000:
        raise ProtocolError(f"top_k must be a whole number from 1 to 1000, got {value!r}")
    return int(value)


def _score_threshold(value: str | None) -> float | None:
    if value is None:
        return None
    try:
        threshold = float(value)
    except ValueError:
        threshold = math.nan
    if not 0.0 <= threshold <= 1.0:  # also refuses nan
        raise ProtocolError(f"score_threshold must be a number from 0 to 1, like 0.5; got {value!r}")
    return threshold
