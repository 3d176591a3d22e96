"""The Slurm cluster the Slurm executor's tests run against: `.ci/slurm.sh` starts a two-node
cluster on this machine (munged, slurmctld, a slurmd for each of the nodes vl0 and vl1, two
fake GPUs each, vl1 spot, partition `vltest`) and prints its slurm.conf;
VISIONLOOP_TEST_SLURM_CONF names one of your own. Without either, and where the script cannot
start one (not root, no apt-get), the tests FAIL under CI (CI=true) and are skipped
elsewhere, saying how to provide one."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARTITION = "vltest"


@functools.cache
def _start() -> tuple[str | None, str]:
    """(slurm.conf path, or None and why)."""
    conf = os.environ.get("VISIONLOOP_TEST_SLURM_CONF", "").strip()
    if conf:
        return conf, ""
    try:
        done = subprocess.run(
            ["bash", str(REPO / ".ci" / "slurm.sh")], capture_output=True, text=True, timeout=600
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f".ci/slurm.sh did not run: {e}"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return None, f".ci/slurm.sh failed (exit {done.returncode}): {done.stderr.strip()[-800:]}"
    return lines[-1], ""


def slurm_conf() -> str:
    """The test cluster's slurm.conf, or fail (CI) / skip (elsewhere) with how to get one."""
    conf, why = _start()
    if conf is not None:
        return conf
    how = (
        "run `bash .ci/slurm.sh` as root (it installs Slurm with apt-get and starts a two-node "
        "cluster), or export VISIONLOOP_TEST_SLURM_CONF=/path/to/slurm.conf with a partition 'vltest'"
    )
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        pytest.fail(f"no Slurm cluster for the Slurm executor's tests: {why}; {how}", pytrace=False)
    pytest.skip(f"no Slurm cluster: {why}; {how}")
