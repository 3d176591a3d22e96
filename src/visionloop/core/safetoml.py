"""TOML from a user's file, every way it can fail as one error (the TOML twin of `safeyaml`).

`tomllib` raises `TOMLDecodeError` for bad syntax, but two other failures pass through it:
`RecursionError` for `x = [[[[...]]]]` a thousand levels deep (it recurses per level), and a
plain `ValueError` for an integer past Python's 4300-digit conversion limit. Each reader of a
user's TOML words the one `TomlError` for its own file."""

from __future__ import annotations

import tomllib
from typing import Any


class TomlError(ValueError):
    """The text is not valid TOML; str() says why, in words for the file's owner."""


def load_toml(text: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise TomlError(str(e)) from e
    except RecursionError as e:
        raise TomlError("it nests too deeply") from e  # not "maximum recursion depth exceeded"
    except ValueError as e:  # an integer of more than 4300 digits
        why = str(e).split("; use sys.set_int_max_str_digits")[0]  # advice for programmers only
        raise TomlError(why or type(e).__name__) from e
