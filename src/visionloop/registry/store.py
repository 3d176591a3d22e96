"""The MLflow Model Registry side: names, versions, aliases and tags.

Tag names are visionloop's contract with the MLflow UI and with other tools reading the
registry; a version is usable only once it carries `visionloop.status = ready`, which is set
after its folder is in place (a registration that died in between leaves a version without it,
which every reader skips).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from visionloop.core.errors import NotFoundError
from visionloop.core.settings import Settings
from visionloop.track import store as track_store

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities.model_registry import ModelVersion, RegisteredModel

STATUS_TAG = "visionloop.status"
READY = "ready"
ARCH_TAG = "visionloop.arch"
WEIGHTS_SHA_TAG = "visionloop.weights_sha256"
DATASET_VERSION_TAG = "visionloop.dataset_version"
RUN_DIR_TAG = "visionloop.run_dir"
METRIC_TAG_PREFIX = "visionloop.metric."
EXPORT_TAG_PREFIX = "visionloop.export."  # + "<format>-<precision>.<field>"


def client(settings: Settings) -> MlflowClient:
    return track_store.client(settings)


def wrap(action: str, settings: Settings, e: Exception) -> Exception:
    from visionloop.core.errors import VisionloopError

    return e if isinstance(e, VisionloopError) else track_store.store_error(action, settings, e)


def _is_missing(e: Exception) -> bool:
    from mlflow.exceptions import MlflowException

    return isinstance(e, MlflowException) and e.error_code == "RESOURCE_DOES_NOT_EXIST"


def get_model(c: MlflowClient, name: str, settings: Settings) -> RegisteredModel:
    try:
        return c.get_registered_model(name)
    except Exception as e:
        if _is_missing(e):
            known = ", ".join(sorted(m.name for m in c.search_registered_models(max_results=50))) or "none"
            raise NotFoundError(
                f"no registered model {name!r} (models: {known}). Register one with "
                f"`visionloop models register RUN --name {name}`."
            ) from e
        raise wrap(f"read model {name!r}", settings, e) from e


def ensure_model(c: MlflowClient, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        c.get_registered_model(name)
    except MlflowException as e:
        if not _is_missing(e):
            raise
        try:
            c.create_registered_model(name, description="Registered by visionloop.")
        except MlflowException as e2:
            # Another registration (through another home) created it first: fine.
            if e2.error_code != "RESOURCE_ALREADY_EXISTS":
                raise


def versions(c: MlflowClient, name: str) -> list[ModelVersion]:
    out: list[ModelVersion] = []
    token: str | None = None
    while True:
        page = c.search_model_versions(
            filter_string=f"name = {track_store.quote_filter_value(name)}", max_results=1000, page_token=token
        )
        out.extend(page)
        token = page.token
        if not token:
            return sorted(out, key=lambda v: int(v.version))


def is_ready(mv: ModelVersion) -> bool:
    tags: dict[str, Any] = mv.tags or {}
    return tags.get(STATUS_TAG) == READY
