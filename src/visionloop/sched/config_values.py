"""Readers for cluster.toml's values: each checks one value's type and range and, when it
is wrong, names the key (and the file) and gives an example of a right one."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from visionloop.core.errors import ConfigError


def where(path: Path | None, key: str) -> str:
    return f"{path}: {key}" if path else key


def number(
    section: Mapping[str, Any], key: str, default: float, path: Path | None, minimum: float = 0
) -> float:
    v = section.get(key, default)
    # TOML has nan and inf: nan passes every comparison, and an infinite cycle, grace or
    # timeout would stall the control plane without a word.
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < minimum:
        raise ConfigError(
            f"{where(path, key)} must be a finite number >= {minimum}, got {v!r} (e.g. {key} = {default})."
        )
    return float(v)


def whole_number(
    entry: Mapping[str, Any], key: str, default: int | None, path: Path | None, example: int
) -> int:
    v = entry.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(
            f"{where(path, key)} must be a whole number >= 0, got {v!r} (e.g. {key} = {example})."
        )
    return v
