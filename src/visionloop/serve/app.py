"""The HTTP face of the server: KServe v2 REST routes, the image endpoint and /metrics.

Handlers take the raw request (no pydantic validation on the hot path: `protocol` checks
the body and answers every mistake with a 4xx and {"error": "..."}); the OpenAPI document
still describes every body, for clients and for schemathesis.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from visionloop import __version__
from visionloop.serve import openapi
from visionloop.serve.batcher import BatcherClosedError, InferenceError, QueueFullError, Result
from visionloop.serve.config import ServeConfig
from visionloop.serve.images import image_bytes, preprocess
from visionloop.serve.metrics import UNKNOWN, ServeMetrics
from visionloop.serve.predlog import PredictionLog
from visionloop.serve.protocol import (
    HEADER_LENGTH,
    InferRequest,
    ProtocolError,
    encode_infer_response,
    parse_header_length,
    parse_infer_request,
)
from visionloop.serve.repository import Repository, ServedModel, ServedVersion, UnknownModelError, top1
from visionloop.serve.source import ModelSource

log = logging.getLogger(__name__)

JSON = "application/json"


def _json(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(doc), status_code=status, media_type=JSON, headers=headers)


class Server:
    """The state one app serves from: config, models, metrics, prediction log."""

    def __init__(self, config: ServeConfig, source: ModelSource, predictions: Path | None) -> None:
        self.config = config
        self.metrics = ServeMetrics()
        self.predlog = (
            PredictionLog(
                predictions,
                max_bytes=int(config.prediction_log_max_mb * 2**20),
                backups=config.prediction_log_backups,
                on_drop=self.metrics.log_dropped.inc,
            )
            if predictions is not None and config.prediction_log
            else None
        )
        self.repo = Repository(source, config, self.metrics, self.predlog)
        self.ready = False
        self.startup_error: BaseException | None = None
        self._shadows: set[asyncio.Task[None]] = set()
        # Retry-After for a full queue: about the time the queue takes to drain, at least 1 s.
        self.retry_after = "1"

    # ------------------------------------------------------------------ lookups

    def model(self, request: Request, name: str) -> ServedModel:
        try:
            m = self.repo.get(name)
        except UnknownModelError:
            raise ProtocolError(
                f"no model {name!r} is served here; served: {sorted(self.repo.models)}", status=404
            ) from None
        request.state.model = name
        return m

    def version(self, model: ServedModel, version: str | None) -> int | None:
        if version is None or version == "":
            return None
        if not version.isdigit():
            raise ProtocolError(f"version must be a whole number like 3, got {version!r}")
        v = int(version)
        if v not in model.loaded():
            raise ProtocolError(
                f"version {v} of {model.name} is not loaded; loaded: {sorted(model.loaded())} "
                "(the server loads the versions its aliases point to)",
                status=404,
            )
        return v

    def pick(self, model: ServedModel, version: int | None) -> tuple[ServedVersion, ServedVersion | None]:
        try:
            return self.repo.pick(model, version)
        except UnknownModelError:
            raise ProtocolError(
                f"version {version} of {model.name} is no longer loaded", status=404
            ) from None

    async def body(self, request: Request) -> bytes:
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ProtocolError(self._too_big(int(declared)), status=413)
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ProtocolError(self._too_big(size), status=413)
            chunks.append(chunk)
        body = b"".join(chunks)
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding in ("gzip", "deflate"):
            # A bounded inflate: a few KB of zeros must not expand into gigabytes.
            d = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
            try:
                body = d.decompress(body, limit + 1)
            except zlib.error as e:
                raise ProtocolError(f"the body is not valid {encoding} data ({e})") from None
            if len(body) > limit or d.unconsumed_tail:
                raise ProtocolError(self._too_big(len(body)), status=413)
        elif encoding != "identity":
            raise ProtocolError(
                f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none", 415
            )
        return body

    def _too_big(self, size: int) -> str:
        return (
            f"the request body has {size} bytes, more than the server's limit of "
            f"{self.config.max_body_bytes} (max_body_bytes in the serving config)"
        )

    # ------------------------------------------------------------------ running requests

    async def run(self, sv: ServedVersion, req: InferRequest, shadow: ServedVersion | None) -> Result:
        try:
            fut = sv.batcher.submit(req.feeds, req.rows)
        except QueueFullError:
            self.metrics.rejected.labels(sv.name, str(sv.version), "queue_full").inc()
            raise ProtocolError(
                f"the queue of {sv.name}/{sv.version} is full ({self.config.queue_capacity} requests); "
                "retry shortly",
                status=503,
                headers={"Retry-After": self.retry_after},
            ) from None
        except BatcherClosedError:
            raise ProtocolError("the version was just unloaded; retry", 503, {"Retry-After": "1"}) from None
        if shadow is not None:
            self._mirror(sv, shadow, req, fut)
        try:
            return await asyncio.wait_for(fut, self.config.request_timeout_ms / 1000.0)
        except TimeoutError:
            self.metrics.rejected.labels(sv.name, str(sv.version), "timeout").inc()
            raise ProtocolError(
                f"the request timed out after {self.config.request_timeout_ms:.0f} ms in the queue and "
                "inference; retry later or raise request_timeout_ms",
                status=504,
            ) from None
        except BatcherClosedError:
            raise ProtocolError("the version was unloaded before the request ran; retry", 503) from None

    def _mirror(self, primary: ServedVersion, shadow: ServedVersion, req: InferRequest, fut: Any) -> None:
        try:
            sfut = shadow.batcher.submit(req.feeds, req.rows)
        except (QueueFullError, BatcherClosedError):
            self.metrics.shadow_dropped.labels(primary.name).inc()
            return
        task = asyncio.get_running_loop().create_task(self._compare(primary, shadow, fut, sfut))
        self._shadows.add(task)
        task.add_done_callback(self._shadows.discard)

    async def _compare(self, primary: ServedVersion, shadow: ServedVersion, fut: Any, sfut: Any) -> None:
        try:
            # The champion's future is the one its caller awaits; a second waiter changes nothing.
            p: Result = await asyncio.shield(fut)
            s: Result = await asyncio.wait_for(sfut, self.config.request_timeout_ms / 1000.0)
        except (asyncio.CancelledError, TimeoutError, BatcherClosedError, InferenceError):
            self.metrics.shadow_dropped.labels(primary.name).inc()
            return
        name = primary.model.outputs[0].name
        if name not in s.outputs:
            self.metrics.shadow_dropped.labels(primary.name).inc()
            return
        a, _ = top1(p.outputs[name])
        b, conf = top1(s.outputs[name])
        agree = int((a == b).sum())
        counter = self.metrics.shadow
        pv, sv = str(primary.version), str(shadow.version)
        if agree:
            counter.labels(primary.name, pv, sv, "true").inc(agree)
        if len(a) - agree:
            counter.labels(primary.name, pv, sv, "false").inc(len(a) - agree)
        if self.predlog is not None:
            for r in range(len(b)):
                k = int(b[r])
                labels = shadow.labels
                self.predlog.put(
                    {
                        "time": time.time(),
                        "model": shadow.name,
                        "version": shadow.version,
                        "latency_ms": round((s.queue_s + s.compute_s) * 1000.0, 3),
                        "top_class": labels[k] if k < len(labels) else k,
                        "confidence": round(float(conf[r]), 6),
                        "role": "shadow",
                        "agrees": bool(a[r] == b[r]),
                    }
                )

    def count(self, sv: ServedVersion, endpoint: str, started: float) -> None:
        labels = (sv.name, str(sv.version))
        self.metrics.requests.labels(*labels, endpoint).inc()
        self.metrics.latency.labels(*labels).observe(time.perf_counter() - started)

    async def startup(self) -> asyncio.Task[None]:
        try:
            await self.repo.start()
        except BaseException as e:
            # Kept for `serve_forever`, which raises it as the CLI's one-line error.
            self.startup_error = e
            await self.repo.close()
            raise
        self.ready = True
        return asyncio.get_running_loop().create_task(self.repo.watch())

    async def shutdown(self, watcher: asyncio.Task[None] | None) -> None:
        self.ready = False
        if watcher is not None:
            watcher.cancel()
        await self.repo.close()
        if self.predlog is not None:
            await asyncio.to_thread(self.predlog.close)


def create_app(
    config: ServeConfig,
    source: ModelSource,
    predictions: Path | None = None,
    on_ready: Callable[[Server], None] | None = None,
) -> FastAPI:
    """The server's ASGI app. Models load in its lifespan: the app answers once they are in."""
    server = Server(config, source, predictions)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watcher = await server.startup()
        if on_ready is not None:
            on_ready(server)
        try:
            yield
        finally:
            await server.shutdown(watcher)

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
    return app


def _handlers(app: FastAPI, server: Server) -> None:
    def error(request: Request, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        model = getattr(request.state, "model", UNKNOWN)
        server.metrics.errors.labels(model, str(status)).inc()
        return _json({"error": message}, status, headers)

    @app.exception_handler(ProtocolError)
    async def _protocol(request: Request, e: ProtocolError) -> Response:
        return error(request, e.status, str(e), e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> Response:
        detail = (
            e.detail if e.status_code != 404 else f"no such endpoint: {request.method} {request.url.path}"
        )
        return error(request, e.status_code, str(detail), dict(e.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> Response:
        return error(request, 400, "; ".join(str(x.get("msg")) for x in e.errors()))

    @app.exception_handler(InferenceError)
    async def _inference(request: Request, e: InferenceError) -> Response:
        return error(request, 500, f"inference failed: {e}")

    @app.exception_handler(Exception)
    async def _any(request: Request, e: Exception) -> Response:
        log.exception("unexpected error answering %s %s", request.method, request.url.path)
        return error(request, 500, f"internal error: {type(e).__name__}: {e}")


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
    async def models() -> Response:
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

    async def infer(request: Request, name: str, version: str | None) -> Response:
        started = time.perf_counter()
        m = server.model(request, name)
        v = server.version(m, version)
        body = await server.body(request)
        header_length = parse_header_length(request.headers.get(HEADER_LENGTH), len(body))
        # No await from pick to submit: a promotion cannot slip in between (see repository).
        sv, shadow = server.pick(m, v)
        req = parse_infer_request(body, header_length, sv.model.inputs, sv.model.outputs, cfg.max_batch_size)
        result = await server.run(sv, req, shadow)
        out, hl = encode_infer_response(sv.name, sv.version, req.id, result.outputs, req.outputs, sv.labels)
        server.count(sv, "infer", started)
        if hl is None:
            return Response(out, media_type=JSON)
        return Response(
            out, media_type="application/octet-stream", headers={"Inference-Header-Content-Length": str(hl)}
        )

    @app.post("/v2/models/{name}/infer", tags=["inference"], openapi_extra=openapi.INFER)
    async def infer_model(request: Request, name: str) -> Response:
        return await infer(request, name, None)

    @app.post("/v2/models/{name}/versions/{version}/infer", tags=["inference"], openapi_extra=openapi.INFER)
    async def infer_version(request: Request, name: str, version: str) -> Response:
        return await infer(request, name, version)

    async def classify(request: Request, name: str, version: str | None) -> Response:
        started = time.perf_counter()
        m = server.model(request, name)
        v = server.version(m, version)
        top_k = _top_k(request.query_params.get("top_k"), cfg.top_k)
        data = image_bytes(await server.body(request), request.headers.get("content-type", ""))
        sv, shadow = server.pick(m, v)
        # Decoding and resizing take milliseconds of CPU: off the event loop.
        x = await asyncio.to_thread(preprocess, data, sv.transform(), sv.model.inputs[0].dtype)
        if sv.batcher.closed:  # promoted away while decoding: ask again (same card, or redo)
            old, (sv, shadow) = sv, server.pick(m, v)
            if sv.resolved.card.eval_preprocess() != old.resolved.card.eval_preprocess():
                x = await asyncio.to_thread(preprocess, data, sv.transform(), sv.model.inputs[0].dtype)
        spec = sv.model.inputs[0]
        if len(sv.model.inputs) != 1 or any(
            w >= 0 and w != g for w, g in zip(spec.shape[1:], x.shape[1:], strict=False)
        ):
            raise ProtocolError(
                f"{sv.name}/{sv.version} takes {[t.metadata() for t in sv.model.inputs]}, which the image "
                "endpoint cannot build from its model card; use the infer endpoint",
                status=400,
            )
        req = InferRequest(None, {spec.name: x}, 1, [])
        result = await server.run(sv, req, shadow)
        scores = result.outputs[sv.model.outputs[0].name].reshape(-1).astype(np.float64)
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")[:top_k]
        server.count(sv, "classify", started)
        return _json(
            {
                "model_name": sv.name,
                "model_version": str(sv.version),
                "predictions": [
                    {
                        "label": sv.labels[i] if i < len(sv.labels) else str(i),
                        "index": int(i),
                        "score": float(probs[i]),
                    }
                    for i in order
                ],
            }
        )

    @app.post("/v2/models/{name}/classify", tags=["inference"], openapi_extra=openapi.CLASSIFY)
    async def classify_model(request: Request, name: str) -> Response:
        return await classify(request, name, None)

    @app.post(
        "/v2/models/{name}/versions/{version}/classify", tags=["inference"], openapi_extra=openapi.CLASSIFY
    )
    async def classify_version(request: Request, name: str, version: str) -> Response:
        return await classify(request, name, version)

    @app.get("/metrics", tags=["metrics"])
    async def metrics() -> Response:
        for m in server.repo.models.values():
            for sv in m.loaded().values():
                server.metrics.queue_depth.labels(sv.name, str(sv.version)).set(sv.batcher.depth)
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _top_k(value: str | None, default: int) -> int:
    if value is None:
        return default
    if not value.isdigit() or not 1 <= int(value) <= 1000:
        raise ProtocolError(f"top_k must be a whole number from 1 to 1000, got {value!r}")
    return int(value)
