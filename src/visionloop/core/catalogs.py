"""Reading an editable TOML catalog: the one shipped in `visionloop/assets/`, or a user's copy.

The price catalog (`sched.prices`) and the device catalog (`size.catalog`) are both read this
way; each parses the text itself and names the file in its errors.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from visionloop.core.errors import ConfigError
from visionloop.core.fsutil import NotRegularFileError, TooLargeError, read_capped

# A catalog is a few dozen entries: a file past this is not one.
MAX_CATALOG_BYTES = 4 * 1024 * 1024


def read_catalog(path: Path | None, *, asset: str, what: str, example: str, default_hint: str) -> str:
    """The text of the catalog at `path`, or of the shipped `visionloop/assets/<asset>` when
    None. A missing or unreadable file is a ConfigError naming it (`what`, e.g. "price
    catalog"), with a valid `example` and how to fall back to the default (`default_hint`)."""
    if path is None:
        return resources.files("visionloop").joinpath(f"assets/{asset}").read_text(encoding="utf-8")
    try:
        # Only a regular file: a FIFO would block the read forever, /dev/zero never ends.
        return read_capped(path, MAX_CATALOG_BYTES, what=f"a {what}").decode("utf-8")
    except TooLargeError:
        raise ConfigError(
            f"{what} {path} is larger than {MAX_CATALOG_BYTES // 2**20} MiB, too large to be one; "
            f"give the path of a TOML file such as\n{example}\nor {default_hint} to use the default one."
        ) from None
    except FileNotFoundError:
        raise ConfigError(
            f"{what} {path} does not exist; give the path of a TOML file such as\n{example}\n"
            f"or {default_hint} to use the default one."
        ) from None
    except NotRegularFileError as e:
        kind = (e.strerror or "is not a regular file").split(";")[0]
        raise ConfigError(f"{what} {path} {kind}; give the path of a TOML file, or {default_hint}.") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {what} {path}: {e}") from None
