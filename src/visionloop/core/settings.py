"""Where visionloop keeps its state.

Resolution order, first wins: environment (`VISIONLOOP_HOME`, `VISIONLOOP_TRACKING_URI`,
`VISIONLOOP_CHECKPOINT_STORE`, `VISIONLOOP_S3_ENDPOINT_URL`), then `visionloop.toml` in the
working directory, then `<home>/visionloop.toml`, then defaults.
Everything lives under one home so that a test (or a user) can point the whole tool at a
temporary folder with a single variable.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from visionloop.core.errors import ConfigError
from visionloop.core.fsutil import (
    NotRegularFileError,
    NotTextError,
    TooLargeError,
    ensure_private_dir,
    read_capped_text,
)
from visionloop.core.safetoml import TomlError, load_toml

DEFAULT_HOME = Path("~/.visionloop")
_KNOWN_KEYS = {"home", "tracking_uri", "experiment", "checkpoint_store", "s3_endpoint_url"}
# What labelling one image costs, per task: a table of task name = price, e.g.
# [visionloop.labelling_cost_per_image]  classification = 0.10  detection = 0.30
# (`data add` bills a new version's labelled images at it unless --cost-per-image says otherwise).
_PRICES_KEY = "labelling_cost_per_image"
MAX_PRICE_PER_IMAGE = 1000.0
# A visionloop.toml is a few lines: one past this is not one, and is not read into memory.
MAX_SETTINGS_BYTES = 64 * 1024


@dataclass(frozen=True)
class Settings:
    home: Path
    tracking_uri: str
    experiment: str = "default"
    # (task, price of labelling one image) pairs: a tuple, so that Settings stays hashable.
    labelling_prices: tuple[tuple[str, float], ...] = ()
    # Where training runs copy their checkpoints, so that a run resumes on a machine that
    # never had them (a spot instance's local disk goes with it): an s3:// or file:// URI
    # (visionloop.core.objectstore), and the endpoint of an S3-compatible server. None: the
    # run directory only.
    checkpoint_store: str | None = None
    s3_endpoint_url: str | None = None

    def labelling_cost_per_image(self, task: str) -> float | None:
        """What labelling one image of `task` costs, when the settings say."""
        return dict(self.labelling_prices).get(task)

    @property
    def runs_dir(self) -> Path:
        return self.home / "runs"

    @property
    def datasets_dir(self) -> Path:
        return self.home / "datasets"

    @property
    def weights_dir(self) -> Path:
        """Pretrained weights that queue jobs may load (`model.pretrained`)."""
        return self.home / "weights"

    @property
    def artifacts_dir(self) -> Path:
        return self.home / "artifacts"

    def ensure(self) -> Settings:
        """Create the home layout; return self so callers can chain.

        A new home is made 0700 (it holds the admin token, API key hashes and the job store);
        an existing one keeps the permissions its owner gave it."""
        ensure_private_dir(self.home)
        for d in (self.runs_dir, self.datasets_dir, self.artifacts_dir):
            d.mkdir(parents=True, exist_ok=True)
        return self


def open_home_warning(home: Path) -> str | None:
    """A warning when other users may enter an existing home (made before homes were created
    0700, or widened by hand): its databases and logs are readable there. None when private."""
    try:
        mode = home.stat().st_mode & 0o777
    except OSError:
        return None
    if not mode & 0o077:
        return None
    return (
        f"warning: {home} is open to other users (mode {mode:04o}); it holds the job store, the "
        f"tracking database and logs. Make it private: chmod 700 {home}"
    )


def _read_toml(path: Path) -> dict[str, Any]:
    fix = "Fix the file or remove it."
    try:
        # A regular file only (a FIFO would hang every command, /dev/zero never ends), read
        # to a limit: this runs at the start of nearly every command.
        text = read_capped_text(path, MAX_SETTINGS_BYTES, what="a settings file")
    except NotRegularFileError as e:
        raise ConfigError(f"{path} {(e.strerror or '').split(';')[0]}. {fix}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}. {fix}") from None
    except TooLargeError:
        raise ConfigError(
            f"{path} is larger than {MAX_SETTINGS_BYTES // 1024} KiB, too large for settings. {fix}"
        ) from None
    except NotTextError as e:
        raise ConfigError(str(e)) from None
    try:
        data = load_toml(text)
    except TomlError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}. {fix}") from e
    section = data.get("visionloop", data)
    if not isinstance(section, dict):
        raise ConfigError(f"{path}: expected a [visionloop] table, e.g.\n[visionloop]\nhome = '/data/vl'")
    section = dict(section)
    prices = section.pop(_PRICES_KEY, None)
    unknown = set(section) - _KNOWN_KEYS
    if unknown:
        raise ConfigError(
            f"{path}: unknown setting(s) {sorted(unknown)}; known settings are "
            f"{sorted(_KNOWN_KEYS | {_PRICES_KEY})}."
        )
    # Printable: a NUL in `home` crashed every command with "embedded null byte", and a newline
    # or escape in a URI ends up in logs and terminals.
    not_text = sorted(
        k for k, v in section.items() if not isinstance(v, str) or not v.strip() or not v.isprintable()
    )
    if not_text:
        raise ConfigError(
            f"{path}: {', '.join(not_text)} must be non-empty strings of printable characters, "
            'e.g. home = "/data/vl".'
        )
    if prices is not None:
        section[_PRICES_KEY] = _prices(path, prices)
    return section


def _prices(path: Path, table: Any) -> dict[str, float]:
    example = f"[visionloop.{_PRICES_KEY}]\nclassification = 0.10\ndetection = 0.30"
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: {_PRICES_KEY} must be a table of task = price per image, e.g.\n{example}")
    bad = sorted(
        str(k)
        for k, v in table.items()
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= MAX_PRICE_PER_IMAGE
    )
    if bad:
        raise ConfigError(
            f"{path}: {_PRICES_KEY} for {', '.join(bad)} must be a price per image from 0 to "
            f"{MAX_PRICE_PER_IMAGE:g}, e.g.\n{example}"
        )
    return {str(k): float(v) for k, v in table.items()}


def _home(path: Path, source: str) -> Path:
    """The home, resolved; a ConfigError naming where it came from (`source`) when it cannot be
    one: a file, FIFO or device where the folder should be (every command would otherwise
    fail later with "Not a directory: .../runs", or read nothing and start from scratch), a
    symbolic-link loop, a path too long or with characters the system refuses."""
    example = (
        "e.g. VISIONLOOP_HOME=~/.visionloop"
        if source.startswith("VISIONLOOP_HOME")
        else 'e.g. home = "/data/vl"'
    ) + " (it is created if missing)"
    try:
        home = path.expanduser().resolve()
        if home.exists() and not home.is_dir():
            raise ConfigError(
                f"{source}: {home} is not a folder; the visionloop home must be one. Point it at a "
                f"folder, {example}."
            )
    except (OSError, RuntimeError, ValueError) as e:  # RuntimeError: a symlink loop (3.11)
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)[:200]  # not a 4 KiB path again
        raise ConfigError(f"{source}: cannot use it as the visionloop home ({why}); {example}.") from None
    return home


def load_settings(cwd: Path | None = None) -> Settings:
    """Resolve settings from the environment and visionloop.toml files."""
    cwd = cwd or Path.cwd()
    env_home = os.environ.get("VISIONLOOP_HOME")
    local = cwd / "visionloop.toml"
    # exists(), not is_file(): a FIFO or device named visionloop.toml is refused (by
    # _read_toml), not silently taken for "no settings here".
    local_values = _read_toml(local) if local.exists() else {}
    if env_home:
        home_from = f"VISIONLOOP_HOME={env_home if len(env_home) <= 200 else env_home[:197] + '...'}"
    elif "home" in local_values:
        home_from = f"home in {local}"
    else:
        home_from = "the default home"
    home = _home(Path(env_home or local_values.get("home") or DEFAULT_HOME), home_from)
    # The home's own file has the lowest precedence: the working directory's file wins.
    home_file = home / "visionloop.toml"
    file_values = _read_toml(home_file) if home_file.exists() and home_file != local.resolve() else {}
    file_values.update(local_values)
    tracking_uri = (
        os.environ.get("VISIONLOOP_TRACKING_URI")
        or file_values.get("tracking_uri")
        or f"sqlite:///{home / 'mlflow.db'}"
    )
    experiment = os.environ.get("VISIONLOOP_EXPERIMENT") or file_values.get("experiment") or "default"
    prices = tuple(sorted((file_values.get(_PRICES_KEY) or {}).items()))
    sources = {k: local if k in local_values else home_file for k in ("checkpoint_store", "s3_endpoint_url")}
    store = _store_uri(
        os.environ.get("VISIONLOOP_CHECKPOINT_STORE") or file_values.get("checkpoint_store"),
        "VISIONLOOP_CHECKPOINT_STORE"
        if os.environ.get("VISIONLOOP_CHECKPOINT_STORE")
        else f"checkpoint_store in {sources['checkpoint_store']}",
    )
    endpoint = _endpoint(
        os.environ.get("VISIONLOOP_S3_ENDPOINT_URL") or file_values.get("s3_endpoint_url"),
        "VISIONLOOP_S3_ENDPOINT_URL"
        if os.environ.get("VISIONLOOP_S3_ENDPOINT_URL")
        else f"s3_endpoint_url in {sources['s3_endpoint_url']}",
    )
    return Settings(
        home=home,
        tracking_uri=str(tracking_uri),
        experiment=str(experiment),
        labelling_prices=prices,
        checkpoint_store=store,
        s3_endpoint_url=endpoint,
    )


def _store_uri(value: str | None, source: str) -> str | None:
    """A checkpoint store URI, checked now: a typo is found at the first command, not after
    a day of training with nothing copied."""
    from visionloop.core.objectstore import parse_store_uri

    return parse_store_uri(value, what=source).uri if value else None


_ENDPOINT = re.compile(r"^https?://[A-Za-z0-9.\-\[\]:]+(:\d{1,5})?/?$")


def _endpoint(value: str | None, source: str) -> str | None:
    if not value:
        return None
    if not _ENDPOINT.match(value.strip()):
        raise ConfigError(
            f"{source} must be an http(s) URL of an S3-compatible server, with no path: "
            f'e.g. s3_endpoint_url = "http://minio.internal:9000"; got {value[:80]!r}.'
        )
    return value.strip().rstrip("/")
