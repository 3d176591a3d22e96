"""Turn visionloop's names and values into what MLflow accepts, deterministically.

MLflow rejects a metric, param or tag key with characters outside `[\\w./ :-]`, or one that
a path normalisation would change (`a//b`, `./a`, `a/..`), and caps key and value lengths.
A class called `"cat/dog?"` must not make the tracker fail halfway through training, and the
same raw name must map to the same key in every process, so that a resumed run appends to the
series the first attempt started.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from collections.abc import Mapping
from typing import Any

# MLflow's own limits (mlflow.utils.validation); copied so this module needs no mlflow import.
MAX_KEY_LENGTH = 250
MAX_PARAM_VALUE_LENGTH = 6000
MAX_TAG_VALUE_LENGTH = 8000
TRUNCATION_MARKER = "...[truncated]"

# Unicode word characters, '.', '-', ' ' and '/' are accepted by MLflow everywhere. ':' is
# accepted only by servers that do not run on Windows, so it is replaced too: a key must stay
# valid whichever server a team points the store at later.
_UNSAFE = re.compile(r"[^\w.\- /]")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]


def _is_path_stable(key: str) -> bool:
    norm = posixpath.normpath(key)
    return norm == key and norm != "." and not norm.startswith(("..", "/"))


def sanitize_key(key: str) -> str:
    """Map `key` to a valid MLflow key; valid keys come back unchanged.

    Characters MLflow rejects become `_`; empty path segments are dropped and `.`/`..` segments
    become `_`/`__`, so `/` keeps grouping metrics in the UI (`val/recall/cat`). Keys over
    MLflow's length limit are cut and end with a hash of the full key, so two long keys that
    share a prefix stay distinct.
    """
    cleaned = _UNSAFE.sub("_", key)
    segments = [s for s in cleaned.split("/") if s != ""]
    segments = ["_" * len(s) if s in (".", "..") else s for s in segments]
    out = "/".join(segments) or "_"
    if out.startswith(".."):
        out = "_" + out[1:]
    if len(out) > MAX_KEY_LENGTH:
        out = out[: MAX_KEY_LENGTH - 9].rstrip("/") + "_" + _digest(key)
    if not _is_path_stable(out):  # pragma: no cover - the steps above leave no such case
        out = "key_" + _digest(key)
    return out


def metric_key(*parts: str) -> str:
    """Join name parts with `/`, escaping a `/` *inside* a part.

    `metric_key("val", "recall", "cat/dog?") == "val/recall/cat_dog_"`: a class name never
    opens a new level of the metric hierarchy.
    """
    return sanitize_key("/".join(p.replace("/", "_") for p in parts))


def truncate(value: str, limit: int) -> str:
    """Cut `value` to `limit` characters, ending with a visible marker when anything was cut."""
    if len(value) <= limit:
        return value
    return value[: limit - len(TRUNCATION_MARKER)] + TRUNCATION_MARKER


def param_value(value: Any) -> str:
    """The string MLflow stores for a param value: `str(value)` (as `mlflow.log_param` does,
    so values logged by other tools compare equal), truncated to MLflow's limit."""
    return truncate(str(value), MAX_PARAM_VALUE_LENGTH)


def tag_value(value: Any) -> str:
    return truncate(str(value), MAX_TAG_VALUE_LENGTH)


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"optimizer": {"lr": 0.1}, "aug": None}` -> `{"optimizer.lr": "0.1", "aug": "None"}`.

    Keys are sanitised and values stringified and truncated. An empty mapping is kept as `"{}"`
    so that the key still shows up in the run.
    """
    flat: dict[str, str] = {}
    for raw_key, value in params.items():
        key = f"{prefix}.{raw_key}" if prefix else str(raw_key)
        if isinstance(value, Mapping) and value:
            flat.update(flatten_params(value, key))
        else:
            flat[sanitize_key(key)] = param_value(value)
    return flat
