"""What the per-team queue limit (`[jobs] max_queued_per_team`) costs a submission: the job
store's `submit` with the limit (the team's row locked, its queued jobs counted) against
without it, on SQLite and PostgreSQL, the queue growing from 0 to `--jobs` waiting jobs of one
team. Rounds alternate the order of the two modes; prints ms per submit and the ratio.

PostgreSQL comes from VISIONLOOP_TEST_PG_URL (or `.ci/postgres.sh`), as in the tests.

    python benchmarks/sched/submit_limit.py [--backends sqlite,postgresql] [--jobs 1500] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from _dbkit import fresh_database
from visionloop.sched.store import Store
from visionloop.specs import JobSpec

DOC = {
    "name": "job",
    "resources": {"gpus": 1},
    "train": {"epochs": 2, "model": {"arch": "resnet18"}, "data": {"dataset": "/data/d"}},
}


def _ms_per_submit(backend: str, jobs: int, limit: int | None) -> float:
    spec = JobSpec.model_validate(DOC)
    tmp = Path(tempfile.mkdtemp(prefix="vl-submit-"))
    with fresh_database(backend, tmp) as url:
        store = Store.open(url, runs_dir=tmp / "runs")
        try:
            store.upsert_team("vision", 4, now=1.0)
            t0 = time.perf_counter()
            for _ in range(jobs):
                store.submit(
                    DOC, spec, team="vision", priority_rank=50, run_dir=None,
                    idempotency_key=None, now=10.0, max_queued=limit,
                )  # fmt: skip
            return (time.perf_counter() - t0) / jobs * 1000
        finally:
            store.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="sqlite,postgresql")
    p.add_argument("--jobs", type=int, default=1500)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    out = {}
    for backend in args.backends.split(","):
        times: dict[str, list[float]] = {"without": [], "with": []}
        for r in range(args.rounds):
            order = ("without", "with") if r % 2 == 0 else ("with", "without")
            for mode in order:
                limit = args.jobs + 1 if mode == "with" else None  # never reached: the check's cost
                times[mode].append(_ms_per_submit(backend, args.jobs, limit))
        ratio = sum(times["with"]) / sum(times["without"])
        out[backend] = {**times, "ratio": ratio}
        shown = {k: [round(x, 3) for x in v] for k, v in times.items()}
        print(f"{backend}: ms per submit {shown}; with the limit / without: {ratio:.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
