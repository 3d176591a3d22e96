"""What one server process answers from: its config, its models, metrics and prediction log,
and the steps every request goes through (find the model, read the body within its limit,
queue for a batch, mirror to a shadow). The routes in `app` are thin over these.
"""

from __future__ import annotations

import asyncio
import os
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect

from visionloop.core.errors import ConfigError
from visionloop.serve.batcher import (
    BatcherClosedError,
    InferenceError,
    NonFiniteOutputError,
    QueueFullError,
    Result,
)
from visionloop.serve.collect import Collector
from visionloop.serve.config import ServeConfig
from visionloop.serve.images import DecodedImage, decode_image, image_bytes, needed_side
from visionloop.serve.metrics import ServeMetrics
from visionloop.serve.predlog import PredictionLog
from visionloop.serve.protocol import InferRequest, ProtocolError
from visionloop.serve.record import PredictionRecord
from visionloop.serve.repository import Repository, ServedModel, ServedVersion, UnknownModelError
from visionloop.serve.source import ModelSource

T = TypeVar("T")

# Bodies below this are parsed on the event loop; larger ones in a worker thread. Parsing a
# 64 KiB JSON tensor (orjson, the checks, numpy) took 0.16 ms on the 2-core CI VM, less than
# a thread hop's cost at the ~2,700 small requests/s the server answers; a larger body's parse
# grows with its size (10 ns/byte for orjson alone), so it leaves the loop.
INLINE_PARSE_BYTES = 64 * 1024
# Responses whose encoding costs less than this (`response.encode_cost`: bytes of a JSON FP32
# tensor, 0.36 ms for 64 KiB) are encoded on the event loop; costlier ones (a segmentation
# map, a detector's raw tensors, embeddings: megabytes, tens of ms) in the parse pool. Before,
# every response was encoded on the loop, and one dense output stalled every other request.
INLINE_ENCODE_BYTES = 64 * 1024
# The slowest a body may come, on average, once `head_timeout_s` has passed: 32 MiB (the
# default max_body_bytes) in 8.5 minutes; a link slower than this is not one to serve from.
MIN_BODY_RATE = 64 * 1024


def _workers(configured: int) -> int:
    return configured or min(4, os.cpu_count() or 1)


class Server:
    """The state one app serves from: config, models, metrics, prediction log."""

    def __init__(
        self,
        config: ServeConfig,
        source: ModelSource,
        predictions: Path | None,
        collected: Path | None = None,
    ) -> None:
        """`predictions`: the prediction log's file (None: no log); `collected`: the store of
        collected images when the config's `collect.dir` names none (`serve.collect`)."""
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
        self.collector = _collector(config, collected, self.metrics)
        self.repo = Repository(source, config, self.metrics, self.predlog, collector=self.collector)
        self.ready = False
        self.startup_error: BaseException | None = None
        self._shadows: set[asyncio.Task[None]] = set()
        self._children: dict[tuple[str, int, str], tuple[Any, Any]] = {}  # count()'s metric children
        # Retry-After for a full queue: about the time the queue takes to drain, at least 1 s.
        self.retry_after = "1"
        # Bounded pools, so a burst of large requests decodes or parses a few at a time (eight
        # 8k x 8k PNGs decoded at once took the server to 20 GB); the rest wait with only
        # their bodies in memory.
        self._decodes = ThreadPoolExecutor(_workers(config.max_concurrent_decodes), "serve-decode")
        self._parses = ThreadPoolExecutor(_workers(config.max_concurrent_parses), "serve-parse")

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
        # ASGI messages read directly: Starlette's request.stream() is an async generator,
        # a cost per request on the hot path for the same bytes.
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        started = loop.time()
        grace = self.config.head_timeout_s
        while True:
            # A body must keep coming: after `head_timeout_s`, at MIN_BODY_RATE on average.
            # Before, a client trickling its body (or sending none after its headers) held
            # a connection and up to max_body_bytes of buffer for as long as it liked.
            try:
                async with asyncio.timeout_at(started + grace + size / MIN_BODY_RATE):
                    message = await request.receive()
            except TimeoutError:
                raise ProtocolError(
                    f"the body came slower than {MIN_BODY_RATE // 1024} KiB/s after its first "
                    f"{grace:g} s ({size} bytes so far); send it at once",
                    status=408,
                    headers={"Connection": "close"},
                ) from None
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ProtocolError(self._too_big(size), status=413)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding in ("gzip", "deflate"):
            # Inflating up to the limit takes tens of ms: off the loop, with the parses.
            return await self.parse(self._inflate, body, encoding)
        if encoding != "identity":
            raise ProtocolError(
                f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none", 415
            )
        return body

    def _inflate(self, body: bytes, encoding: str) -> bytes:
        # A bounded inflate: a few KB of zeros must not expand into gigabytes.
        limit = self.config.max_body_bytes
        d = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
        try:
            body = d.decompress(body, limit + 1)
        except zlib.error as e:
            raise ProtocolError(f"the body is not valid {encoding} data ({e})") from None
        if len(body) > limit or d.unconsumed_tail:
            raise ProtocolError(self._too_big(len(body)), status=413)
        return body

    async def parse(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the parse pool: what a large body's parse (or a large response's
        encoding) costs, it costs a worker thread, not the event loop (health checks and small
        requests are answered meanwhile)."""
        return await asyncio.get_running_loop().run_in_executor(self._parses, fn, *args)

    async def decode(self, body: bytes, content_type: str, sv: ServedVersion) -> DecodedImage:
        """An image request's body → the image file, the model's input (1, C, H, W), the
        image's upright (width, height) as sent and (when logged) its statistics, in the decode
        pool: the multipart form is split, the image decoded (reduced to what the card's
        resize needs) and preprocessed there, a bounded number at a time."""
        cfg = self.config
        stats = (self.predlog is not None or self.collector is not None) and cfg.prediction_log_monitor

        def work() -> DecodedImage:
            data = image_bytes(body, content_type)
            need = needed_side(sv.resolved.card.eval_preprocess())
            return decode_image(
                data, sv.transform(), sv.model.inputs[0].dtype, need, cfg.max_image_pixels, stats
            )

        return await asyncio.get_running_loop().run_in_executor(self._decodes, work)

    def _too_big(self, size: int) -> str:
        return (
            f"the request body has {size} bytes, more than the server's limit of "
            f"{self.config.max_body_bytes} (max_body_bytes in the serving config)"
        )

    # ------------------------------------------------------------------ running requests

    async def run(
        self, sv: ServedVersion, req: InferRequest, shadow: ServedVersion | None, data: bytes | None = None
    ) -> Result:
        """`req` answered by `sv` (and mirrored to `shadow`); `data`, an image request's file,
        is offered to the collector with the answer's record."""
        try:
            fut = sv.batcher.submit(req.feeds, req.rows, req.image, data)
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
            async with asyncio.timeout(self.config.request_timeout_ms / 1000.0):
                return await fut  # cancelled on timeout, so the batcher skips it
        except TimeoutError:
            self.metrics.rejected.labels(sv.name, str(sv.version), "timeout").inc()
            raise ProtocolError(
                f"the request timed out after {self.config.request_timeout_ms:.0f} ms in the queue and "
                "inference; retry later or raise request_timeout_ms",
                status=504,
            ) from None
        except BatcherClosedError:
            raise ProtocolError("the version was unloaded before the request ran; retry", 503) from None
        except NonFiniteOutputError as e:
            # Never answered as a success: a 500 (see app), counted here per version.
            self.metrics.rejected.labels(sv.name, str(sv.version), "non_finite_output").inc()
            raise NonFiniteOutputError(f"{sv.name}/{sv.version} produced {e} for this request") from None

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
            if sfut.done() and not sfut.cancelled() and isinstance(sfut.exception(), NonFiniteOutputError):
                # A challenger answering NaN is what a shadow is there to find out.
                self.metrics.rejected.labels(shadow.name, str(shadow.version), "non_finite_output").inc()
            return
        task = shadow.task
        # Comparable only as the same task with the same outputs (a challenger of another
        # task, or one missing an output, cannot agree or disagree).
        if task is not primary.task or any(t.name not in s.outputs for t in primary.model.outputs):
            self.metrics.shadow_dropped.labels(primary.name).inc()
            return
        agrees = task.agreement(p.outputs, s.outputs)
        agree = int(agrees.sum())
        counter = self.metrics.shadow
        pv, sv = str(primary.version), str(shadow.version)
        if agree:
            counter.labels(primary.name, pv, sv, "true").inc(agree)
        if len(agrees) - agree:
            counter.labels(primary.name, pv, sv, "false").inc(len(agrees) - agree)
        if self.predlog is not None:
            fields = task.log_fields(s.outputs, shadow.labels)
            for r in range(len(agrees)):
                self.predlog.put(
                    PredictionRecord(
                        time=time.time(),
                        model=shadow.name,
                        version=shadow.version,
                        role="shadow",
                        latency_ms=round((s.queue_s + s.compute_s) * 1000.0, 3),
                        answer=fields[r],
                        agrees=bool(agrees[r]),
                    )
                )

    def count(self, sv: ServedVersion, endpoint: str, started: float) -> None:
        key = (sv.name, sv.version, endpoint)
        children = self._children.get(key)
        if children is None:  # labels() takes a lock and a dict lookup: once per version
            labels = (sv.name, str(sv.version))
            children = (self.metrics.requests.labels(*labels, endpoint), self.metrics.latency.labels(*labels))
            self._children[key] = children
        children[0].inc()
        children[1].observe(time.perf_counter() - started)

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
        self._decodes.shutdown(wait=False, cancel_futures=True)
        self._parses.shutdown(wait=False, cancel_futures=True)
        if self.predlog is not None:
            await asyncio.to_thread(self.predlog.close)
        if self.collector is not None:  # after the models: their last batches are offered
            await asyncio.to_thread(self.collector.close)


def _collector(config: ServeConfig, collected: Path | None, metrics: ServeMetrics) -> Collector | None:
    """The collector of a config whose `collect.enabled` says so, else None."""
    cfg = config.collect
    if not cfg.enabled:
        return None
    directory = cfg.dir if cfg.dir is not None else collected
    if directory is None:
        raise ConfigError(
            "collect.enabled is true but the server was given no folder to keep images in: set "
            "collect.dir in the serving config (e.g. dir: /data/collected)"
        )
    try:
        return Collector(cfg, directory, metrics=metrics)
    except OSError as e:
        raise ConfigError(
            f"cannot keep collected images in {directory}: {e}; set collect.dir to a folder the server "
            "may write"
        ) from e
