"""The task seam: everything task-specific lives under `visionloop.tasks`, behind the `Task`
contract, and every other module finds a task by name (`get_task`).

Two checks over the source tree, by its syntax (ast), not by running it:
- no module outside `tasks/` imports a task's own package (`tasks.classification`,
  `tasks.detection`, or any later one): only `visionloop.tasks` and its contract modules;
- no module outside `tasks/` compares a value with a task's name (`task == "detection"`,
  `card.task in ("classification", ...)`): branching on the task belongs to the task;
- no module of `data/` (ingest, shards, manifests) names a task's own words ("detection",
  "boxes"), not even in a comment: records, ingest dispatch and statistics are declared by the
  task (`record_fields`, `claims_source`, `task_stats`), so a third task adds a folder under
  `tasks/` and nothing else.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "visionloop"
TASKS = SRC / "tasks"
# What a module outside tasks/ may import from it: the package, its contract and its registry.
ALLOWED = {"visionloop.tasks", "visionloop.tasks.base", "visionloop.tasks.registry"}
# Known task names, and those other engineers are adding; a new task adds its name here.
TASK_NAMES = {"classification", "detection", "segmentation", "keypoints"}
DATA = SRC / "data"
# Words that belong to one task; the data layer must not need them.
TASK_WORDS = re.compile(r"detection|boxes", re.IGNORECASE)
# Modules outside tasks/ that may import a task's package, each with why (none today: the
# detection demo draws its scenes through the contract's `demo_source`).
EXEMPT_IMPORTS: dict[str, str] = {}


def _modules() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(SRC.rglob("*.py")):
        if path.is_relative_to(TASKS):
            continue
        yield path, ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _imported(tree: ast.Module) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module
            if node.module == "visionloop.tasks":
                # `from visionloop.tasks import classification` imports the subpackage.
                for alias in node.names:
                    yield node.lineno, f"{node.module}.{alias.name}"


def task_package_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every import of a task's own package in `tree`."""
    found = []
    for line, name in _imported(tree):
        if not name.startswith("visionloop.tasks."):
            continue
        parts = name.split(".")
        # visionloop.tasks.<X>...: X may be the contract (base, registry) or a name the package
        # re-exports (get_task, Task, ...): anything but a task's subpackage.
        if name in ALLOWED or ".".join(parts[:3]) in ALLOWED:
            continue
        if (TASKS / parts[2]).is_dir():
            found.append((line, name))
    return found


def _is_task_name(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in TASK_NAMES
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_is_task_name(e) for e in node.elts)
    return False


def task_name_comparisons(tree: ast.Module) -> list[int]:
    """Lines where something is compared (==, !=, in, not in, match) with a task's name."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_is_task_name(o) for o in operands):
                lines.append(node.lineno)
        elif isinstance(node, ast.match_case):
            pattern = node.pattern
            if isinstance(pattern, ast.MatchValue) and _is_task_name(pattern.value):
                lines.append(pattern.lineno)
    return lines


def test_the_tree_is_there() -> None:
    # A moved source tree must not make the checks below pass on nothing.
    assert (TASKS / "classification").is_dir()
    assert sum(1 for _ in _modules()) > 50


def test_no_module_outside_tasks_imports_a_task_package() -> None:
    offenders = [
        f"{path.relative_to(SRC.parent)}:{line} imports {name}"
        for path, tree in _modules()
        for line, name in task_package_imports(tree)
        if EXEMPT_IMPORTS.get(path.relative_to(SRC.parent).as_posix()) != name
    ]
    assert not offenders, "look the task up with visionloop.tasks.get_task(name) instead:\n" + "\n".join(
        offenders
    )


def test_no_module_outside_tasks_branches_on_a_task_name() -> None:
    offenders = [
        f"{path.relative_to(SRC.parent)}:{line}"
        for path, tree in _modules()
        for line in task_name_comparisons(tree)
    ]
    assert not offenders, "move the branch behind the Task contract:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    ("source", "imports", "comparisons"),
    [
        ("from visionloop.tasks.classification.transforms import decode_rgb", 1, 0),
        ("import visionloop.tasks.detection.metrics", 1, 0),
        ("from visionloop.tasks import classification", 1, 0),
        ("from visionloop.tasks import get_task, Task", 0, 0),
        ("from visionloop.tasks.base import Evaluator", 0, 0),
        ("from visionloop.tasks.evaluation import Evaluator", 0, 0),
        ("if card.task == 'detection':\n    pass", 0, 1),
        ("ok = task in ('classification', 'detection')", 0, 1),
        ("match task:\n    case 'classification':\n        pass", 0, 1),
        ("if name == 'classify':\n    pass", 0, 0),
    ],
)
def test_the_checks_catch_what_they_should(source: str, imports: int, comparisons: int) -> None:
    tree = ast.parse(source)
    assert len(task_package_imports(tree)) == imports
    assert len(task_name_comparisons(tree)) == comparisons


def test_no_module_of_the_data_layer_names_a_task() -> None:
    modules = sorted(DATA.rglob("*.py"))
    assert len(modules) > 10  # a moved data/ must not make this pass on nothing
    offenders = [
        f"{path.relative_to(SRC.parent)}:{n}: {line.strip()}"
        for path in modules
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if TASK_WORDS.search(line)
    ]
    assert not offenders, (
        "the data layer is task-agnostic: declare it on the task (record_fields, claims_source, "
        "ingest, dataset_stats) instead:\n" + "\n".join(offenders)
    )


def test_the_exemptions_are_still_needed() -> None:
    # An exemption whose import is gone must go too, or it would hide a later one.
    for rel, name in EXEMPT_IMPORTS.items():
        tree = ast.parse((SRC.parent / rel).read_text(encoding="utf-8"))
        assert name in [n for _, n in task_package_imports(tree)], f"{rel} no longer imports {name}"
