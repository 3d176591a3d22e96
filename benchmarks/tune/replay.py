"""Search efficiency over many draws: successive halving replayed on recorded learning curves.

`search_efficiency.py` trains every arm for real, so it affords 3 seeds, and its headline
swings with where random search happens to draw its first good configuration (trial 2 of 27
in one seed, trial 10 in another). This script measures the same ratio over hundreds of
draws without training again, the way tabular HPO benchmarks do (HPOBench, LCBench,
NAS-Bench-201): random search's arm trained every configuration to its last epoch and
recorded its validation accuracy at every epoch, and because training is deterministic and a
trial paused and continued ends bitwise where an uninterrupted one does (tested:
tests/integration/test_train_pause.py), a successive-halving trial sees at each rung exactly
the accuracy that curve holds at that epoch. So:

- pool: every recorded (configuration, training seed) curve of one or more real runs
  (`--from`: result names; the curves come from the results, or from the jobs' evaluation
  files kept from a run that predates their recording, `--evals`);
- a draw: `--trials` curves from the pool without replacement, in random order; trial k
  is curve k in every arm;
- random search: the compute, in trial order, until a finished trial is within 0.5 points of
  the best final accuracy among the draw's trials;
- ASHA with promotion and stop-only SHA: the real `Tuner` and Optuna study (SQLite) over a
  queue that answers each trial job from its curve instead of training (exit 76 at a rung
  with the rung's evaluations, exit 0 with the final one), the same compute measure.

What is exact: the epochs (the decisions and every metric are the recorded ones; the script
first replays each real seed in its real order and checks that the tuner makes the same calls
the real run made). What is modelled: the CPU-seconds of a call, `overhead + epochs x rate`,
with each curve's rate from its real full-length run and the per-call overhead (start-up,
checkpoint load and save) fitted to the real successive-halving calls.

    python benchmarks/tune/replay.py --from tune_search_efficiency_val80_27ep \
        [--evals DIR] [--draws 200] [--trials 27]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from search_efficiency import (
    METRIC,
    TOLERANCE_POINTS,
    Call,
    InProcessQueue,
    _Job,
    build_dataset,
    to_target,
    tune_doc,
)

from _common import RESULTS, write_result

SHA_ARMS = ("asha", "asha_stop")


@dataclass(frozen=True)
class Curve:
    """One configuration trained to its end by random search: its accuracy after each epoch."""

    source: str  # "<result>/s<seed>/t<trial>"
    accuracy: tuple[float, ...]
    cpu_s: float  # the whole run's CPU-seconds

    @property
    def final(self) -> float:
        return self.accuracy[-1]


# --------------------------------------------------------------------------- the pool


def _curves_of(name: str, doc: dict[str, Any], evals_dir: Path | None) -> dict[str, list[Curve]]:
    """The random arm's curves of one results file, per seed (in trial order)."""
    epochs = int(doc["config"]["epochs"])
    out: dict[str, list[Curve]] = {}
    for seed, runs in doc["runs"].items():
        curves: list[Curve] = []
        for call in sorted(runs["random"]["calls"], key=lambda c: c["trial"]):
            acc = call.get("curve")
            if acc is None:  # a run from before the curves were recorded: its kept evaluations
                if evals_dir is None:
                    raise SystemExit(f"{name} has no curves; pass --evals with the run's kept jobs folders")
                path = evals_dir / f"random-s{seed}" / "jobs" / f"job-{call['job']}" / "evals.jsonl"
                rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
                acc = [r["metrics"][METRIC] for r in sorted(rows, key=lambda r: r["epoch"])]
            if len(acc) != epochs or abs(acc[-1] - call["final"]) > 1e-12:
                raise SystemExit(f"{name} seed {seed} trial {call['trial']}: curve does not end at its final")
            curves.append(Curve(f"{name}/s{seed}/t{call['trial']}", tuple(acc), float(call["cpu_s"])))
        out[seed] = curves
    return out


def overhead_estimates(name: str, doc: dict[str, Any], evals_dir: Path | None) -> list[float]:
    """Per-call CPU-seconds beyond the epochs' own, from a run's real successive-halving
    calls: a call of k of E epochs on curve c costs a + k (C - a) / E, C being c's full run."""
    epochs = int(doc["config"]["epochs"])
    pool = {c.source: c for curves in _curves_of(name, doc, evals_dir).values() for c in curves}
    estimates: list[float] = []
    for seed, runs in doc["runs"].items():
        for arm in SHA_ARMS:
            for call in runs.get(arm, {}).get("calls", []):
                k = call["to_epoch"] - call["from_epoch"]
                full = pool[f"{name}/s{seed}/t{call['trial']}"].cpu_s
                if 0 < k < epochs:
                    estimates.append((call["cpu_s"] - k * full / epochs) / (1 - k / epochs))
    return estimates


# --------------------------------------------------------------------------- the queue


class TabularQueue(InProcessQueue):
    """The in-process queue of search_efficiency.py, answering trial k from curve k."""

    def __init__(self, jobs_dir: Path, runs_dir: Path, curves: list[Curve], overhead: float) -> None:
        super().__init__(jobs_dir=jobs_dir, runs_dir=runs_dir)
        self.curves, self.overhead = curves, overhead

    def _run(self, job: _Job) -> None:
        from visionloop.sched.progress import EvalEvent
        from visionloop.sched.service_reconcile import EVALS_FILE, append_evals

        curve = self.curves[job.trial]
        last = len(curve.accuracy)
        end = min(job.until_epoch or last, last)
        job.attempts += 1
        evals = [
            EvalEvent(step=e * 100, epoch=float(e), metrics={METRIC: curve.accuracy[e - 1]})
            for e in range(job.epoch + 1, end + 1)
        ]
        if evals:
            append_evals(self.jobs_dir / f"job-{job.id}" / EVALS_FILE, job.attempts, evals)
        k = end - job.epoch
        cpu = self.overhead + k * (curve.cpu_s - self.overhead) / last
        finished = end == last
        job.state = "succeeded" if finished else "paused"
        final = curve.final if finished else None
        self.calls.append(
            Call(job.id, job.trial, job.epoch, end, job.until_epoch, 0 if finished else 76, cpu, 0.0, final)
        )
        job.epoch = end


def replay_arm(
    arm: str,
    curves: list[Curve],
    overhead: float,
    dataset: Path,
    root: Path,
    args: argparse.Namespace,
    tag: str,
) -> list[dict[str, Any]]:
    from visionloop.tune.spec import validate_tune_spec
    from visionloop.tune.study import create_or_load
    from visionloop.tune.tuner import Tuner

    where = root / f"{arm}-{tag}"
    where.mkdir(parents=True)
    spec = validate_tune_spec(tune_doc(arm, dataset, args, 0), f"the {arm} tune spec", where)
    study = create_or_load(spec, f"sqlite:///{where / 'control.db'}")
    queue = TabularQueue(where / "jobs", where / "runs", curves, overhead)
    tuner = Tuner(spec, study, queue)
    while not tuner.step().done:
        if queue.run_queued() == 0 and tuner.step().running == 0:
            raise RuntimeError(f"{arm}: the study is not done but nothing is queued")
    return [asdict(c) for c in queue.calls]


def random_calls(curves: list[Curve]) -> list[dict[str, Any]]:
    last = len(curves[0].accuracy)
    return [
        {"trial": k, "from_epoch": 0, "to_epoch": last, "cpu_s": c.cpu_s, "final": c.final}
        for k, c in enumerate(curves)
    ]


# --------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="sources", required=True, help="result names, comma-separated")
    p.add_argument("--evals", type=Path, default=None, help="kept jobs folders, for results without curves")
    p.add_argument(
        "--overhead-from",
        default=None,
        help="results whose real successive-halving calls fix the per-call overhead (default: --from)",
    )
    p.add_argument("--draws", type=int, default=200)
    p.add_argument("--trials", type=int, default=None, help="trials a draw (default: the runs')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-epochs", type=int, default=None, help="the first rung (default: the runs')")
    p.add_argument("--eta", type=int, default=None, help="the reduction factor (default: the runs')")
    p.add_argument("--name", default=None)
    args = p.parse_args()

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    docs = {n: json.loads((RESULTS / f"{n}.json").read_text()) for n in args.sources.split(",")}
    first = next(iter(docs.values()))["config"]
    for n, d in docs.items():
        c = d["config"]
        if (c["epochs"], c["min_epochs"], c["reduction_factor"]) != (
            first["epochs"],
            first["min_epochs"],
            first["reduction_factor"],
        ):
            raise SystemExit(f"{n} ran other epochs or rungs than {args.sources.split(',')[0]}")
    # The check replays the real runs at their own rungs; the draws use --min-epochs/--eta if given.
    as_run = argparse.Namespace(**vars(args))
    as_run.epochs, as_run.min_epochs, as_run.eta = (
        first["epochs"],
        first["min_epochs"],
        first["reduction_factor"],
    )
    as_run.trials = first["trials"]
    args.epochs = first["epochs"]
    args.min_epochs = args.min_epochs or first["min_epochs"]
    args.eta = args.eta or first["reduction_factor"]
    args.trials = args.trials or first["trials"]
    per_seed = {n: _curves_of(n, d, args.evals) for n, d in docs.items()}
    pool = {c.source: c for seeds in per_seed.values() for curves in seeds.values() for c in curves}
    fitted: list[float] = []
    for n in (args.overhead_from or args.sources).split(","):
        doc = docs.get(n) or json.loads((RESULTS / f"{n}.json").read_text())
        fitted += overhead_estimates(n, doc, args.evals)
    if not fitted:
        raise SystemExit("no successive-halving calls to fit the per-call overhead to: give --overhead-from")
    overhead = max(0.0, statistics.median(fitted))
    print(
        f"pool: {len(pool)} curves of {args.epochs} epochs; per-call overhead {overhead:.2f} CPU-s "
        f"(median of {len(fitted)} real calls)"
    )

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vl-tune-replay-") as tmp:
        root = Path(tmp)
        dataset = build_dataset(root, 0.8)  # the spec must validate; no trial reads it

        # The replay must make the real runs' decisions: each seed, in its own order.
        checked = 0
        for n, seeds in per_seed.items():
            for seed, curves in seeds.items():
                for arm in SHA_ARMS:
                    real = docs[n]["runs"][seed].get(arm)
                    if real is None:
                        continue
                    got = replay_arm(arm, curves, overhead, dataset, root, as_run, f"check-{n}-{seed}")
                    key = [(c["trial"], c["from_epoch"], c["to_epoch"]) for c in got]
                    want = [(c["trial"], c["from_epoch"], c["to_epoch"]) for c in real["calls"]]
                    if key != want:
                        raise SystemExit(
                            f"the replay of {n} seed {seed} {arm} made other calls than the real run"
                        )
                    checked += 1
        if checked:
            print(f"the replay makes the real runs' calls, trial by trial, in {checked} of {checked} arms")
        else:
            print(
                "these results hold random search alone: no real successive-halving run to check the "
                "replay against here (check it on a run of all three arms, e.g. "
                "tune_search_efficiency_val80_27ep)"
            )

        rng = random.Random(args.seed)
        names = sorted(pool)
        draws: list[dict[str, Any]] = []
        for d in range(args.draws):
            curves = [pool[s] for s in rng.sample(names, args.trials)]
            best = max(c.final for c in curves)
            target = best - TOLERANCE_POINTS / 100
            row: dict[str, Any] = {"draw": d, "best": best, "good": sum(c.final >= target for c in curves)}
            base = to_target(random_calls(curves), target)
            row["random"] = {
                **base["reached"],
                "total_cpu_s": base["total_cpu_s"],
                "total_epochs": base["total_epochs"],
            }
            for arm in SHA_ARMS:
                got = to_target(replay_arm(arm, curves, overhead, dataset, root, args, f"d{d}"), target)
                r = got["reached"]
                row[arm] = {
                    **(r or {}),
                    "total_cpu_s": got["total_cpu_s"],
                    "total_epochs": got["total_epochs"],
                }
                row[f"{arm}_over_random_cpu"] = r["cpu_s"] / base["reached"]["cpu_s"] if r else None
                row[f"{arm}_over_random_epochs"] = r["epochs"] / base["reached"]["epochs"] if r else None
            draws.append(row)
            if (d + 1) % 20 == 0:
                print(f"{d + 1} draws, {time.perf_counter() - started:.0f} s", flush=True)

    summary: dict[str, Any] = {}
    for arm in SHA_ARMS:
        for unit in ("cpu", "epochs"):
            key = f"{arm}_over_random_{unit}"
            vals = [r[key] for r in draws if r[key] is not None]
            field = "cpu_s" if unit == "cpu" else "epochs"
            reached = [r for r in draws if r[key] is not None]
            summary[key] = {
                "mean": statistics.fmean(vals),
                "median": statistics.median(vals),
                "ci95_of_mean": _bootstrap(vals, rng),
                "ratio_of_means": statistics.fmean(r[arm][field] for r in reached)
                / statistics.fmean(r["random"][field] for r in reached),
                "at_most_one_third": sum(v <= 1 / 3 for v in vals) / len(vals),
                "reached": f"{len(vals)}/{len(draws)}",
            }
        whole = [r[arm]["total_cpu_s"] / r["random"]["total_cpu_s"] for r in draws]
        summary[f"{arm}_over_random_whole_study_cpu"] = {"mean": statistics.fmean(whole)}
    summary["good_trials_a_draw"] = statistics.fmean(r["good"] for r in draws)
    for key, v in summary.items():
        print(key, json.dumps(v))
    path = write_result(
        args.name or f"tune_replay_{'+'.join(docs)}",
        {
            "config": {
                "sources": list(docs),
                "pool": len(pool),
                "draws": args.draws,
                "trials": args.trials,
                "epochs": args.epochs,
                "min_epochs": args.min_epochs,
                "reduction_factor": args.eta,
                "overhead_cpu_s": overhead,
                "overhead_from": (args.overhead_from or args.sources).split(","),
                "seed": args.seed,
            },
            "summary": summary,
            "draws": draws,
            "curves": {s: {"accuracy": c.accuracy, "cpu_s": c.cpu_s} for s, c in pool.items()},
        },
    )
    print(f"wrote {path} in {time.perf_counter() - started:.0f} s")


def _bootstrap(vals: list[float], rng: random.Random, n: int = 2000) -> list[float]:
    means = sorted(statistics.fmean(rng.choices(vals, k=len(vals))) for _ in range(n))
    return [means[int(0.025 * n)], means[int(0.975 * n)]]


if __name__ == "__main__":
    main()
