"""The environment a job starts with: a clean one, never the control plane's.

The control plane holds secrets in its environment (VISIONLOOP_DB_URL with the job store's
password, cloud credentials for the object store); a job is code a team submitted, so it
must not see them. A job gets:

- from the control plane's environment, only `BASE_NAMES` and the `LC_*` locale variables:
  what a process needs to find programs, a home, a locale, a time zone and a temporary folder;
- the request's env: what the control plane decided the job needs (VISIONLOOP_HOME,
  VISIONLOOP_TRACKING_URI, VISIONLOOP_EXPERIMENT) and the names an admin allow-listed in
  cluster.toml (`[jobs] env_allow`);
- the executor's own variables (device pinning, the attempt's ids).

PYTHONPATH is not passed by default (it decides what code the job imports): allow-list it
if visionloop runs from a source folder rather than an installed package.
"""

from __future__ import annotations

from collections.abc import Mapping

BASE_NAMES = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TMPDIR",
    "VIRTUAL_ENV",
    "VISIONLOOP_TRACEBACK",
)
BASE_PREFIXES = ("LC_",)


def base_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of `environ` (the control plane's) that every job inherits."""
    return {k: v for k, v in environ.items() if k in BASE_NAMES or k.startswith(BASE_PREFIXES)}


def job_env(environ: Mapping[str, str], request_env: Mapping[str, str]) -> dict[str, str]:
    """A job's environment before the executor adds its own variables: the clean base of
    `environ`, PYTHONUNBUFFERED=1 (so logs are live) unless the request sets it, then the
    request's env."""
    return {**base_env(environ), "PYTHONUNBUFFERED": "1", **request_env}
