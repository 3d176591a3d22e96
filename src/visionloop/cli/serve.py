"""`visionloop serve MODEL`: the inference server for registered models, and
`visionloop serve keys create|list|revoke`: its API keys."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from typer.core import TyperCommand

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
    keys: bool = typer.Option(
        False,
        "--keys",
        help="Require an API key on every request but health checks (on anyway once a key exists).",
    ),
    insecure_no_auth: bool = typer.Option(
        False,
        "--insecure-no-auth",
        help="Serve without API keys even if some exist, on any address (a proxy in front authenticates).",
    ),
    ssl_certfile: Path | None = typer.Option(
        None, "--ssl-certfile", help="Serve HTTPS with this certificate chain (PEM); needs --ssl-keyfile."
    ),
    ssl_keyfile: Path | None = typer.Option(
        None, "--ssl-keyfile", help="The certificate's private key (PEM, unencrypted; keep it 0600)."
    ),
) -> None:
    """Serve models over the Open Inference Protocol (KServe v2 REST), Triton-client compatible.

    The bare model name is answered by its `champion`; a `challenger` takes --canary percent.

    With --shadow, the challenger gets a copy of requests; its answers are compared, not returned.

    Promote or roll back in the registry: the server follows within a second, without a restart.

    At run time: GET/PUT /v2/models/NAME/routing (canary and shadow share) and
    POST /v2/models/NAME/rollback, with a key made with --routing.

    Also: /v2/models/NAME/classify takes an image file and returns labels; /metrics is Prometheus.

    API keys: `visionloop serve keys create NAME --models M` prints one; send `Authorization: Bearer KEY`.

    Once a key exists (or with --keys), all but /v2/health/* need one; `keys revoke` needs no restart.

    /metrics needs a key for all models (--models '*').

    Without keys the server listens on loopback only; --insecure-no-auth lifts both rules.

    HTTPS: --ssl-certfile and --ssl-keyfile, or a TLS-terminating reverse proxy (see the README).
    """
    from visionloop.core.errors import SpecError
    from visionloop.core.settings import load_settings, open_home_warning
    from visionloop.serve.config import load_serve_config, validate_serve_config
    from visionloop.serve.server import check_exposure, check_tls, resolve_keys, serve_forever
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
    if (warning := open_home_warning(settings.home)) is not None:
        err.print(warning, soft_wrap=True)
    if (ssl_certfile is None) != (ssl_keyfile is None):
        raise SpecError("pass both --ssl-certfile and --ssl-keyfile (or neither).")
    tls = (ssl_certfile, ssl_keyfile) if ssl_certfile is not None and ssl_keyfile is not None else None
    check_tls(tls)
    ring = resolve_keys(settings, require=keys, insecure_no_auth=insecure_no_auth)
    check_exposure(cfg.host, ring, insecure_no_auth)  # before loading models: a one-line error
    source = RegistrySource(settings, fmt=cfg.format, precision=cfg.precision)
    # Resolve every model before binding the port: a missing export is a one-line error.
    from visionloop.registry import parse_ref

    for ref in cfg.refs:
        source.resolve(parse_ref(ref))
    if ring is None:
        why = "--insecure-no-auth" if insecure_no_auth else "loopback, no keys"
        err.print(f"API keys: off ({why})")
    elif len(ring) == 0:
        err.print(
            "API keys: on, but none exists yet: every request but health checks gets 401 until "
            "`visionloop serve keys create NAME --models M` makes one"
        )
    else:
        err.print(f"API keys: on ({len(ring)} key(s) in {ring.path})", soft_wrap=True)
    err.print(f"loading {', '.join(cfg.refs)} ({cfg.format} {cfg.precision}, {cfg.device}) …")
    serve_forever(
        cfg,
        source,
        settings,
        on_ready=lambda server: _ready(server, cfg, tls is not None),
        on_stop=_stopped,
        keys=ring,
        insecure_no_auth=insecure_no_auth,
        tls=tls,
    )


def _ready(server: Server, cfg: ServeConfig, https: bool = False) -> None:
    for m in server.repo.models.values():
        roles = ", ".join(f"v{v.version} {'/'.join(sorted(v.roles))}" for v in m.loaded().values())
        out.print(f"serving {m.name}: {roles}")
    base = f"{'https' if https else 'http'}://{cfg.host}:{cfg.port}"
    out.print(f"listening on {base}  (KServe v2: {base}/v2/models/NAME/infer; metrics: {base}/metrics)")


def _stopped(server: Server) -> None:
    # uvicorn logs its shutdown at warning level only when something is wrong: say it ended.
    m = server.metrics
    answered, errors = m.total(m.requests), m.total(m.errors)
    line = f"stopped: answered {answered} request{'s' if answered != 1 else ''}, {errors} with an error"
    if server.predlog is not None:
        line += f"; predictions logged to {server.predlog.path}"
    out.print(line, soft_wrap=True)


# --------------------------------------------------------------------------- keys

keys_app = typer.Typer(
    help="API keys of the inference server (stored hashed in <home>/serve/keys.json, mode 0600).",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@keys_app.command("create")
def keys_create(
    name: str = typer.Argument(..., help="A name to recognise the key by (who has it), e.g. frontend."),
    models: str = typer.Option(
        ..., "--models", "-m", help="Comma-separated models the key may use, or '*' for all."
    ),
    routing: bool = typer.Option(
        False, "--routing", help="Also allow changing routing (canary, shadow, rollback), not only inference."
    ),
) -> None:
    """Make a key and print it once (only its hash is kept): give it to the client now.

    A running server picks it up within a second, no restart needed.
    """
    from visionloop.core.settings import load_settings
    from visionloop.serve.keys import KeyStore

    record, key = KeyStore(load_settings().home).create(name, models.split(","), routing=routing)
    err.print(
        f"API key {record.name!r} for {', '.join(record.models)} ({', '.join(record.scopes)}); "
        "it is shown once, store it now:",
        soft_wrap=True,
    )
    out.print(key, soft_wrap=True, highlight=False)


@keys_app.command("list")
def keys_list() -> None:
    """List the keys: name, id (the 8 hex digits after vlk_), models, scopes, age. Never the keys."""
    from visionloop.core.settings import load_settings
    from visionloop.serve.keys import KeyStore

    store = KeyStore(load_settings().home)
    keys = store.keys()
    if not keys:
        err.print(f"no API keys in {store.path}; `visionloop serve keys create NAME --models M` makes one")
        return
    for k in keys:
        made = time.strftime("%Y-%m-%d %H:%M", time.localtime(k.created_at))
        out.print(
            f"{k.name}\tvlk_{k.id}_…\t{','.join(k.models)}\t{','.join(k.scopes)}\t{made}",
            soft_wrap=True,
            highlight=False,
        )


@keys_app.command("revoke")
def keys_revoke(
    name: str = typer.Argument(..., help="The key's name (see `visionloop serve keys list`)."),
) -> None:
    """Delete a key; running servers refuse it within a second."""
    from visionloop.core.settings import load_settings
    from visionloop.serve.keys import KeyStore

    gone = KeyStore(load_settings().home).revoke(name)
    err.print(f"revoked API key {gone.name!r} (vlk_{gone.id}_…)")


class ServeCommand(TyperCommand):
    """`visionloop serve` is one command (MODEL is its argument) that also answers
    `visionloop serve keys …` by handing the rest of the line to `keys_app`."""

    _KEYS = "keys"

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:  # type: ignore[override]
        if args[:1] == [self._KEYS]:
            ctx.meta["visionloop.serve.keys"] = args[1:]
            return []
        return super().parse_args(ctx, args)

    def invoke(self, ctx: typer.Context) -> Any:  # type: ignore[override]
        rest = ctx.meta.pop("visionloop.serve.keys", None)
        if rest is None:
            return super().invoke(ctx)
        group = typer.main.get_command(keys_app)
        # Named "serve keys" under serve's parent: usage lines read `visionloop serve keys …`.
        with group.make_context(f"{ctx.info_name} {self._KEYS}", list(rest), parent=ctx.parent) as sub:
            return group.invoke(sub)
