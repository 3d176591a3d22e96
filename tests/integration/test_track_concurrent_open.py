"""Several trainers opening a fresh local tracking store at the same moment (the queue
launches jobs together) must all get it: MLflow migrates the schema on first connect and,
without visionloop's lock, the losers fail with "duplicate column name"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

OPEN = """
import sys, time
from visionloop.core.settings import load_settings
from visionloop.track.store import client
start = float(sys.argv[1])
time.sleep(max(0.0, start - time.time()))  # all processes connect at the same instant
c = client(load_settings())
print(len(c.search_experiments()))
"""


def test_concurrent_first_connects_to_a_fresh_store_all_succeed(vl_home: Path) -> None:
    import time

    start = time.time() + 6.0  # after every interpreter has imported mlflow
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPEN, str(start)],
            env={**os.environ, "VISIONLOOP_HOME": str(vl_home)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(4)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
        assert out.strip() == "1"  # the Default experiment, created once
    assert (vl_home / "mlflow.db").is_file()
