"""Prometheus metrics of one server, in its own registry (two servers in one process, as in
tests, do not share counters). Label values are model names and versions the server loaded,
never raw request text, so a client cannot grow the label space."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets from 0.5 ms to 10 s: CPU models answer in milliseconds, a saturated queue in
# seconds.
_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
UNKNOWN = "_unknown"


class ServeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        mv = ["model", "version"]
        self.requests = Counter(
            "visionloop_serve_requests", "Answered requests", [*mv, "endpoint"], registry=r
        )
        self.errors = Counter(
            "visionloop_serve_errors", "Requests answered with an error", ["model", "code"], registry=r
        )
        self.latency = Histogram(
            "visionloop_serve_request_seconds",
            "Queue + compute time of a request",
            mv,
            buckets=_SECONDS,
            registry=r,
        )
        self.queue = Histogram(
            "visionloop_serve_queue_seconds",
            "Time a request waited for its batch",
            mv,
            buckets=_SECONDS,
            registry=r,
        )
        self.compute = Histogram(
            "visionloop_serve_compute_seconds", "Inference time of a batch", mv, buckets=_SECONDS, registry=r
        )
        self.batch_size = Histogram(
            "visionloop_serve_batch_size", "Rows per inference batch", mv, buckets=_BATCH, registry=r
        )
        self.queue_depth = Gauge("visionloop_serve_queue_depth", "Requests waiting", mv, registry=r)
        self.rejected = Counter(
            "visionloop_serve_rejected",
            "Requests the batcher refused or did not answer (queue_full, timeout, non_finite_output)",
            [*mv, "reason"],
            registry=r,
        )
        self.shadow = Counter(
            "visionloop_serve_shadow_comparisons",
            "Champion answers compared with the challenger's shadow answer (top-1)",
            ["model", "champion_version", "challenger_version", "agree"],
            registry=r,
        )
        self.shadow_dropped = Counter(
            "visionloop_serve_shadow_dropped",
            "Mirrored requests dropped (challenger busy)",
            ["model"],
            registry=r,
        )
        self.loaded = Gauge(
            "visionloop_serve_model_loaded", "1 for each loaded version, by role", [*mv, "role"], registry=r
        )
        self.switches = Counter(
            "visionloop_serve_alias_switches",
            "Versions switched in after an alias moved",
            ["model", "role"],
            registry=r,
        )
        self.load_failures = Counter(
            "visionloop_serve_load_failures",
            "Versions that failed to load after an alias moved",
            ["model"],
            registry=r,
        )
        self.log_dropped = Counter(
            "visionloop_serve_prediction_log_dropped",
            "Prediction summaries dropped (log writer behind)",
            registry=r,
        )

        # The `collect:` store (serve.collect): images kept for labelling, and those not kept.
        self.collect_kept = Counter(
            "visionloop_collect_kept",
            "Image requests kept for labelling (a new image or a sighting)",
            registry=r,
        )
        self.collect_dropped = Counter(
            "visionloop_collect_dropped",
            "Image requests a rule kept but the store did not (full: past collect.max_bytes; queue: "
            "the writer was behind; error: the write failed)",
            ["reason"],
            registry=r,
        )
        self.collect_bytes = Gauge(
            "visionloop_collect_bytes", "Size of the collected images' store", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    @staticmethod
    def total(counter: Counter) -> int:
        """A counter's sum over all its labels (what `visionloop serve` reports when it stops)."""
        return int(sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total")))
