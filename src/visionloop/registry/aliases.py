"""Moving a model's aliases (`champion`, `challenger`, any name): set, unset and roll back,
each under the model's lock and recorded, with who, when and why, in its alias history (which
`rollback` goes by). The MLflow Model Registry holds where each alias points."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from visionloop.core.errors import VisionloopError
from visionloop.core.settings import Settings, load_settings
from visionloop.registry import files, history
from visionloop.registry import store as rstore
from visionloop.registry.api import (
    CHAMPION,
    ModelVersionInfo,
    RegistryError,
    get_version,
    is_usable,
    read_alias_map,
)
from visionloop.registry.layout import ALIAS_HISTORY_FILE, ModelRef, check_alias, check_name, model_dir


def set_alias(
    name: str,
    version: int,
    alias: str,
    *,
    actor: str | None = None,
    settings: Settings | None = None,
    reason: str | None = None,
    gate: dict[str, Any] | None = None,
    expected_previous: int | Literal["any"] | None = "any",
) -> ModelVersionInfo:
    """Point `alias` at `version` of `name`, and record who did it and when, with the `reason`
    and the promotion `gate`'s decision if given (stored as they are).

    `expected_previous`: the version the alias must still point to (None: no version) at the
    moment it moves, else nothing changes and RegistryError says so. A caller that decided on
    the current alias (the promotion gate) passes what it saw, so a concurrent move is never
    overwritten by a decision made about another version.
    """
    settings = settings or load_settings()
    check_alias(alias)
    target = get_version(ModelRef(check_name(name), version=version), settings)
    root = model_dir(settings.home, name)
    with files.model_lock(root):
        # Read the history before the alias moves: an unreadable one used to fail only after
        # MLflow had moved the alias, so the command reported an error for a change it had made,
        # and the change was missing from the history that rollback goes by.
        history.read_history(root / ALIAS_HISTORY_FILE)
        c = rstore.client(settings)
        try:
            previous = read_alias_map(c, name, settings).get(alias)
            if expected_previous != "any" and previous != expected_previous:
                seen = f"v{expected_previous}" if expected_previous is not None else "unset"
                now = f"v{previous}" if previous is not None else "unset"
                raise RegistryError(
                    f"{name}@{alias} changed while this change was being decided (it was {seen}, "
                    f"it is now {now}); nothing was moved. Run the command again to decide against {now}."
                )
            c.set_registered_model_alias(name, alias, str(version))
        except VisionloopError:
            raise
        except Exception as e:
            raise rstore.wrap(f"set alias {alias!r} of {name!r}", settings, e) from e
        _record_alias(root, "set", alias, version, previous, actor, reason=reason, gate=gate)
    return get_version(ModelRef(target.name, version=version), settings)


def unset_alias(
    name: str,
    alias: str,
    *,
    actor: str | None = None,
    settings: Settings | None = None,
    reason: str | None = None,
    expected: int | None = None,
) -> int | None:
    """Remove `alias` from `name` (a challenger whose canary ended, say) and record it; returns
    the version it pointed to (None: it was not set, and nothing is recorded). With `expected`,
    the alias is removed only while it still points to that version: a challenger someone
    else has moved on to another version since is left alone."""
    settings = settings or load_settings()
    check_alias(alias)
    if alias == CHAMPION:
        raise RegistryError(
            f"{name}@{CHAMPION} is what servers answer with; move it (`visionloop models promote`, "
            "`models rollback`) rather than remove it."
        )
    root = model_dir(settings.home, check_name(name))
    with files.model_lock(root):
        history.read_history(root / ALIAS_HISTORY_FILE)  # unreadable: refuse before anything moves
        c = rstore.client(settings)
        try:
            current = read_alias_map(c, name, settings).get(alias)
            if current is None or (expected is not None and current != expected):
                return None
            c.delete_registered_model_alias(name, alias)
        except VisionloopError:
            raise
        except Exception as e:
            raise rstore.wrap(f"remove alias {alias!r} of {name!r}", settings, e) from e
        _record_alias(root, "unset", alias, current, current, actor, reason=reason)
    return current


def rollback(
    name: str, *, alias: str = CHAMPION, actor: str | None = None, settings: Settings | None = None
) -> ModelVersionInfo:
    """Move `alias` (the champion) back to the version it pointed to before the current one."""
    settings = settings or load_settings()
    check_alias(alias)
    root = model_dir(settings.home, check_name(name))
    with files.model_lock(root):
        c = rstore.client(settings)
        try:
            current = read_alias_map(c, name, settings).get(alias)
            usable = {int(v.version) for v in rstore.versions(c, name) if is_usable(settings, v)}
        except VisionloopError:
            raise
        except Exception as e:
            raise rstore.wrap(f"read {name!r}", settings, e) from e
        if current is None:
            raise RegistryError(
                f"model {name!r} has no {alias!r} alias, so there is nothing to roll back. Set one with "
                f"`visionloop models alias {name} VERSION {alias}`."
            )
        stack = history.champion_stack(history.read_history(root / ALIAS_HISTORY_FILE), alias, current)
        earlier = [v for v in stack[:-1] if v in usable and v != current]
        if not earlier:
            raise RegistryError(
                f"{name}@{alias} is v{current} and has no previous {alias} to roll back to "
                f"(`visionloop models show {name}` prints the alias history). To move it anyway, "
                f"use `visionloop models alias {name} VERSION {alias}`."
            )
        target = earlier[-1]
        try:
            c.set_registered_model_alias(name, alias, str(target))
        except Exception as e:
            raise rstore.wrap(f"roll back {name}@{alias}", settings, e) from e
        _record_alias(root, "rollback", alias, target, current, actor)
    return get_version(ModelRef(name, version=target), settings)


def _record_alias(
    root: Path,
    action: str,
    alias: str,
    version: int,
    previous: int | None,
    actor: str | None,
    *,
    reason: str | None = None,
    gate: dict[str, Any] | None = None,
) -> None:
    """Append one alias change, with who and when (and why, and the gate's decision, when
    given), to the model's alias history."""
    event = history.AliasEvent(
        at=history.now_iso(),
        actor=actor or history.default_actor(),
        action=action,
        alias=alias,
        version=version,
        previous=previous,
        reason=reason,
        gate=gate,
    )
    history.append_event(root / ALIAS_HISTORY_FILE, event)
