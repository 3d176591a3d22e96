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
from typing import TYPE_CHECKING, TypeVar

from visionloop.core.errors import SpecError

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


def _ensure_loaded() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
