"""Where the server's models come from: a `ModelSource` resolves references to ONNX files
plus model cards, and reports a model's aliases (polled to follow promotions).

`RegistrySource` is the real one (visionloop.registry: versions, aliases, exports).
`StaticSource` holds versions given directly (an exported ONNX file and its card); it serves a
model that was never registered, and lets tests move aliases without a registry.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from visionloop.core.errors import NotFoundError, VisionloopError
from visionloop.core.settings import Settings
from visionloop.models.card import ModelCard
from visionloop.registry.export_record import read_passing_export
from visionloop.registry.layout import ModelRef
from visionloop.serve.runtime import OnnxModel

log = logging.getLogger(__name__)


class ExportMissingError(VisionloopError):
    """The export a server needs has not been made (or failed its gate)."""


@dataclass(frozen=True)
class ResolvedVersion:
    """One version of one model, ready to load: its ONNX file and its card, and the temperature
    `visionloop eval` fitted on its validation split (None: confidences are served as the model
    gives them)."""

    name: str
    version: int
    path: Path
    card: ModelCard
    temperature: float | None = None
    # A registry export (RegistrySource): `load` runs the bytes its gate passed, checked against
    # the sha256 in its report. False for a file given directly (StaticSource), which has no
    # report to check against.
    registry_export: bool = False

    @property
    def ref(self) -> str:
        return f"{self.name}/{self.version}"

    def load(self, *, device: str = "cpu", intra_op_threads: int = 0) -> OnnxModel:
        """An ONNX Runtime session of this version. A registry export is read once and checked
        (`read_passing_export`: UnservableExportError, naming the file and the re-export to
        run, for a file that is not the one the gate passed), and ORT is handed those bytes,
        never the path, so the file cannot be swapped between the check and the load."""
        data = None
        if self.registry_export:
            data = read_passing_export(self.path.parent, ref=self.ref)
        return OnnxModel(self.path, device=device, intra_op_threads=intra_op_threads, data=data)


class ModelSource(Protocol):
    def resolve(self, ref: ModelRef) -> ResolvedVersion:
        """NAME → the champion (else the newest), NAME@ALIAS, NAME/VERSION."""
        ...

    def version(self, name: str, version: int) -> ResolvedVersion: ...

    def aliases(self, name: str) -> dict[str, int]:
        """alias → version; called about once a second per served model."""
        ...

    def rollback(self, name: str, alias: str, actor: str | None) -> int:
        """Move `alias` back to the version it pointed to before; return that version.
        Raises a VisionloopError naming why when there is nothing to roll back to."""
        ...


class StaticSource:
    """Versions registered in memory: `add(name, version, onnx_path, card)`; aliases set with
    `set_alias` take effect at the server's next poll, as a registry promotion would."""

    def __init__(self, champion_alias: str = "champion") -> None:
        self._versions: dict[str, dict[int, ResolvedVersion]] = {}
        self._aliases: dict[str, dict[str, int]] = {}
        # Per model and alias, the versions it pointed to before (what rollback returns to).
        self._history: dict[tuple[str, str], list[int]] = {}
        self._champion = champion_alias
        self._lock = threading.Lock()

    def add(
        self, name: str, version: int, path: Path, card: ModelCard, *, temperature: float | None = None
    ) -> ResolvedVersion:
        rv = ResolvedVersion(name, version, Path(path), card, temperature)
        with self._lock:
            self._versions.setdefault(name, {})[version] = rv
            self._aliases.setdefault(name, {})
        return rv

    def set_alias(self, name: str, alias: str, version: int) -> None:
        with self._lock:
            if version not in self._versions.get(name, {}):
                raise NotFoundError(f"{name} has no version {version}")
            previous = self._aliases[name].get(alias)
            if previous is not None and previous != version:
                self._history.setdefault((name, alias), []).append(previous)
            self._aliases[name][alias] = version

    def rollback(self, name: str, alias: str, actor: str | None) -> int:
        with self._lock:
            earlier = self._history.get((name, alias))
            if not earlier:
                raise NotFoundError(f"{name}@{alias} has no previous version to roll back to")
            version = earlier.pop()
            self._aliases[name][alias] = version
            return version

    def delete_alias(self, name: str, alias: str) -> None:
        with self._lock:
            self._aliases.get(name, {}).pop(alias, None)

    def aliases(self, name: str) -> dict[str, int]:
        with self._lock:
            return dict(self._aliases.get(name, {}))

    def version(self, name: str, version: int) -> ResolvedVersion:
        with self._lock:
            versions = self._versions.get(name)
            if not versions:
                raise NotFoundError(f"no model named {name!r}; known: {sorted(self._versions)}")
            if version not in versions:
                raise NotFoundError(f"{name} has no version {version}; it has {sorted(versions)}")
            return versions[version]

    def resolve(self, ref: ModelRef) -> ResolvedVersion:
        if ref.version is not None:
            return self.version(ref.name, ref.version)
        aliases = self.aliases(ref.name)
        if ref.alias is not None:
            if ref.alias not in aliases:
                raise NotFoundError(f"{ref.name} has no alias {ref.alias!r}; it has {sorted(aliases)}")
            return self.version(ref.name, aliases[ref.alias])
        if self._champion in aliases:
            return self.version(ref.name, aliases[self._champion])
        with self._lock:
            versions = self._versions.get(ref.name)
        if not versions:
            raise NotFoundError(f"no model named {ref.name!r}; known: {sorted(self._versions)}")
        return self.version(ref.name, max(versions))


class RegistrySource:
    """Models from the visionloop registry, serving the export of one format and precision."""

    def __init__(
        self, settings: Settings | None = None, *, fmt: str = "onnx", precision: str = "fp32"
    ) -> None:
        self.settings = settings
        self.fmt = fmt
        self.precision = precision

    def _resolved(self, info: object) -> ResolvedVersion:
        from visionloop.registry import ModelVersionInfo

        assert isinstance(info, ModelVersionInfo)
        path = info.export_path(self.fmt, self.precision)
        if path is None:
            raise ExportMissingError(
                f"{info.name}/{info.version} has no passing {self.fmt} {self.precision} export; run "
                f"`visionloop export {info.name}/{info.version} --precision {self.precision}` first."
            )
        return ResolvedVersion(
            info.name, info.version, Path(path), info.card(), _temperature(info.dir), registry_export=True
        )

    def resolve(self, ref: ModelRef) -> ResolvedVersion:
        from visionloop.registry import get_version

        return self._resolved(get_version(ref, settings=self.settings))

    def version(self, name: str, version: int) -> ResolvedVersion:
        return self.resolve(ModelRef(name, version=version))

    def aliases(self, name: str) -> dict[str, int]:
        from visionloop.registry import aliases

        return dict(aliases(name, settings=self.settings))

    def rollback(self, name: str, alias: str, actor: str | None) -> int:
        from visionloop.registry import rollback

        return rollback(name, alias=alias, actor=actor, settings=self.settings).version


def _temperature(version_dir: Path) -> float | None:
    """The version's stored temperature; a damaged file is logged and ignored (the model is
    served with its raw confidences rather than not at all)."""
    from visionloop.core.errors import DataError
    from visionloop.registry.evals import read_temperature

    try:
        return read_temperature(version_dir)
    except DataError as e:
        log.error("serving without calibration: %s", e)
        return None
