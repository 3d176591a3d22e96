"""The `[executor]` section of cluster.toml: where jobs run (local processes, a Ray cluster, a
Slurm cluster) and each kind's own keys, checked as `config.py` checks the rest (see its
docstring for the file as a whole)."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from visionloop.core.errors import ConfigError
from visionloop.sched.config_values import number, shown, where
from visionloop.sched.executors.naming import PREFIX_PATTERN

DEFAULT_RAY_ADDRESS = "http://127.0.0.1:8265"  # Ray's dashboard on a head node on this machine
EXECUTOR_KINDS = ("local", "ray", "slurm")
# A Slurm partition or account name: what sbatch takes, without spaces or shell characters.
_SLURM_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


@dataclass(frozen=True)
class ExecutorConfig:
    """Where jobs run: `kind` "local" (subprocesses here), "ray" (an existing Ray cluster,
    reached at `address`, its dashboard URL) or "slurm" (an existing Slurm cluster, through
    its client commands; `partition`, `account`, `slurm_conf`, `command_timeout_s` and
    `python` are its). `prefix` names both's submissions."""

    kind: Literal["local", "ray", "slurm"] = "local"
    address: str = DEFAULT_RAY_ADDRESS
    prefix: str = "vl"
    request_timeout_s: float = 30.0
    partition: str | None = None  # slurm: None is the cluster's default partition
    account: str | None = None
    slurm_conf: str | None = None  # slurm: None is $SLURM_CONF, else Slurm's own default
    command_timeout_s: float = 30.0
    python: str | None = None  # slurm: the interpreter on the nodes; None is this one's path


def parse_executor(section: Any, path: Path | None) -> ExecutorConfig:
    """The `[executor]` section: its kind and that kind's keys, each checked."""
    if not isinstance(section, dict):
        raise ConfigError(f'{where(path, "[executor]")} must be a table, e.g. [executor] kind = "ray".')
    kind = section.get("kind", "local")
    if kind not in EXECUTOR_KINDS:
        raise ConfigError(
            f'{where(path, "executor.kind")} must be "local", "ray" or "slurm", got {kind!r} '
            '(e.g. kind = "ray" with address = "http://HEAD:8265", or kind = "slurm" with partition = "gpu").'
        )
    keys_of = {
        "local": set[str](),
        "ray": {"address", "prefix", "request_timeout_s"},
        "slurm": {"partition", "account", "prefix", "slurm_conf", "command_timeout_s", "python"},
    }
    known = set().union(*keys_of.values())
    unknown = set(section) - {"kind"} - known
    if unknown:
        raise ConfigError(
            f"{where(path, '[executor]')} has unknown keys {sorted(unknown)}; known: kind, "
            + ", ".join(sorted(known))
            + "."
        )
    extra = sorted(set(section) - {"kind"} - keys_of[kind])
    if extra:
        owners = " or ".join(f'"{k}"' for k, keys in keys_of.items() if set(extra) & keys)
        raise ConfigError(
            f"{where(path, '[executor]')}: {', '.join(extra)} only apply to kind = {owners}; remove "
            f'them, or set kind accordingly (kind is "{kind}").'
        )
    if kind == "local":
        return ExecutorConfig()
    prefix = _prefix(section, path)
    if kind == "slurm":
        return _slurm_executor(section, path, prefix)
    d = ExecutorConfig()
    address = section.get("address", d.address)
    url = urllib.parse.urlsplit(address) if isinstance(address, str) else None
    if (
        url is None
        or url.scheme not in ("http", "https")
        or not url.hostname
        # urlsplit keeps NUL, spaces and control characters in the host; HTTP cannot send them.
        or any(c.isspace() or not c.isprintable() for c in address)
        or not _port_ok(url)
    ):
        hint = ""
        if url is not None and url.scheme == "ray":
            hint = " (ray:// is the Ray Client's address; visionloop uses the job submission API)"
        raise ConfigError(
            f"{where(path, 'executor.address')} must be the Ray dashboard's URL, got {shown(address)}{hint}; "
            'e.g. address = "http://HEAD:8265" (8265 is the dashboard port, not the GCS port 6379).'
        )
    return ExecutorConfig(
        kind="ray",
        address=address.rstrip("/"),
        prefix=prefix,
        request_timeout_s=number(section, "request_timeout_s", d.request_timeout_s, path, minimum=1),
    )


def _prefix(section: Mapping[str, Any], path: Path | None) -> str:
    prefix = section.get("prefix", ExecutorConfig.prefix)
    if not isinstance(prefix, str) or not PREFIX_PATTERN.fullmatch(prefix) or len(prefix) > 32:
        raise ConfigError(
            f"{where(path, 'executor.prefix')} must be lower-case letters, digits and '-' (at most 32), "
            f'got {shown(prefix)} (e.g. prefix = "vl-detection").'
        )
    return prefix


def _slurm_executor(section: Mapping[str, Any], path: Path | None, prefix: str) -> ExecutorConfig:
    d = ExecutorConfig()
    names: dict[str, str | None] = {}
    for key, example in (("partition", "gpu"), ("account", "vision")):
        v = section.get(key)
        if v is not None and (not isinstance(v, str) or not _SLURM_NAME.fullmatch(v)):
            raise ConfigError(
                f"{where(path, f'executor.{key}')} must be a Slurm {key} name (letters, digits, '_', '.', "
                f"'-'), got {shown(v)}; e.g. {key} = \"{example}\", or leave it out."
            )
        names[key] = v
    files: dict[str, str | None] = {}
    for key, example in (("slurm_conf", "/etc/slurm/slurm.conf"), ("python", "/opt/vl/.venv/bin/python")):
        v = section.get(key)
        if v is not None and (
            not isinstance(v, str) or not v.startswith("/") or any(not c.isprintable() for c in v)
        ):
            raise ConfigError(
                f"{where(path, f'executor.{key}')} must be an absolute path, got {shown(v)}; "
                f'e.g. {key} = "{example}", or leave it out.'
            )
        files[key] = v
    return ExecutorConfig(
        kind="slurm",
        prefix=prefix,
        partition=names["partition"],
        account=names["account"],
        slurm_conf=files["slurm_conf"],
        python=files["python"],
        command_timeout_s=number(section, "command_timeout_s", d.command_timeout_s, path, minimum=1),
    )


def _port_ok(url: urllib.parse.SplitResult) -> bool:
    """Whether the URL's port (if any) is a port: `url.port` raises ValueError for 99999."""
    try:
        url.port  # noqa: B018 - read for its check
    except ValueError:
        return False
    return True
