"""One error hierarchy. The CLI prints `str(error)` without a traceback and exits non-zero,
so every message must say what went wrong *and* what to do next."""

from __future__ import annotations


class VisionloopError(Exception):
    """Base of every error visionloop raises on purpose."""

    exit_code: int = 1


class ConfigError(VisionloopError):
    """Settings (environment, visionloop.toml) are invalid."""


class ControlPlaneUnreachableError(ConfigError):
    """The control plane did not answer (not running, restarting, the connection broke): a
    caller that loops, such as the tuner, waits and tries again."""


class QueueFullError(VisionloopError):
    """A submission refused because the team's queue is at its limit: nothing was queued, and
    the same submission can succeed once some of the team's jobs have started. A caller that
    loops, such as the tuner, waits and tries again."""

    exit_code = 2


class SpecError(VisionloopError):
    """A user-facing spec document failed validation."""

    exit_code = 2


class DataError(VisionloopError):
    """A dataset source or a built dataset cannot be used."""


class CheckpointError(VisionloopError):
    """No usable checkpoint, or a checkpoint failed verification."""


class TrainingError(VisionloopError):
    """Training cannot start or continue."""


class TrackingError(VisionloopError):
    """The tracking store (MLflow) cannot be reached or holds unexpected data."""


class NotFoundError(VisionloopError):
    """A named run, dataset or model does not exist."""


class ExecutorError(VisionloopError):
    """An executor could not start, signal or find a job's process."""


class ExecutorUnavailableError(ExecutorError):
    """The executor's backend (the Ray cluster's dashboard) cannot be reached at all: nothing
    is wrong with the job, so a launch that fails this way is not held against it."""


class StoreError(VisionloopError):
    """The job store refused or failed a change (a GPU already held, a reused idempotency
    key, a database that cannot be reached)."""
