"""The model registry as function calls: register a finished run, find versions, move aliases.

Names, versions, aliases and tags live in the MLflow Model Registry (the tracking store from
settings); each version's files live under `<home>/models/<name>/v<version>/` (see `layout`),
so export, bench and serve read plain files. The `visionloop models` commands are thin
renderings of these functions.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from visionloop.core.errors import NotFoundError, VisionloopError
from visionloop.core.fsutil import TooLargeError, atomic_write_json, read_capped
from visionloop.core.settings import Settings, load_settings
from visionloop.models.card import ModelCard
from visionloop.registry import files, history, runsource
from visionloop.registry import store as rstore
from visionloop.registry.export_record import ExportReport, read_export_report
from visionloop.registry.export_record import (
    passing_export as passing_export,  # re-exported: it lived here before it moved beside the record
)
from visionloop.registry.layout import (
    ALIAS_HISTORY_FILE,
    CARD_FILE,
    EXPORT_REPORT_FILE,
    FAILED_EXPORT_REPORT_FILE,
    LINEAGE_FILE,
    WEIGHTS_FILE,
    ModelRef,
    check_name,
    check_version,
    export_dir,
    model_dir,
    parse_ref,
    version_dir,
)

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion

CHAMPION = "champion"
# A version still not ready this long after MLflow created it belongs to a registration that
# died between creating it and publishing its folder. Younger ones may be in progress through
# another home that shares the tracking store (the per-model lock is per home), so they stay.
ABANDONED_AFTER_S = 3600.0


class RegistryError(VisionloopError):
    """A registry change was refused (nothing to roll back to, a version that is not ready)."""


@dataclass(frozen=True)
class ModelVersionInfo:
    name: str
    version: int
    dir: Path
    aliases: tuple[str, ...]
    run_id: str | None
    created_at: str
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        return f"{self.name}/{self.version}"

    def card(self) -> ModelCard:
        return ModelCard.load(self.dir / CARD_FILE)

    @property
    def weights(self) -> Path:
        return self.dir / WEIGHTS_FILE

    def verified_weights_bytes(self) -> bytes:
        """The weights' bytes, read once and checked against the sha256 recorded at
        registration: a file replaced by hand (another run's weights, a link, a folder) would
        otherwise be exported, evaluated or benchmarked under this version's name and lineage.

        These bytes are what is loaded (`task.load_model(card, data)`): checking the file and
        then handing a loader its path would leave a window between the check and the loader's
        own read in which the file could be swapped. The read is bounded (MAX_WEIGHTS_BYTES, see
        models.weights) and never waits on a FIFO put in the file's place."""
        from visionloop.models.weights import MAX_WEIGHTS_BYTES

        path = self.weights
        again = (
            f"Restore it, or register the run again (`visionloop models register RUN --name {self.name}`)."
        )
        try:
            data = read_capped(path, MAX_WEIGHTS_BYTES, what="a model's weights")
        except FileNotFoundError as e:
            raise RegistryError(f"{path} is missing: {self.ref} has no weights. {again}") from e
        except (OSError, TooLargeError) as e:
            raise RegistryError(f"{self.ref}'s weights cannot be read: {e}. {again}") from e
        sha = hashlib.sha256(data).hexdigest()
        registered = self.tags.get(rstore.WEIGHTS_SHA_TAG)
        if registered and sha != registered:
            raise RegistryError(
                f"{path} is not the file registered as {self.ref} (sha256 {sha[:16]}..., registered "
                f"{registered[:16]}...): it was changed or replaced after registration. {again}"
            )
        return data

    def lineage(self) -> dict[str, Any]:
        """lineage.json; {} when it is missing or unusable (readers show '-' for its fields).
        files.read_json: a FIFO, a huge, non-UTF-8 or too deeply nested file reads as {}
        instead of hanging or raising past the CLI."""
        try:
            raw = files.read_json(self.dir / LINEAGE_FILE)
        except (OSError, files.UnreadableFileError):
            return {}
        return raw if isinstance(raw, dict) else {}

    def export_report(
        self, fmt: str = "onnx", precision: str = "fp32", *, refused_reexport: bool = False
    ) -> ExportReport | None:
        """The export's report (export.json) as written, passed or failed; None if never exported.
        With `refused_reexport`, the report of the latest re-export that the gate refused while an
        earlier passing export was kept (export.failed.json); None if there is none."""
        name = FAILED_EXPORT_REPORT_FILE if refused_reexport else EXPORT_REPORT_FILE
        return read_export_report(export_dir(self.dir, fmt, precision) / name)

    def export_path(self, fmt: str = "onnx", precision: str = "fp32") -> Path | None:
        """The exported model file if the export exists and passed its gate; else None.

        A failed export keeps its report (for `models show`) but must never be served.
        """
        return passing_export(export_dir(self.dir, fmt, precision))

    def exports(self, *, refused_reexports: bool = False) -> dict[str, ExportReport]:
        """`<format>-<precision>` → report, for every export attempted on this version; with
        `refused_reexports`, the refused re-exports beside a kept export instead."""
        root = self.dir / "exports"
        out: dict[str, ExportReport] = {}
        if root.is_dir():
            for sub in sorted(root.iterdir()):
                fmt, _, precision = sub.name.partition("-")
                report = self.export_report(fmt, precision, refused_reexport=refused_reexports)
                if report is not None:
                    out[sub.name] = report
        return out


@dataclass(frozen=True)
class ModelSummary:
    name: str
    versions: int
    latest: int | None
    aliases: dict[str, int]
    updated_at: str


def _iso(ms: int | None) -> str:
    return datetime.fromtimestamp((ms or 0) / 1000, tz=UTC).isoformat(timespec="seconds")


def _info(settings: Settings, mv: ModelVersion, alias_map: dict[str, int]) -> ModelVersionInfo:
    version = int(mv.version)
    return ModelVersionInfo(
        name=str(mv.name),
        version=version,
        dir=version_dir(settings.home, str(mv.name), version),
        aliases=tuple(sorted(a for a, v in alias_map.items() if v == version)),
        run_id=mv.run_id or None,
        created_at=_iso(mv.creation_timestamp),
        tags=dict(mv.tags or {}),
    )


def read_alias_map(c: MlflowClient, name: str, settings: Settings) -> dict[str, int]:
    return {str(a): int(v) for a, v in (rstore.get_model(c, name, settings).aliases or {}).items()}


def is_usable(settings: Settings, mv: ModelVersion) -> bool:
    return rstore.is_ready(mv) and version_dir(settings.home, str(mv.name), int(mv.version)).is_dir()


# --------------------------------------------------------------------------- register


def register(
    run: str | Path, *, name: str | None = None, settings: Settings | None = None
) -> ModelVersionInfo:
    """Register the finished run `run` (a run directory, a run name under <home>/runs, or an
    MLflow run) as a new version of `name` (default: the run directory's name)."""
    settings = settings or load_settings()
    if name is not None:
        check_name(name)  # a bad --name is named before the run is looked for
    src = runsource.load_run(run, settings)
    name = check_name(name or src.run_dir.name)
    root = model_dir(settings.home, name)
    sha = files.sha256_file(src.weights)
    with files.model_lock(root):
        files.remove_stale_staging(root)
        staging = files.make_staging(root)
        try:
            return _register_locked(settings, src, name, sha, staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # gone already when published


def _register_locked(
    settings: Settings, src: runsource.RunSource, name: str, sha: str, staging: Path
) -> ModelVersionInfo:
    files.copy_durable(src.weights, staging / WEIGHTS_FILE)
    if files.sha256_file(staging / WEIGHTS_FILE) != sha:
        raise RegistryError(
            f"{src.weights} changed while it was being copied; is a trainer still writing it? "
            "Register again when the run has finished."
        )
    files.copy_durable(src.run_dir / CARD_FILE, staging / CARD_FILE)
    for spec in runsource.spec_files(src.run_dir):
        files.copy_durable(spec, staging / spec.name)

    c = rstore.client(settings)
    _remove_abandoned(c, name, settings)
    run_id = _existing_run(c, src.mlflow_run_id)
    card = src.card
    tags = {
        rstore.ARCH_TAG: card.arch,
        rstore.WEIGHTS_SHA_TAG: sha,
        rstore.DATASET_VERSION_TAG: card.dataset_version or "",
        rstore.RUN_DIR_TAG: str(src.run_dir),
    }
    for k, v in (card.metrics or {}).items():
        if v is not None:
            tags[rstore.METRIC_TAG_PREFIX + k] = f"{v:.6g}"
    try:
        rstore.ensure_model(c, name)
        # The run's logged model is the lineage MLflow's UI links to; without a tracked run the
        # version points at the folder that holds its files.
        source = f"runs:/{run_id}/model" if run_id else model_dir(settings.home, name).as_uri()
        mv = c.create_model_version(name, source=source, run_id=run_id, tags=tags)
    except Exception as e:
        raise rstore.wrap(f"register a version of {name!r}", settings, e) from e
    version = int(mv.version)
    final = version_dir(settings.home, name, version)
    published = False
    try:
        lineage = {
            "name": name,
            "version": version,
            "registered_at": history.now_iso(),
            "registered_by": history.default_actor(),
            "run_dir": str(src.run_dir),
            "mlflow_run_id": run_id,
            "run_status": src.status,
            "dataset_path": src.dataset_path,
            "dataset_version": card.dataset_version,
            "arch": card.arch,
            "weights_sha256": sha,
            "metrics": card.metrics or {},
        }
        atomic_write_json(staging / LINEAGE_FILE, lineage)
        if final.exists():
            raise RegistryError(
                f"{final} already exists but MLflow just gave out version {version}: this home's "
                "models folder does not belong to this tracking store. Point VISIONLOOP_TRACKING_URI "
                f"at the store it was made with, or move {final.parent} aside."
            )
        files.publish(staging, final)
        published = True
        c.set_model_version_tag(name, str(version), rstore.STATUS_TAG, rstore.READY)
    except BaseException:
        # No half version: the folder and the MLflow version go together or not at all.
        if published:
            shutil.rmtree(final, ignore_errors=True)
        # If this fails too, the version stays without its ready tag, which readers skip.
        with contextlib.suppress(Exception):
            c.delete_model_version(name, str(version))
        raise
    return get_version(ModelRef(name, version=version), settings)


def _remove_abandoned(c: MlflowClient, name: str, settings: Settings) -> None:
    """Delete the MLflow versions of `name` that registrations left unready and without a
    folder: readers skip them, but they clutter MLflow's UI and `search_model_versions`."""
    cutoff_ms = (datetime.now(UTC).timestamp() - ABANDONED_AFTER_S) * 1000
    try:
        rstore.get_model(c, name, settings)
        stale = [
            v
            for v in rstore.versions(c, name)
            if not rstore.is_ready(v)
            and (v.creation_timestamp or 0) <= cutoff_ms
            and not version_dir(settings.home, name, int(v.version)).exists()
        ]
    except NotFoundError:
        return  # a first registration: nothing to clean
    for v in stale:
        # Best effort: a version that cannot be deleted now is skipped by readers anyway.
        with contextlib.suppress(Exception):
            c.delete_model_version(name, str(v.version))


def _existing_run(c: MlflowClient, run_id: str | None) -> str | None:
    """The run id if this store knows the run (a run trained against another store, or with
    tracking off, has none here)."""
    if not run_id:
        return None
    try:
        c.get_run(run_id)
    except Exception:
        return None
    return run_id


# --------------------------------------------------------------------------- read


def get_version(ref: str | ModelRef, settings: Settings | None = None) -> ModelVersionInfo:
    """The version `ref` names: NAME (the champion, else the newest), NAME@ALIAS or NAME/VERSION."""
    settings = settings or load_settings()
    ref = parse_ref(ref) if isinstance(ref, str) else ref
    if ref.version is not None:
        # A ModelRef built in code (set_alias, the CLI's VERSION argument) skips parse_ref's
        # check; 10**30 would otherwise reach SQLite and read as a tracking-store failure.
        check_version(ref.version)
    c = rstore.client(settings)
    try:
        alias_map = read_alias_map(c, ref.name, settings)
        if ref.alias is not None or (ref.version is None and CHAMPION in alias_map):
            alias = ref.alias or CHAMPION
            if alias not in alias_map:
                known = ", ".join(f"{a} -> v{v}" for a, v in sorted(alias_map.items())) or "none"
                raise NotFoundError(
                    f"model {ref.name!r} has no alias {alias!r} (aliases: {known}). Set it with "
                    f"`visionloop models alias {ref.name} VERSION {alias}`."
                )
            number = alias_map[alias]
        elif ref.version is not None:
            number = ref.version
        else:
            ready = [v for v in rstore.versions(c, ref.name) if is_usable(settings, v)]
            if not ready:
                raise NotFoundError(f"model {ref.name!r} has no usable version yet; register a run first.")
            return _info(settings, ready[-1], alias_map)
        mv = _model_version(c, ref.name, number, settings)
    except VisionloopError:
        raise
    except Exception as e:
        raise rstore.wrap(f"look up {ref}", settings, e) from e
    if not is_usable(settings, mv):
        raise NotFoundError(
            f"{ref.name}/{number} is not usable: its registration did not complete, or its folder "
            f"{version_dir(settings.home, ref.name, number)} is missing. Register the run again."
        )
    return _info(settings, mv, alias_map)


def _model_version(c: MlflowClient, name: str, version: int, settings: Settings) -> ModelVersion:
    from mlflow.exceptions import MlflowException

    try:
        return c.get_model_version(name, str(version))
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        have = ", ".join(str(v.version) for v in rstore.versions(c, name) if is_usable(settings, v)) or "none"
        raise NotFoundError(f"model {name!r} has no version {version} (versions: {have}).") from e


def list_versions(name: str, settings: Settings | None = None) -> list[ModelVersionInfo]:
    """Every usable version of `name`, oldest first."""
    settings = settings or load_settings()
    check_name(name)
    c = rstore.client(settings)
    try:
        alias_map = read_alias_map(c, name, settings)
        return [_info(settings, v, alias_map) for v in rstore.versions(c, name) if is_usable(settings, v)]
    except VisionloopError:
        raise
    except Exception as e:
        raise rstore.wrap(f"list versions of {name!r}", settings, e) from e


def list_models(settings: Settings | None = None) -> list[ModelSummary]:
    settings = settings or load_settings()
    from visionloop.track import store as track_store

    if not track_store.store_exists(settings):
        return []
    c = rstore.client(settings)
    try:
        models: list[Any] = []
        token: str | None = None
        while True:
            page = c.search_registered_models(max_results=1000, page_token=token)
            models.extend(page)
            token = page.token
            if not token:
                break
        out = []
        for m in sorted(models, key=lambda m: str(m.name)):
            ready = [v for v in rstore.versions(c, str(m.name)) if is_usable(settings, v)]
            out.append(
                ModelSummary(
                    name=str(m.name),
                    versions=len(ready),
                    latest=int(ready[-1].version) if ready else None,
                    aliases={str(a): int(v) for a, v in (m.aliases or {}).items()},
                    updated_at=_iso(m.last_updated_timestamp),
                )
            )
        return out
    except Exception as e:
        raise rstore.wrap("list models", settings, e) from e


def aliases(name: str, settings: Settings | None = None) -> dict[str, int]:
    """alias → version for `name`: one small query, cheap enough to poll every second."""
    settings = settings or load_settings()
    c = rstore.client(settings)
    try:
        return read_alias_map(c, check_name(name), settings)
    except VisionloopError:
        raise
    except Exception as e:
        raise rstore.wrap(f"read aliases of {name!r}", settings, e) from e


def alias_history(name: str, settings: Settings | None = None) -> list[history.AliasEvent]:
    settings = settings or load_settings()
    return history.read_history(model_dir(settings.home, name) / ALIAS_HISTORY_FILE)


def record_export(info: ModelVersionInfo, key: str, fields: dict[str, str], settings: Settings) -> None:
    """Tag the MLflow model version with an export's outcome (`visionloop.export.<key>.<field>`)."""
    c = rstore.client(settings)
    try:
        for f, value in fields.items():
            tag = f"{rstore.EXPORT_TAG_PREFIX}{key}.{f}"
            c.set_model_version_tag(info.name, str(info.version), tag, value)
    except Exception as e:
        raise rstore.wrap(f"tag {info.ref} with its export", settings, e) from e
