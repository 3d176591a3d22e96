"""Model registry glue: versions, aliases (`champion`, `challenger`), lineage, and the files of
each version (see `layout`)."""

from visionloop.registry.aliases import rollback, set_alias, unset_alias
from visionloop.registry.api import (
    CHAMPION,
    ModelSummary,
    ModelVersionInfo,
    RegistryError,
    alias_history,
    aliases,
    get_version,
    list_models,
    list_versions,
    record_export,
    register,
)
from visionloop.registry.layout import ModelRef, ModelRefError, parse_ref
from visionloop.registry.runsource import UnfinishedRunError

__all__ = [
    "CHAMPION",
    "ModelRef",
    "ModelRefError",
    "ModelSummary",
    "ModelVersionInfo",
    "RegistryError",
    "UnfinishedRunError",
    "alias_history",
    "aliases",
    "get_version",
    "list_models",
    "list_versions",
    "parse_ref",
    "record_export",
    "register",
    "rollback",
    "set_alias",
    "unset_alias",
]
