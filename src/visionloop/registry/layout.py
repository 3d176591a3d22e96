"""Where a registered model version and its exports live on disk, and how a model is named.

The MLflow Model Registry holds names, versions, aliases and tags; the files of a version live
under the visionloop home, one folder per version, so that export, bench and serve read them
without going through MLflow's artifact store:

    <home>/models/<name>/v<version>/
        final.safetensors          the run's final weights
        model_card.json            arch, classes, preprocessing, metrics (models/card.py)
        spec.yaml                  the train spec, verbatim
        spec.resolved.yaml         the effective spec (absolute dataset path)
        lineage.json               run, dataset, metrics, weights sha256, who registered it
        exports/<format>-<precision>/
            model.onnx
            export.json            the export report: parity, accuracy gate, sha256, size

A reference to a model, as every command takes it: `NAME` (the champion, else the newest
version), `NAME@ALIAS` or `NAME/VERSION`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from visionloop.core.errors import VisionloopError

WEIGHTS_FILE = "final.safetensors"
CARD_FILE = "model_card.json"
SPEC_FILE = "spec.yaml"
EXPORTS_DIR = "exports"
ONNX_FILE = "model.onnx"
EXPORT_REPORT_FILE = "export.json"
# The report of a refused re-export, beside an earlier export that passed and is kept.
FAILED_EXPORT_REPORT_FILE = "export.failed.json"
SPEC_RESOLVED_FILE = "spec.resolved.yaml"
LINEAGE_FILE = "lineage.json"
# Per model, beside the version folders: every alias change, for `models show` and rollback.
ALIAS_HISTORY_FILE = "alias_history.json"

# MLflow allows more, but a name is also a folder name and a URL path segment.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_ALIAS = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
# ASCII digits only: str.isdigit() also takes '²' (int() then raises) and '٣' (read as 3).
_VERSION = re.compile(r"[0-9]{1,20}")  # past MAX_VERSION: check_version says so
# MLflow stores a version in an SQL INTEGER; a larger number is refused here, by name, rather
# than by SQLite as an overflow the store error would blame on the tracking store.
MAX_VERSION = 2**31 - 1


class ModelRefError(VisionloopError):
    """A model reference is malformed."""

    exit_code = 2


@dataclass(frozen=True)
class ModelRef:
    name: str
    alias: str | None = None
    version: int | None = None

    def __str__(self) -> str:
        if self.alias is not None:
            return f"{self.name}@{self.alias}"
        if self.version is not None:
            return f"{self.name}/{self.version}"
        return self.name


def _shown(text: str) -> str:
    """`text` quoted for an error message, cut short: a 100 kB argument is not echoed whole."""
    return repr(text) if len(text) <= 80 else f"{text[:60]!r}... ({len(text)} characters)"


def check_name(name: str) -> str:
    # fullmatch: `$` also matches before a final newline, which let "digits\n" through as a
    # model (and folder) name of its own.
    if not _NAME.fullmatch(name):
        raise ModelRefError(
            f"model name {_shown(name)} is not usable: use 1-128 letters, digits, '_', '.', '-', "
            "starting with a letter or digit (e.g. digits-cnn)."
        )
    return name


def check_alias(alias: str) -> str:
    if not _ALIAS.fullmatch(alias) or (alias.lower().startswith("v") and alias[1:].isdigit()):
        raise ModelRefError(
            f"alias {_shown(alias)} is not usable: use 1-64 letters, digits, '_', '-', starting with a "
            "letter, and not of the form v<number> (e.g. champion, challenger)."
        )
    return alias


def parse_ref(text: str) -> ModelRef:
    """`NAME`, `NAME@ALIAS` or `NAME/VERSION` → ModelRef; a clear error for anything else."""
    text = text.strip()
    if "@" in text:
        name, _, alias = text.partition("@")
        return ModelRef(check_name(name), alias=check_alias(alias))
    if "/" in text:
        name, _, version = text.partition("/")
        check_name(name)
        if not _VERSION.fullmatch(version) or int(version) < 1:
            raise ModelRefError(
                f"{_shown(text)}: the version after '/' must be a positive whole number, e.g. {name}/3."
            )
        return ModelRef(name, version=check_version(int(version)))
    return ModelRef(check_name(text))


def check_version(version: int) -> int:
    if not 1 <= version <= MAX_VERSION:
        raise ModelRefError(
            # (a huge int is not printed: str() of one past 4300 digits raises)
            f"version {version if abs(version) < 10**12 else '(a number that large)'} "
            f"does not exist: a version is a whole number from 1 to {MAX_VERSION}; "
            "`visionloop models show NAME` lists the versions."
        )
    return version


def models_root(home: Path) -> Path:
    return home / "models"


def model_dir(home: Path, name: str) -> Path:
    return models_root(home) / check_name(name)


def version_dir(home: Path, name: str, version: int) -> Path:
    return models_root(home) / check_name(name) / f"v{version}"


def export_dir(vdir: Path, fmt: str, precision: str) -> Path:
    return vdir / EXPORTS_DIR / f"{fmt}-{precision}"
