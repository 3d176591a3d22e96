"""The file side of a spec: reading a spec file safely (`read_spec_text`: a capped, regular,
UTF-8 file), parsing it into a YAML mapping (`parse_yaml_mapping`), `--set key.sub=value`
overrides (`apply_overrides`, through `set_dotted`), the train spec's paths (relative ones
resolved against the spec file's folder by `resolve_paths`; every one a spec holds by
`spec_paths`) and the YAML a validated spec is saved as (`spec_to_yaml`).
`visionloop.specs.load_train_spec` puts them together with validation."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel

from visionloop.core.errors import SpecError
from visionloop.core.fsutil import NotRegularFileError, NotTextError, TooLargeError, read_capped_text
from visionloop.core.safeyaml import load_untrusted

if TYPE_CHECKING:
    from visionloop.specs import TrainSpec

# A spec is a few lines of YAML: a file past this is not one (or is an attack on the reader).
MAX_SPEC_BYTES = 1024 * 1024
# The train spec's path fields that may be relative to the spec file's folder.
PATH_FIELDS = (("data", "dataset"), ("model", "pretrained"), ("model", "pretrained_backbone"))


class NotASectionError(Exception):
    """`set_dotted` met a value where the dotted path needs a section; `key` is that value's key."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def set_dotted(doc: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `a.b.c` in a nested mapping, making missing sections; raises NotASectionError when a
    key on the way holds a value. Each caller words the error for where the path came from
    (`--set`, a tune space)."""
    keys = dotted.split(".")
    node = doc
    for k in keys[:-1]:
        child = node.get(k)
        if child is None:
            child = node[k] = {}
        if not isinstance(child, dict):
            raise NotASectionError(k)
        node = child
    node[keys[-1]] = value


def apply_overrides(doc: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `key.sub=value` overrides (values parsed as YAML scalars) to a spec document."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--set expects key=value, e.g. --set optimizer.lr=0.01; got {item!r}.")
        try:
            value = load_untrusted(raw) if raw.strip() else None
        except yaml.YAMLError as e:
            raise SpecError(f"--set {item!r}: the value is not valid YAML ({e}).") from e
        dotted = key.strip()
        try:
            set_dotted(doc, dotted, value)
        except NotASectionError as e:
            field = dotted.rsplit(".", 1)[-1]
            raise SpecError(
                f"--set {dotted}: `{e.key}` is a value, not a section, so it has no field `{field}`."
            ) from None
    return doc


def parse_yaml_mapping(text: str, source: str) -> dict[str, Any]:
    """The YAML mapping in `text`. Parsed safely (no tags that build objects) and without
    aliases (`core.safeyaml`: nine aliases of nine stand for 9**9 values)."""
    try:
        doc = load_untrusted(text)
    except yaml.YAMLError as e:
        raise SpecError(f"{source} is not valid YAML: {e}") from e
    if doc is None:
        raise SpecError(f"{source} is empty. A minimal train spec:\n{MINIMAL_TRAIN_SPEC}")
    if not isinstance(doc, dict):
        raise SpecError(
            f"{source} must be a mapping of fields, got a {type(doc).__name__}. "
            f"Example:\n{MINIMAL_TRAIN_SPEC}"
        )
    return doc


def read_spec_text(path: Path, *, what: str = "train spec", example: str | None = None) -> str:
    """The file's text, or a SpecError that says what is wrong with the file; a missing file
    gets a minimal example of `what` it should hold (a train spec's by default). Only a
    regular file of at most MAX_SPEC_BYTES of UTF-8 is read: a FIFO would block the reader
    forever, /dev/zero never ends."""
    try:
        return read_capped_text(path, MAX_SPEC_BYTES, what=f"a {what}")
    except FileNotFoundError:
        example = MINIMAL_TRAIN_SPEC if example is None else example
        raise SpecError(f"{what} file {path} does not exist. A minimal {what}:\n{example}") from None
    except NotRegularFileError as e:
        kind = (e.strerror or "is not a regular file").split(";")[0]
        raise SpecError(f"{what} file {path} {kind}; give the path of a YAML file.") from None
    except OSError as e:
        raise SpecError(f"cannot read {what} file {path}: {e.strerror or e}") from e
    except TooLargeError:
        raise SpecError(
            f"{what} file {path} is larger than {MAX_SPEC_BYTES // 1024} KiB; a {what} is a few lines of "
            "YAML. Is it the right file?"
        ) from None
    except NotTextError as e:
        raise SpecError(f"{what} file {e}") from None


def resolve_paths(spec: TrainSpec, base: Path) -> TrainSpec:
    def fix(p: Path) -> Path:
        p = p.expanduser()
        return p if p.is_absolute() else (base / p).resolve()

    sections: dict[str, BaseModel] = {}
    for section, key in PATH_FIELDS:
        part = sections.get(section, getattr(spec, section))
        value = getattr(part, key)
        if value is not None:
            sections[section] = part.model_copy(update={key: fix(value)})
    return spec.model_copy(update=sections)


def spec_paths(spec: BaseModel, prefix: str = "") -> list[tuple[str, Path]]:
    """Every file-system path a spec holds, as (dotted field name, path), found by walking its
    fields (so a path field added later is included): what a queue job may read."""
    found: list[tuple[str, Path]] = []
    for name in type(spec).model_fields:
        value = getattr(spec, name)
        dotted = f"{prefix}{name}"
        if isinstance(value, Path):
            found.append((dotted, value))
        elif isinstance(value, BaseModel):
            found.extend(spec_paths(value, f"{dotted}."))
        elif isinstance(value, list | tuple):
            found.extend((f"{dotted}[{i}]", v) for i, v in enumerate(value) if isinstance(v, Path))
    return found


def spec_to_yaml(spec: TrainSpec) -> str:
    return yaml.safe_dump(spec.model_dump(mode="json"), sort_keys=False)


MINIMAL_TRAIN_SPEC = """\
data:
  dataset: path/to/dataset     # a folder made by `visionloop data ingest`
  batch_size: 64
  image_size: 224
model:
  arch: resnet18               # `visionloop archs` lists the choices
epochs: 10
"""
