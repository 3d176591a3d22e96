"""`visionloop serve MODEL`: the inference server for registered models."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from visionloop.cli.console import err, out

if TYPE_CHECKING:
    from visionloop.serve.config import ServeConfig
    from visionloop.serve.state import Server


def serve(
    model: str | None = typer.Argument(
        None, help="NAME (its champion), NAME@ALIAS or NAME/VERSION; optional with --config."
    ),
    host: str | None = typer.Option(None, "--host", help="Address to listen on (default 127.0.0.1)."),
    port: int | None = typer.Option(None, "--port", "-p", help="Port to listen on (default 8000)."),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="A serving config YAML (see ServeConfig)."
    ),
    precision: str | None = typer.Option(
        None, "--precision", help="Which export to serve: fp32, fp16 or int8."
    ),
    device: str | None = typer.Option(None, "--device", help="cpu or cuda (CUDA where ONNX Runtime has it)."),
    max_batch_size: int | None = typer.Option(
        None, "--max-batch-size", help="Rows per inference batch (default 8)."
    ),
    max_queue_delay_ms: float | None = typer.Option(
        None, "--max-queue-delay-ms", help="How long a batch waits to fill (default 2)."
    ),
    canary: float | None = typer.Option(
        None, "--canary", help="Percent of bare-name requests the challenger answers (default 0)."
    ),
    shadow: float | None = typer.Option(
        None, "--shadow", help="Percent of bare-name requests mirrored to the challenger, never returned."
    ),
) -> None:
    """Serve models over the Open Inference Protocol (KServe v2 REST), Triton-client compatible.

    The bare model name is answered by its `champion`; a `challenger` takes --canary percent.

    With --shadow, the challenger gets a copy of requests; its answers are compared, not returned.

    Promote or roll back in the registry: the server follows within a second, without a restart.

    Also: /v2/models/NAME/classify takes an image file and returns labels; /metrics is Prometheus.
    """
    from visionloop.core.errors import SpecError
    from visionloop.core.settings import load_settings
    from visionloop.serve.config import load_serve_config, validate_serve_config
    from visionloop.serve.server import serve_forever
    from visionloop.serve.source import RegistrySource

    overrides = {
        "model": model,
        "host": host,
        "port": port,
        "precision": precision,
        "device": device,
        "max_batch_size": max_batch_size,
        "max_queue_delay_ms": max_queue_delay_ms,
        "canary_percent": canary,
        "shadow_percent": shadow,
    }
    if config is not None:
        cfg = load_serve_config(config, **overrides)
    else:
        if model is None:
            raise SpecError(
                "name a model to serve (e.g. `visionloop serve digits`) or pass --config serving.yaml."
            )
        cfg = validate_serve_config({k: v for k, v in overrides.items() if v is not None}, "the command line")
    settings = load_settings()
    source = RegistrySource(settings, fmt=cfg.format, precision=cfg.precision)
    # Resolve every model before binding the port: a missing export is a one-line error.
    from visionloop.registry import parse_ref

    for ref in cfg.refs:
        source.resolve(parse_ref(ref))
    err.print(f"loading {', '.join(cfg.refs)} ({cfg.format} {cfg.precision}, {cfg.device}) …")
    serve_forever(cfg, source, settings, on_ready=lambda server: _ready(server, cfg), on_stop=_stopped)


def _ready(server: Server, cfg: ServeConfig) -> None:
    for m in server.repo.models.values():
        roles = ", ".join(f"v{v.version} {'/'.join(sorted(v.roles))}" for v in m.loaded().values())
        out.print(f"serving {m.name}: {roles}")
    base = f"http://{cfg.host}:{cfg.port}"
    out.print(f"listening on {base}  (KServe v2: {base}/v2/models/NAME/infer; metrics: {base}/metrics)")


def _stopped(server: Server) -> None:
    # uvicorn logs its shutdown at warning level only when something is wrong: say it ended.
    m = server.metrics
    answered, errors = m.total(m.requests), m.total(m.errors)
    line = f"stopped: answered {answered} request{'s' if answered != 1 else ''}, {errors} with an error"
    if server.predlog is not None:
        line += f"; predictions logged to {server.predlog.path}"
    out.print(line, soft_wrap=True)
