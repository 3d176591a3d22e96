"""The control plane's real scheduling cycle with 10,000 queued jobs, against the 50 ms target.

`cycle_time.py` times the pure policy. This times `ControlPlane.cycle()` as `visionloop up`
runs it: a real store (SQLite in a temporary VISIONLOOP_HOME, or PostgreSQL with `--db URL`
naming a fresh database), the local executor with a configured inventory of 64 fake GPUs
(8 nodes x 8), three teams, 10,000 queued 1-GPU jobs and 64 attempts really running (a
sleeping process under the executor's shim instead of the trainer). The first cycle places
the 64 jobs (a one-off launch); then `--cycles` steady-state cycles are timed, with a
per-phase breakdown (reconcile, view = store reads, policy, apply + waiting reasons), and
the policy alone is timed on the same view in the same run for comparison.

    python benchmarks/sched/control_plane_cycle.py [--queued 10000] [--cycles 30] [--db URL]

Every launched process is killed at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import pct, write_result

NODES, PER_NODE = 8, 8
TEAMS = [
    {"name": "detection", "nominal_gpus": 32, "borrow_limit": 16},
    {"name": "segmentation", "nominal_gpus": 20, "borrow_limit": 16},
    {"name": "research", "nominal_gpus": 12, "borrow_limit": 16},
]
# What the store is asked, per cycle, is counted separately from where it is asked.
STORE_CALLS = (
    "active_attempts",
    "get_job",
    "heartbeat",
    "heartbeats",
    "checkpoints",
    "list_jobs",
    "view_jobs",
    "list_gpus",
    "list_teams",
    "set_waiting_reasons",
)


class Clock:
    """Accumulates milliseconds per name while wrapped callables run."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def reset(self) -> None:
        self.ms.clear()
        self.calls.clear()

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.ms[name] = self.ms.get(name, 0.0) + (time.perf_counter() - t0) * 1000
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--queued", type=int, default=10_000)
    ap.add_argument("--cycles", type=int, default=30)
    ap.add_argument("--db", default=None, help="a store URL (a fresh PostgreSQL database); default SQLite")
    ap.add_argument("--name", default=None, help="results file name (default by backend)")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="vl-cpcycle-"))
    os.environ["VISIONLOOP_HOME"] = str(home)
    os.environ.setdefault("VISIONLOOP_TRACKING_URI", f"file://{home / 'mlruns'}")

    from visionloop.api.server import build_plane
    from visionloop.core.settings import load_settings
    from visionloop.sched import service
    from visionloop.sched.config import parse_cluster_config
    from visionloop.specs import JobSpec

    config = parse_cluster_config(
        {
            # Long timings: nothing times out or gets preempted while being measured.
            "scheduler": {"cycle_s": 2.0, "min_runtime_s": 3600, "heartbeat_timeout_s": 600, "grace_s": 600},
            "teams": TEAMS,
            # The jobs' spec names a dataset that is never read (they run a sleeper); it must
            # still lie under an allowed root, or every launch fails its path check.
            "jobs": {"allowed_roots": ["/data"]},
            "inventory": [
                {"node": f"node{n}", "type": "fake", "count": PER_NODE, "price_class": "owned"}
                for n in range(NODES)
            ],
        }
    )
    settings = load_settings()
    plane = build_plane(settings, config, args.db)
    store = plane.store
    sleeper = [sys.executable, "-c", "import time; time.sleep(3600)"]
    plane._command = lambda job: sleeper  # type: ignore[method-assign]
    clock = Clock()
    backend = store.backend
    try:
        doc = {
            "name": "bench",
            "resources": {"gpus": 1},
            "train": {"epochs": 1, "model": {"arch": "resnet18"}, "data": {"dataset": "/data/none"}},
        }
        spec = JobSpec.model_validate(doc)
        t0 = time.perf_counter()
        names = [t["name"] for t in TEAMS]
        for k in range(args.queued):
            store.submit(
                doc,
                spec,
                team=names[k % 3],
                priority_rank=[10, 50, 50, 100][k % 4],
                run_dir=None,
                idempotency_key=None,
                now=time.time(),
            )
        submit_s = time.perf_counter() - t0
        print(f"{backend}: submitted {args.queued} jobs in {submit_s:.1f} s; home {home}")

        t0 = time.perf_counter()
        plane.cycle()
        first_s = time.perf_counter() - t0
        running = len(store.active_attempts())
        print(f"first cycle (launches {running} attempts): {first_s * 1000:.0f} ms")
        # Let every shim report its job (pid, first heartbeat) so that reconcile is steady.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(a.handle and "pid" in a.handle for a in store.active_attempts()):
                break
            time.sleep(0.5)
        plane.cycle()  # records the shims' handles and first heartbeats

        # Instrument: phases (methods of the plane and the policy) and store calls.
        plane._reconcile = clock.wrap("reconcile", plane._reconcile)  # type: ignore[method-assign]
        plane._view = clock.wrap("view", plane._view)  # type: ignore[method-assign]
        original_schedule = service.schedule
        service.schedule = clock.wrap("policy", original_schedule)  # type: ignore[assignment]
        for name in STORE_CALLS:
            if hasattr(store, name):
                setattr(store, name, clock.wrap(f"store.{name}", getattr(store, name)))
        plane.executor.poll = clock.wrap("executor.poll", plane.executor.poll)  # type: ignore[method-assign]
        captured: list[Any] = []
        view_fn = plane._view
        plane._view = lambda now, attempts: captured.append(view_fn(now, attempts)) or captured[-1]  # type: ignore[method-assign]

        totals: list[float] = []
        cpu: list[float] = []  # the cycle thread's CPU time: steadier on a shared machine
        phases: dict[str, list[float]] = {}
        for _ in range(args.cycles):
            clock.reset()
            c0 = time.thread_time()
            t0 = time.perf_counter()
            plane.cycle()
            total = (time.perf_counter() - t0) * 1000
            cpu.append((time.thread_time() - c0) * 1000)
            totals.append(total)
            row = dict(clock.ms)
            row["apply"] = total - row.get("reconcile", 0) - row.get("view", 0) - row.get("policy", 0)
            for k, v in row.items():
                phases.setdefault(k, []).append(v)
            time.sleep(0.05)
        calls_per_cycle = dict(clock.calls)
        service.schedule = original_schedule  # type: ignore[assignment]
        view = captured[-1]
        assert len(view.running) == running, (len(view.running), running)
        policy_only = []
        for _ in range(args.cycles):
            t0 = time.perf_counter()
            original_schedule(view, plane.policy)
            policy_only.append((time.perf_counter() - t0) * 1000)

        med = statistics.median(totals)
        pol = statistics.median(policy_only)
        print(
            f"{args.cycles} steady cycles, {len(view.queued)} queued, {len(view.running)} running (ms): "
            f"median {med:.1f}, p90 {pct(totals, 0.9):.1f}, max {max(totals):.1f}; "
            f"CPU time of the cycle's thread: median {statistics.median(cpu):.1f}, p90 {pct(cpu, 0.9):.1f}"
        )
        order = ["reconcile", "view", "policy", "apply", *sorted(k for k in phases if "." in k)]
        print(f"{'phase':28s} {'median':>8s} {'p90':>8s} {'calls':>6s}")
        for k in order:
            if k in phases:
                xs = phases[k]
                print(
                    f"{k:28s} {statistics.median(xs):8.1f} {pct(xs, 0.9):8.1f} {calls_per_cycle.get(k, 1):6d}"
                )
        print(
            f"policy alone on the same view: median {pol:.1f} ms; full cycle / policy = {med / pol:.2f}x; "
            f"against the 50 ms target: {med / 50:.2f}x (load average {os.getloadavg()[0]:.1f} on "
            f"{len(os.sched_getaffinity(0))} cores)"
        )
        path = write_result(
            args.name or f"sched_control_plane_cycle{'' if backend == 'sqlite' else '_' + backend}",
            {
                "config": vars(args) | {"gpus": NODES * PER_NODE, "teams": TEAMS, "backend": backend},
                "target_ms": 50.0,
                "submit_s": submit_s,
                "first_cycle_ms": first_s * 1000,
                "running": len(view.running),
                "queued": len(view.queued),
                "cycle_ms": totals,
                "cycle_median_ms": med,
                "cycle_p90_ms": pct(totals, 0.9),
                "cycle_cpu_ms": cpu,
                "cycle_cpu_median_ms": statistics.median(cpu),
                "phases_median_ms": {k: statistics.median(v) for k, v in phases.items()},
                "phases_p90_ms": {k: pct(v, 0.9) for k, v in phases.items()},
                "calls_per_cycle": calls_per_cycle,
                "policy_only_ms": policy_only,
                "policy_only_median_ms": pol,
                "cycle_over_policy": med / pol,
                "load_average_1min_at_end": os.getloadavg()[0],
            },
        )
        print(f"results: {path}")
    finally:
        for attempt in store.active_attempts():
            if attempt.handle:
                try:
                    plane.executor.kill(attempt.handle)
                except Exception as e:  # keep killing the others
                    print(f"could not kill job {attempt.job_id}: {e}", file=sys.stderr)
        store.close()


if __name__ == "__main__":
    main()
