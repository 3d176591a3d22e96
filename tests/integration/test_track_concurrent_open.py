"""Several trainers opening a fresh local tracking store at the same moment (the queue
launches jobs together) must all get it: MLflow migrates the schema on first connect and,
without visionloop's lock, the losers fail with "duplicate column name"."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

N = 4
WAIT_S = 120.0  # bound for a loaded 2-core machine; nothing waits this long when all is well

# Each process imports everything, then waits at a barrier (one file per process) so that
# all of them connect together however slow the machine is, and prints the monotonic times
# (one clock for all processes) at which it entered and left the first connect.
OPEN = """
import os, sys, time
from pathlib import Path
from visionloop.core.settings import load_settings
from visionloop.track.store import client
folder, me, n = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
(folder / f"ready-{me}").touch()
deadline = time.monotonic() + 120
while len(list(folder.glob("ready-*"))) < n and time.monotonic() < deadline:
    time.sleep(0.01)
entered = time.monotonic()
(folder / f"entered-{me}").touch()
c = client(load_settings())
left = time.monotonic()
print(len(c.search_experiments()), entered, left)
"""


def test_concurrent_first_connects_to_a_fresh_store_all_succeed(vl_home: Path, tmp_path: Path) -> None:
    from visionloop.core.settings import load_settings
    from visionloop.track.store import sqlite_path

    db = sqlite_path(load_settings().tracking_uri)
    assert db is not None and not db.exists()
    # Hold the store's first-connect lock until every process is inside `client()`: then all
    # of them are in the connect at one moment (proved below from their own clocks), on any
    # machine. Without the lock in visionloop, this holds nothing back and they race.
    lock = open(db.with_name(db.name + ".init-lock"), "a")  # noqa: SIM115
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", OPEN, str(tmp_path), str(i), str(N)],
                env={**os.environ, "VISIONLOOP_HOME": str(vl_home)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(N)
        ]
        deadline = time.monotonic() + WAIT_S
        while len(list(tmp_path.glob("entered-*"))) < N:
            failed = [p.returncode for p in procs if p.poll() not in (None, 0)]
            assert not failed and time.monotonic() < deadline, f"not all entered the connect ({failed})"
            time.sleep(0.02)
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()
    results = [p.communicate(timeout=WAIT_S) for p in procs]
    spans = []
    for p, (out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
        experiments, entered, left = out.split()
        assert experiments == "1"  # the Default experiment, created once
        spans.append((float(entered), float(left)))
    # They overlapped: every process entered before any left (one instant inside all four).
    assert max(e for e, _ in spans) < min(left for _, left in spans), spans
    assert db.is_file()
