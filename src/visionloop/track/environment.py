"""Tags that say where a run ran: code version, library versions, machine, GPUs.

"Which run made this model, from which commit, on what hardware" must be answerable months
later, so every run records it at start (and again on each resume: after a spot interruption
the run may continue on another machine).
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from visionloop.track.nvml import Nvml

log = logging.getLogger(__name__)

ENV_PREFIX = "visionloop.env."
GIT_PREFIX = "visionloop.git."
PACKAGES = ("visionloop", "torch", "torchvision", "litdata", "mlflow", "numpy", "pillow")


def _git(cwd: Path, *args: str) -> str | None:
    # GIT_OPTIONAL_LOCKS=0: `git status` would otherwise refresh the index under index.lock,
    # racing with whoever is committing in that repository at the same moment.
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0"}
    try:
        done = subprocess.run(
            ["git", "-C", str(cwd), *args], capture_output=True, text=True, timeout=10, env=env, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:  # no git installed, hung filesystem
        log.debug("git %s failed: %s", " ".join(args), e)
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_tags(cwd: Path) -> dict[str, str]:
    """Commit, branch and dirty flag of the repository containing `cwd`; {} outside a repository
    (or before its first commit). Also sets MLflow's own git tags, which its UI displays.

    "Dirty" means tracked files differ from the commit; untracked files (data, outputs) do not
    count, or nearly every working copy would be dirty.
    """
    commit = _git(cwd, "rev-parse", "HEAD")
    if not commit:
        return {}
    tags = {f"{GIT_PREFIX}commit": commit, "mlflow.source.git.commit": commit}
    branch = _git(cwd, "rev-parse", "--abbrev-ref", "HEAD")
    if branch and branch != "HEAD":  # "HEAD" means detached: no branch to name
        tags[f"{GIT_PREFIX}branch"] = branch
        tags["mlflow.source.git.branch"] = branch
    status = _git(cwd, "status", "--porcelain", "--untracked-files=no")
    if status is not None:
        tags[f"{GIT_PREFIX}dirty"] = "true" if status else "false"
    return tags


def package_versions() -> dict[str, str]:
    """Installed versions from package metadata (nothing is imported)."""
    tags = {f"{ENV_PREFIX}python": platform.python_version()}
    for name in PACKAGES:
        try:
            tags[f"{ENV_PREFIX}{name}"] = version(name)
        except PackageNotFoundError:
            continue
    return tags


def accelerator_tags() -> dict[str, str]:
    """CUDA and cuDNN versions torch was built with, and the visible GPUs with their driver.

    GPU names come from NVML, not torch.cuda, so that tagging a run never creates a CUDA
    context (which a later fork of DataLoader workers would not survive).
    """
    tags: dict[str, str] = {}
    try:
        import torch

        if torch.version.cuda:
            tags[f"{ENV_PREFIX}cuda"] = str(torch.version.cuda)
        cudnn: Any = torch.backends.cudnn  # unannotated in torch
        if cudnn.is_available():
            tags[f"{ENV_PREFIX}cudnn"] = str(cudnn.version())
    except Exception as e:  # torch missing or broken: the other tags are still worth having
        log.debug("torch build info unavailable: %s", e)
    with Nvml() as nv:
        if nv.gpus:
            tags[f"{ENV_PREFIX}gpu_count"] = str(len(nv.gpus))
            tags[f"{ENV_PREFIX}gpus"] = ", ".join(g.name for g in nv.gpus)
        driver = nv.driver_version()
        if driver:
            tags[f"{ENV_PREFIX}nvidia_driver"] = driver
    return tags


def environment_tags(cwd: Path | None = None) -> dict[str, str]:
    """Every environment tag: git state of `cwd` (default: the working directory), package
    versions, platform, hostname, CUDA/cuDNN and GPUs when present."""
    tags = git_tags(cwd or Path.cwd())
    tags.update(package_versions())
    tags[f"{ENV_PREFIX}platform"] = platform.platform()
    tags[f"{ENV_PREFIX}hostname"] = socket.gethostname()
    tags.update(accelerator_tags())
    return tags
