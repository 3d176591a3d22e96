"""Readers for cluster.toml's values: each checks one value's type and range and, when it
is wrong, names the key (and the file) and gives an example of a right one."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

from visionloop.core.errors import ConfigError

# Seconds (and GPU-seconds) past this are no setting anyone means, and a timeout that large
# overflows the OS's wait (threading.Event.wait(1e300) raises OverflowError in the control
# plane's loop, long after the config was accepted). 1e9 s is about 31 years.
MAX_SECONDS = 1e9
# A count of GPUs past this is a typo (or a hostile file): `count = 1000000000` would build a
# billion Gpu objects before the first job ran. Also well inside the job store's 32-bit
# INTEGER columns (PostgreSQL), which team quotas are written to.
MAX_GPUS = 100_000


def where(path: Path | None, key: str) -> str:
    return f"{path}: {key}" if path else key


def shown(v: Any, limit: int = 80) -> str:
    """`repr(v)` cut to `limit` characters: an error message must not echo a megabyte."""
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_finite(v: object) -> TypeGuard[int | float]:
    """A number that is neither nan nor infinite, nor an integer too large for a float (TOML
    integers are unbounded, and math.isfinite(10**400) raises OverflowError)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def number(
    section: Mapping[str, Any],
    key: str,
    default: float,
    path: Path | None,
    minimum: float = 0,
    maximum: float = MAX_SECONDS,
) -> float:
    v = section.get(key, default)
    # TOML has nan and inf: nan passes every comparison, and an infinite cycle, grace or
    # timeout would stall the control plane without a word.
    if not is_finite(v) or v < minimum:
        raise ConfigError(
            f"{where(path, key)} must be a finite number >= {minimum}, got {shown(v)} "
            f"(e.g. {key} = {default})."
        )
    if v > maximum:
        raise ConfigError(
            f"{where(path, key)} must be at most {maximum:g}, got {shown(v)} (e.g. {key} = {default})."
        )
    return float(v)


def whole_number(
    entry: Mapping[str, Any],
    key: str,
    default: int | None,
    path: Path | None,
    example: int,
    maximum: int = MAX_GPUS,
    section: str | None = None,
) -> int:
    """`entry[key]` (or `default`), a whole number from 0 to `maximum`; named `section.key` in
    errors when a section is given."""
    v = entry.get(key, default)
    name = f"{section}.{key}" if section else key
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(
            f"{where(path, name)} must be a whole number >= 0, got {shown(v)} (e.g. {key} = {example})."
        )
    if v > maximum:
        raise ConfigError(
            f"{where(path, name)} must be at most {maximum}, got {shown(v)} (e.g. {key} = {example})."
        )
    return v
