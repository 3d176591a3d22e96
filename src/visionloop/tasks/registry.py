"""The task registry: one name → one `Task` (classification, detection, ...).

Every stage after ingest asks the registry for the task named in the dataset manifest or the
model card, and then only talks to the `Task` contract (`visionloop.tasks.base`):

>>> task = get_task(card.task)
>>> answer = task.served_answer(outputs, card.class_names, options=AnswerOptions(top_k=5))

A task registers itself with a class decorator in its own subpackage:

>>> @register_task("my_task")
... class MyTask(Task): ...

Registration is lazy, as for the model architectures: importing this module imports no task
and no torch (the server and the CLI import it); the first query imports the built-in tasks.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from visionloop.core.errors import DataError, SpecError

if TYPE_CHECKING:
    from visionloop.tasks.base import Task

_TaskT = TypeVar("_TaskT", bound="type[Task]")

# Modules that register the built-in tasks when imported. A task under development registers
# itself the same way once its module is listed here (or imported by whoever uses it).
_BUILTIN_MODULES: tuple[str, ...] = ("visionloop.tasks.classification", "visionloop.tasks.detection")

_REGISTRY: dict[str, type[Task]] = {}
_INSTANCES: dict[str, Task] = {}
_loaded = False


def register_task(name: str) -> Callable[[_TaskT], _TaskT]:
    """Register a `Task` subclass under `name`; its instances are built with no arguments."""

    def decorate(cls: _TaskT) -> _TaskT:
        existing = _REGISTRY.get(name)
        # The same class registered twice (a module reloaded in a notebook) is harmless; two
        # different classes under one name would silently pick one.
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(f"task {name!r} is already registered ({existing.__qualname__}); pick another")
        cls.name = name
        _REGISTRY[name] = cls
        _INSTANCES.pop(name, None)
        return cls

    return decorate


def list_tasks() -> list[str]:
    """The registered task names, sorted."""
    _ensure_loaded()
    return sorted(_REGISTRY)


def get_task(name: str) -> Task:
    """The task registered as `name` (one shared, stateless instance)."""
    _ensure_loaded()
    cls = _REGISTRY.get(name)
    if cls is None:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise SpecError(
            f"unknown task {name!r}; the known tasks are: {known} (e.g. task: classification). "
            "A dataset or model card naming another task was made by a newer visionloop."
        )
    task = _INSTANCES.get(name)
    if task is None:
        task = _INSTANCES[name] = cls()
    return task


def source_formats() -> dict[str, str]:
    """Every `--format` name a registered task reads → that task's name."""
    owners: dict[str, str] = {}
    for name in list_tasks():
        for fmt in get_task(name).source_formats:
            owners.setdefault(fmt.lower(), name)
    return owners


def task_for_source(source: Path, format: str | None = None) -> Task:
    """The task that ingests `source`: the one that reads `format` when given; else the one
    whose `claims_source` recognises the source; else the fallback task (an ImageFolder or
    CSV), whose ingest says what is wrong with a source nobody reads."""
    tasks = [get_task(name) for name in list_tasks()]
    if format is not None:
        owners = source_formats()
        owner = owners.get(format.lower())
        if owner is None:
            by_task = {t.name: [f for f, owner in owners.items() if owner == t.name] for t in tasks}
            groups = [f"{', '.join(fmts)} ({name})" for name, fmts in by_task.items() if fmts]
            known = "; ".join(groups) or "none"
            raise DataError(
                f"unknown source format {format!r}: --format must be one of {known}. Leave it out to "
                "let ingest recognise the source by its layout."
            )
        return get_task(owner)
    claimed = [t for t in tasks if not t.ingest_fallback and t.claims_source(Path(source))]
    if len(claimed) > 1:
        names = ", ".join(t.name for t in claimed)
        raise DataError(
            f"{source} has the layout of sources of several tasks ({names}); pass --format to say "
            "which to read it as."
        )
    if claimed:
        return claimed[0]
    fallback = [t for t in tasks if t.ingest_fallback]
    if len(fallback) != 1:
        raise DataError(f"no task recognises {source} as a source it reads; pass --format.")
    return fallback[0]


def _ensure_loaded() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
