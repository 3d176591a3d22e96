"""The loaded models: which versions are in memory, which one answers a request, and how
they change when a registry alias moves.

Each served model has a primary version (answers its bare name; follows the `champion` alias,
or the alias the reference named; a NAME/VERSION reference is pinned) and, when the
`challenger` alias points elsewhere, a challenger that takes `canary_percent` of bare-name
requests or a mirrored `shadow_percent` copy.

Promotion and rollback without failing a request: the watcher polls the aliases, loads (and
warms up) a new version *before* switching to it, then switches in one step of the event
loop. A request picks its version and queues on it with no await in between, so after the
switch nothing new reaches the old version; the old one finishes its queue, then closes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from visionloop.registry.layout import parse_ref
from visionloop.serve.batcher import Arrays, Batcher, Job
from visionloop.serve.collect import Collector
from visionloop.serve.config import ServeConfig
from visionloop.serve.metrics import ServeMetrics
from visionloop.serve.predlog import PredictionLog
from visionloop.serve.record import MonitorFields, PredictionRecord
from visionloop.serve.runtime import OnnxModel
from visionloop.serve.source import ModelSource, ResolvedVersion
from visionloop.tasks import Task, get_task
from visionloop.tasks.drift_outputs import EMBEDDING_OUTPUT, DriftOutputs

log = logging.getLogger(__name__)

# A version that failed to load is retried this often, not at every poll.
_RETRY_FAILED_S = 30.0


@dataclass(eq=False)
class ServedVersion:
    resolved: ResolvedVersion
    model: OnnxModel
    batcher: Batcher
    roles: set[str] = field(default_factory=set)
    _transform: Callable[[Any], Any] | None = None

    @property
    def name(self) -> str:
        return self.resolved.name

    @property
    def version(self) -> int:
        return self.resolved.version

    @property
    def labels(self) -> list[str]:
        return self.resolved.card.class_names

    @property
    def task(self) -> Task:
        """The task of the model card: what an answer is, and what the prediction log records."""
        return get_task(self.resolved.card.task)

    def transform(self) -> Callable[[Any], Any]:
        if self._transform is None:
            from visionloop.serve.images import card_transform

            self._transform = card_transform(self.resolved.card)
        return self._transform


@dataclass(eq=False)
class ServedModel:
    name: str
    follow: str | None  # the alias the primary follows; None when pinned to a version
    primary: ServedVersion
    challenger: ServedVersion | None = None
    # Set at run time through the routing endpoint (a key with the routing scope); None
    # follows the serving config. Held in memory: a restart returns to the config's values.
    canary_percent: float | None = None
    shadow_percent: float | None = None

    def loaded(self) -> dict[int, ServedVersion]:
        out = {self.primary.version: self.primary}
        if self.challenger is not None:
            out[self.challenger.version] = self.challenger
        return out


class UnknownModelError(LookupError):
    pass


class RoutingError(Exception):
    """A routing change the server cannot make; the message says why (answered 409)."""


class Repository:
    def __init__(
        self,
        source: ModelSource,
        config: ServeConfig,
        metrics: ServeMetrics,
        predlog: PredictionLog | None = None,
        rng: random.Random | None = None,
        collector: Collector | None = None,
    ) -> None:
        self.source = source
        self.config = config
        self.metrics = metrics
        self.predlog = predlog
        self.collector = collector
        self.rng = rng or random.Random()
        self.models: dict[str, ServedModel] = {}
        self._failed: dict[tuple[str, int], float] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()

    # ------------------------------------------------------------------ routing

    def get(self, name: str) -> ServedModel:
        m = self.models.get(name)
        if m is None:
            raise UnknownModelError(name)
        return m

    def pick(self, model: ServedModel, version: int | None) -> tuple[ServedVersion, ServedVersion | None]:
        """(the version that answers, a version that receives a shadow copy or None)."""
        if version is not None:
            v = model.loaded().get(version)
            if v is None:
                raise UnknownModelError(f"{model.name}/{version}")
            return v, None
        ch = model.challenger
        if ch is None:
            return model.primary, None
        canary, shadow = self.percents(model)
        if canary and self.rng.random() * 100.0 < canary:
            return ch, None
        if shadow and self.rng.random() * 100.0 < shadow:
            return model.primary, ch
        return model.primary, None

    def percents(self, model: ServedModel) -> tuple[float, float]:
        """(canary, shadow) percent in force for `model`: its run-time setting, else the config's."""
        cfg = self.config
        canary = cfg.canary_percent if model.canary_percent is None else model.canary_percent
        shadow = cfg.shadow_percent if model.shadow_percent is None else model.shadow_percent
        return canary, shadow

    def set_percents(self, model: ServedModel, canary: float | None, shadow: float | None) -> None:
        """Change `model`'s canary and/or shadow share from now on (None leaves one as it is).
        One step of the event loop: a request sees the old split or the new one."""
        if canary is not None:
            model.canary_percent = canary
        if shadow is not None:
            model.shadow_percent = shadow
        log.warning("%s: routing now canary %s%%, shadow %s%%", model.name, *self.percents(model))

    async def rollback(self, model: ServedModel, actor: str | None) -> int:
        """Move the alias `model` follows back to its previous version in the source (the
        registry), then switch to it now rather than at the next poll; return that version."""
        if model.follow is None:
            raise RoutingError(
                f"{model.name} is served pinned to version {model.primary.version}, so there is no alias "
                "to roll back; serve it by name (NAME or NAME@ALIAS) to follow an alias"
            )
        async with self._lock:
            version = await asyncio.to_thread(self.source.rollback, model.name, model.follow, actor)
            aliases = await asyncio.to_thread(self.source.aliases, model.name)
            await self._apply(model, aliases)
        if model.primary.version != version:
            raise RoutingError(
                f"{model.name}@{model.follow} now points to version {version}, but the server could not "
                f"load it (see its log); it still answers with version {model.primary.version}"
            )
        return version

    # ------------------------------------------------------------------ loading

    async def _load(self, rv: ResolvedVersion) -> ServedVersion:
        cfg = self.config

        threads = cpu_threads_per_batch(cfg) if cfg.device == "cpu" else cfg.intra_op_threads

        def build() -> tuple[OnnxModel, Callable[[Any], Any]]:
            # A registry export is loaded from its bytes, checked against its report's sha256.
            m = rv.load(device=cfg.device, intra_op_threads=threads)
            m.warm_up()
            # The image endpoint's preprocessing, built and run once now: its first use imports
            # torchvision (seconds), which the first image request must not wait for.
            from PIL import Image

            from visionloop.serve.images import card_transform

            transform = card_transform(rv.card)
            _, h, w = rv.card.input_size
            transform(Image.new("RGB", (w, h)))
            return m, transform

        model, transform = await asyncio.to_thread(build)
        batcher = Batcher(
            model,
            max_batch_size=cfg.max_batch_size,
            max_delay_s=cfg.max_queue_delay_ms / 1000.0,
            capacity=cfg.queue_capacity,
            name=f"ort-{rv.name}-v{rv.version}",
            concurrency=cfg.batch_concurrency,
        )
        served = ServedVersion(rv, model, batcher, _transform=transform)
        batcher.observer = self._observer(served)
        batcher.start()
        log.info("loaded %s/%s from %s (%s)", rv.name, rv.version, rv.path, ", ".join(model.providers))
        return served

    def _observer(self, sv: ServedVersion) -> Callable[[list[Job], Arrays, int, float], None]:
        m, labels = self.metrics, (sv.name, str(sv.version))
        batch_size, compute, queue = (
            m.batch_size.labels(*labels),
            m.compute.labels(*labels),
            m.queue.labels(*labels),
        )
        depth = m.queue_depth.labels(*labels)
        class_names = sv.labels
        task = sv.task
        temperature = sv.resolved.temperature

        def observe(jobs: list[Job], outputs: Arrays, rows: int, compute_s: float) -> None:
            batch_size.observe(rows)
            compute.observe(compute_s)
            depth.set(sv.batcher.depth)
            for j in jobs:
                queue.observe(j.queue_s)
            # The collector reads the same record as the log, for the jobs that carry an image
            # file (the server hands one over only while it collects).
            collector = self.collector if any(j.data is not None for j in jobs) else None
            if self.predlog is None and collector is None:
                return
            if any(j.failed for j in jobs):
                # A request answered with an error (NaN or infinity in its outputs) is not a
                # prediction: its rows are not logged (its 500 is counted in the metrics).
                keep = np.concatenate([np.full(j.rows, not j.failed) for j in jobs])
                outputs = {k: v[keep] for k, v in outputs.items()}
                jobs = [j for j in jobs if not j.failed]
                if not jobs:
                    return
            if temperature is not None:  # the log records the confidences the answers gave
                outputs = dict(task.calibrate(outputs, temperature))
            fields = task.log_fields(outputs, class_names)
            monitor = self.config.prediction_log_monitor
            drift = task.drift_outputs(outputs, class_names) if monitor else None
            embedding = outputs.get(EMBEDDING_OUTPUT) if monitor else None
            now = time.time()
            row = 0
            for j in jobs:
                latency_ms = round((j.queue_s + compute_s) * 1000.0, 3)
                for r in range(row, row + j.rows):
                    record = PredictionRecord(
                        time=now,
                        model=sv.name,
                        version=sv.version,
                        role="primary" if "primary" in sv.roles else "challenger",
                        latency_ms=latency_ms,
                        answer=fields[r],
                        monitor=_monitor_fields(drift, r, j.image, embedding),
                    )
                    if self.predlog is not None:
                        self.predlog.put(record)
                    # An image request (one row) whose caller got this answer, not a 504.
                    if collector is not None and j.data is not None and not j.future.cancelled():
                        collector.offer(j.data, record)
                row += j.rows

        return observe

    def _set_role(self, sv: ServedVersion, role: str, on: bool) -> None:
        (sv.roles.add if on else sv.roles.discard)(role)
        self.metrics.loaded.labels(sv.name, str(sv.version), role).set(1 if on else 0)

    async def start(self) -> None:
        """Load every configured model (raising if one cannot be), then its challenger."""
        for text in self.config.refs:
            ref = parse_ref(text)
            rv = await asyncio.to_thread(self.source.resolve, ref)
            primary = await self._load(rv)
            follow = None if ref.version is not None else (ref.alias or self.config.champion_alias)
            self.models[ref.name] = ServedModel(ref.name, follow, primary)
            self._set_role(primary, "primary", True)
        await self.poll()

    async def _version(self, model: ServedModel, version: int) -> ServedVersion | None:
        """The loaded version, or a newly loaded one, or None when it cannot be loaded now."""
        existing = model.loaded().get(version)
        if existing is not None:
            return existing
        key = (model.name, version)
        if time.monotonic() - self._failed.get(key, -_RETRY_FAILED_S) < _RETRY_FAILED_S:
            return None
        try:
            rv = await asyncio.to_thread(self.source.version, model.name, version)
            sv = await self._load(rv)
        except Exception as e:  # a bad new version must never take down the versions serving now
            self._failed[key] = time.monotonic()
            self.metrics.load_failures.labels(model.name).inc()
            log.error("cannot load %s/%s (still serving the current versions): %s", model.name, version, e)
            return None
        self._failed.pop(key, None)
        return sv

    async def poll(self) -> None:
        """Follow alias moves once: load what is new, switch, retire what nobody uses."""
        async with self._lock:
            for model in list(self.models.values()):
                if model.follow is None:
                    continue
                try:
                    aliases = await asyncio.to_thread(self.source.aliases, model.name)
                except Exception as e:
                    log.warning(
                        "cannot read the aliases of %s (keeping the current versions): %s", model.name, e
                    )
                    continue
                await self._apply(model, aliases)

    async def _apply(self, model: ServedModel, aliases: dict[str, int]) -> None:
        before = set(model.loaded().values())
        want_primary = aliases.get(model.follow or "", model.primary.version)
        if want_primary != model.primary.version:
            new = await self._version(model, want_primary)
            if new is not None:
                self._set_role(model.primary, "primary", False)
                model.primary = new
                self._set_role(new, "primary", True)
                self.metrics.switches.labels(model.name, "primary").inc()
                log.warning("%s: version %s now answers (alias %s)", model.name, new.version, model.follow)
        want_ch = aliases.get(self.config.challenger_alias)
        if want_ch == model.primary.version:
            want_ch = None
        current_ch = model.challenger.version if model.challenger is not None else None
        if want_ch != current_ch:
            new_ch = await self._version(model, want_ch) if want_ch is not None else None
            if want_ch is None or new_ch is not None:
                if model.challenger is not None:
                    self._set_role(model.challenger, "challenger", False)
                model.challenger = new_ch
                if new_ch is not None:
                    self._set_role(new_ch, "challenger", True)
                    self.metrics.switches.labels(model.name, "challenger").inc()
        if model.challenger is model.primary:
            model.challenger = None
        still = set(model.loaded().values())
        for sv in before - still:
            self._retire(sv)

    def _retire(self, sv: ServedVersion) -> None:
        for role in list(sv.roles):
            self._set_role(sv, role, False)
        task = asyncio.get_running_loop().create_task(self._close(sv))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _close(self, sv: ServedVersion) -> None:
        await sv.batcher.close(self.config.drain_timeout_s)
        log.info("unloaded %s/%s", sv.name, sv.version)

    async def watch(self) -> None:
        while True:
            await asyncio.sleep(self.config.alias_poll_s)
            try:
                await self.poll()
            except Exception:  # the watcher outlives any one bad poll
                log.exception("alias poll failed")

    async def close(self) -> None:
        for model in self.models.values():
            for sv in model.loaded().values():
                self._retire(sv)
        if self._retiring:
            await asyncio.gather(*self._retiring, return_exceptions=True)


def cpu_threads_per_batch(cfg: ServeConfig) -> int:
    """ONNX Runtime's intra-op threads for one CPU session: as configured, or (0, auto) the
    cores shared out between the batches that compute at once. ORT's own default gives every
    session all the cores, so `batch_concurrency` batches oversubscribe them: on 2 cores that
    cost the server 15-20% of its throughput (BENCHMARKS.md, inference server)."""
    if cfg.intra_op_threads:
        return cfg.intra_op_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // cfg.batch_concurrency)


def _monitor_fields(
    drift: DriftOutputs | None,
    row: int,
    image: Mapping[str, float] | None,
    embedding: npt.NDArray[Any] | None = None,
) -> MonitorFields | None:
    """One logged row's drift fields: numpy views and scalars, turned into JSON by the log's
    writer thread, not here in the event loop."""
    emb = None if embedding is None else embedding[row]  # a numpy row, like the outputs
    if drift is None:
        return None if image is None and emb is None else MonitorFields(image=image, embedding=emb)
    return MonitorFields(
        outputs=drift.columns[row],  # a numpy row: MonitorFields.to_json reads it
        predicted=None if drift.classes is None else int(drift.classes[row]),
        confidence=None if drift.confidence is None else float(drift.confidence[row]),
        image=image,
        embedding=emb,
    )
