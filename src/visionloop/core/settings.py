"""Where visionloop keeps its state.

Resolution order, first wins: environment (`VISIONLOOP_HOME`, `VISIONLOOP_TRACKING_URI`),
then `visionloop.toml` in the working directory, then `<home>/visionloop.toml`, then defaults.
Everything lives under one home so that a test (or a user) can point the whole tool at a
temporary folder with a single variable.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from visionloop.core.errors import ConfigError

DEFAULT_HOME = Path("~/.visionloop")
_KNOWN_KEYS = {"home", "tracking_uri", "experiment"}


@dataclass(frozen=True)
class Settings:
    home: Path
    tracking_uri: str
    experiment: str = "default"

    @property
    def runs_dir(self) -> Path:
        return self.home / "runs"

    @property
    def datasets_dir(self) -> Path:
        return self.home / "datasets"

    @property
    def artifacts_dir(self) -> Path:
        return self.home / "artifacts"

    def ensure(self) -> Settings:
        """Create the home layout; return self so callers can chain."""
        for d in (self.home, self.runs_dir, self.datasets_dir, self.artifacts_dir):
            d.mkdir(parents=True, exist_ok=True)
        return self


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}. Fix the file or remove it.") from e
    section = data.get("visionloop", data)
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: expected a [visionloop] table, e.g.\n[visionloop]\nhome = '/data/vl'")
    unknown = set(section) - _KNOWN_KEYS
    if unknown:
        raise ConfigError(
            f"{path}: unknown setting(s) {sorted(unknown)}; known settings are {sorted(_KNOWN_KEYS)}."
        )
    return dict(section)


def load_settings(cwd: Path | None = None) -> Settings:
    """Resolve settings from the environment and visionloop.toml files."""
    cwd = cwd or Path.cwd()
    file_values: dict[str, Any] = {}
    env_home = os.environ.get("VISIONLOOP_HOME")
    home_guess = Path(env_home).expanduser() if env_home else DEFAULT_HOME.expanduser()
    for candidate in (home_guess / "visionloop.toml", cwd / "visionloop.toml"):
        if candidate.is_file():
            file_values.update(_read_toml(candidate))

    home = Path(env_home or file_values.get("home") or DEFAULT_HOME).expanduser().resolve()
    tracking_uri = (
        os.environ.get("VISIONLOOP_TRACKING_URI")
        or file_values.get("tracking_uri")
        or f"sqlite:///{home / 'mlflow.db'}"
    )
    experiment = os.environ.get("VISIONLOOP_EXPERIMENT") or file_values.get("experiment") or "default"
    return Settings(home=home, tracking_uri=str(tracking_uri), experiment=str(experiment))
