"""YAML from a user's file, parsed without aliases.

`yaml.safe_load` builds no objects, but it does resolve aliases (`*name`), and nine levels of
nine aliases each are a few hundred bytes that stand for 9**9 values: anything that walks the
result (a check, an error message's repr) then runs out of memory or time. No file visionloop
reads needs an alias, so a document that uses one is refused with a message saying so.
"""

from __future__ import annotations

from typing import Any

import yaml


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases (anchors alone are harmless and are allowed)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(
                None,
                None,
                f"uses the alias *{event.anchor}, which this file does not allow "
                "(aliases can expand without bound); write the values out in full",
                event.start_mark,
            )
        return super().compose_node(parent, index)


def load_untrusted(text: str) -> Any:
    """`yaml.safe_load` of `text`, refusing aliases with a `yaml.YAMLError`; so are a number
    too long to convert (Python's 4300-digit limit) and nesting too deep to build."""
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # a SafeLoader subclass
    except ValueError as e:  # 5000-digit numbers, dates like 2024-13-45
        why = str(e).split("; use sys.set_int_max_str_digits")[0]  # advice for programmers only
        raise yaml.YAMLError(f"a value cannot be read: {why}") from e
    except RecursionError as e:
        raise yaml.YAMLError("it nests too deeply") from e
