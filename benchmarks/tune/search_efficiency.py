"""Search efficiency: asynchronous successive halving with promotion against random search.

Three arms search the same space with the same trial budget, in every repetition:

- `random`: random search, every trial trained to its last epoch (pruner: none);
- `asha`: asynchronous successive halving with promotion (pruner: asha, the default): a
  trial pauses at each rung through a checkpoint and goes on from it when it is among the
  best 1/η of the trials that reached that rung (Li et al. 2020);
- `asha_stop`: stop-only successive halving (`promotion: false`, Optuna's
  SuccessiveHalvingPruner): a trial is judged once, as it reaches a rung, against the
  trials that got there before it, and pruned or continued at once;
- `asha_tpe`: what `visionloop tune` does by default: ASHA with promotion, sampling with TPE
  (tune/rung_tpe.py: it learns from the trials paused at a rung). Its first 10 trials are
  random search's first 10; after that it draws its own.

The first three sample with Optuna's random sampler under the same seed (ASHA is random sampling
plus successive halving, as in Li et al.), so trial k has the same configuration in every
arm; the script checks that it does. Training is deterministic, and a trial paused and
continued ends bitwise where an unpaused one does, so the arms differ only in which trials
get how many epochs.

Task: scikit-learn's digits (16 px PNGs through the real ingest, 20% held out for validation;
`--val-fraction 0.8` makes it a small-data task, 36 training images a class), SGD with
Nesterov momentum and a cosine schedule, searching the learning rate over four decades
(loguniform 1e-5..1e-1), the weight decay (loguniform 1e-6..1e-1) and the architecture
(small_cnn or tiny_resnet); 9 epochs a trial, rungs at 1 and 3 epochs (η = 3).

What is real: the study (Optuna, in a SQLite control-plane database through
`visionloop.tune.study.create_or_load`), the tuner (`visionloop.tune.tuner.Tuner`: settling,
reporting, the promotion rule, Optuna's pruner, pruning the never-promoted trials at the
end), the trainer (`visionloop.train.api.train` with `until_epoch`: pause at a rung with a
checkpoint, exit 76, continue from it), and the evaluations file the tuner reads
(`sched.service_reconcile.append_evals` / `read_evals`). What is replaced: the control
plane. `InProcessQueue` implements the tuner's `Queue` protocol and runs each queued job
synchronously in this process between two tuner passes (one trial at a time: concurrency 1),
recording the evaluations the trainer reports into the job's evaluations file as the control
plane does from the job's progress lines.

Compute is the CPU-seconds spent inside `train()` calls (torch on one thread, no loader
workers, so the process's CPU time is the training's), and the epochs trained, summed in the
order the calls ran. The headline: the compute each arm spends until one of its trials
*finishes* (all epochs) within 0.5 accuracy points of the best final accuracy random search
found in that repetition; the ratio ASHA / random per seed and its mean (target <= 1/3).

    python benchmarks/tune/search_efficiency.py [--seeds 0,1,2] [--trials 27] [--epochs 9]
        [--val-fraction 0.2]
"""

from __future__ import annotations

import os

# One torch thread (set before torch is imported): CPU-seconds then measure the training, not
# OpenMP threads spinning on a machine shared with other work.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import write_result

ARMS = ("random", "asha", "asha_stop", "asha_tpe")
# The arms that sample with Optuna's random sampler: trial k is the same configuration in each.
SAME_DRAWS = ("random", "asha", "asha_stop")
TPE_STARTUP = 10  # Optuna's TPE draws its first 10 trials at random, from the seed's stream
TOLERANCE_POINTS = 0.5
METRIC = "accuracy"


# --------------------------------------------------------------------------- the task


def build_dataset(root: Path, val_fraction: float, noise: float = 0.0) -> Path:
    """scikit-learn's digits as 16 px PNGs, through the real ingest (as tests/_trainkit.py,
    which holds out 20% for validation). `noise` > 0 adds Gaussian pixel noise of that
    standard deviation (as a fraction of the 0-255 range; seeded, the same every run) to every
    image before ingest: a harder task, where fewer configurations come near the best."""
    import numpy as np
    from PIL import Image

    from visionloop.cli.demo import write_digits_imagefolder
    from visionloop.data.ingest import IngestOptions, ingest

    write_digits_imagefolder(root / "digits-images", scale=2)
    if noise > 0:
        rng = np.random.default_rng(0)
        for png in sorted((root / "digits-images").rglob("*.png")):
            pixels = np.asarray(Image.open(png), dtype=np.float64)
            noisy = pixels + rng.normal(0.0, noise * 255.0, pixels.shape)
            Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(png)
    out = root / "digits-ds"
    ingest(root / "digits-images", out, IngestOptions(val_fraction=val_fraction, seed=0, workers=2))
    return out


def train_doc(dataset: Path, epochs: int, seed: int) -> dict[str, Any]:
    return {
        "data": {
            "dataset": str(dataset),
            "batch_size": 64,
            "workers": 0,
            "image_size": 16,
            "augment": {"hflip": 0.0, "scale": [0.6, 1.0]},
        },
        "model": {"arch": "small_cnn"},
        "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
        "schedule": {"name": "cosine", "warmup_steps": 10},
        "epochs": epochs,
        "seed": seed,
        "deterministic": True,
        "tracking": {"experiment": "bench-tune"},
    }


SPACE = {
    "optimizer.lr": {"loguniform": [1e-5, 1e-1]},
    "optimizer.weight_decay": {"loguniform": [1e-6, 1e-1]},
    "model.arch": {"choice": ["small_cnn", "tiny_resnet"]},
}


def tune_doc(arm: str, dataset: Path, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    pruner: dict[str, Any] = {"name": "none"}
    if arm != "random":
        pruner = {
            "name": "asha",
            "min_epochs": args.min_epochs,
            "reduction_factor": args.eta,
            "promotion": arm != "asha_stop",
        }
    return {
        "name": f"se-{arm}-s{seed}",
        "train": train_doc(dataset, args.epochs, seed),
        "space": SPACE,
        "objective": {"metric": f"val/{METRIC}", "direction": "max"},
        "sampler": {"name": "tpe" if arm == "asha_tpe" else "random", "seed": seed},
        "pruner": pruner,
        "trials": args.trials,
        "concurrency": 1,
    }


# --------------------------------------------------------------------------- the control plane, in process


@dataclass
class Call:
    """One train() call: a job's attempt from one pause (or its start) to the next."""

    job: int
    trial: int
    from_epoch: int
    to_epoch: int
    until_epoch: int | None
    exit_code: int
    cpu_s: float
    wall_s: float
    final: float | None = None  # the trial's final metric, when this call finished it
    # The metric after each epoch this call trained: random search's full curves are what
    # replay.py replays successive halving on.
    curve: list[float] | None = None


@dataclass
class _Job:
    id: int
    doc: dict[str, Any]
    trial: int
    until_epoch: int | None
    state: str = "queued"
    epoch: int = 0  # epochs done
    attempts: int = 0


@dataclass
class InProcessQueue:
    """The tuner's `Queue` protocol over jobs run here, one at a time, by `run_queued`."""

    jobs_dir: Path
    runs_dir: Path
    jobs: dict[int, _Job] = field(default_factory=dict)
    keys: dict[str, int] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)

    def submit(self, spec: dict[str, Any], **fields: Any) -> dict[str, Any]:
        from visionloop.specs import JobSpec

        key = fields.get("idempotency_key")
        if key is not None and key in self.keys:
            return self._show(self.jobs[self.keys[key]])
        job_spec = JobSpec.model_validate(spec)
        assert job_spec.trial is not None, "the tuner submits trial jobs"
        job = _Job(len(self.jobs) + 1, spec, job_spec.trial.number, job_spec.trial.until_epoch)
        self.jobs[job.id] = job
        if key is not None:
            self.keys[key] = job.id
        return self._show(job)

    def job(self, job_id: int) -> dict[str, Any]:
        return {"job": self._show(self.jobs[job_id]), "cost": {"total": {"gpu_hours": 0.0, "cost": 0.0}}}

    def evals(self, job_id: int) -> list[dict[str, Any]]:
        """The job's reported evaluations, as the control plane's API gives them (api.client's
        `evals`), for a tuner that asks the queue rather than reading the jobs folder."""
        from visionloop.sched.service_reconcile import EVALS_FILE, read_evals

        path = self.jobs_dir / f"job-{job_id}" / EVALS_FILE
        return [{"step": e.step, "epoch": e.epoch, "metrics": e.metrics} for e in read_evals(path)]

    def resume(self, job_id: int, until_epoch: int | None, reason: str | None = None) -> dict[str, Any]:
        job = self.jobs[job_id]
        if job.state == "paused":  # idempotent, as the real queue: a job no longer paused stays
            job.state, job.until_epoch = "queued", until_epoch
        return self._show(job)

    def prune(self, job_id: int, reason: str | None = None) -> dict[str, Any]:
        job = self.jobs[job_id]
        if job.state in ("paused", "queued"):
            job.state = "pruned"
        return self._show(job)

    def _show(self, job: _Job) -> dict[str, Any]:
        workload = {"kind": "trial", "study": job.doc["trial"]["study"], "number": job.trial}
        workload["until_epoch"] = job.until_epoch
        return {"id": job.id, "state": job.state, "workload_doc": workload}

    def run_queued(self) -> int:
        """Run every queued job to its next pause or its end; how many ran."""
        ran = 0
        for job in list(self.jobs.values()):
            if job.state == "queued":
                self._run(job)
                ran += 1
        return ran

    def _run(self, job: _Job) -> None:
        from visionloop.sched.progress import EvalEvent
        from visionloop.sched.service_reconcile import EVALS_FILE, append_evals
        from visionloop.specs import JobSpec
        from visionloop.train.api import train
        from visionloop.train.report import Reporter

        spec = JobSpec.model_validate(job.doc).train
        evals: list[EvalEvent] = []

        class Evals(Reporter):
            def eval_end(self, epoch: float, step: int, metrics: dict[str, float], summary: str) -> None:
                # What the trainer's progress line carries: finite scalar metrics, plain names.
                kept = {
                    k: float(v)
                    for k, v in metrics.items()
                    if "/" not in k and isinstance(v, int | float) and math.isfinite(v)
                }
                evals.append(EvalEvent(step, epoch, kept))

        job.state = "running"
        job.attempts += 1
        wall, cpu = time.perf_counter(), time.process_time()
        result = train(
            spec, self.runs_dir / f"job-{job.id}", until_epoch=job.until_epoch, track=False, reporter=Evals()
        )
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        if evals:
            append_evals(self.jobs_dir / f"job-{job.id}" / EVALS_FILE, job.attempts, evals)
        done = round(evals[-1].epoch) if evals else job.epoch
        final = None
        if result.exit_code == 0:
            job.state, final = "succeeded", float(result.final_metrics[METRIC])
        elif result.exit_code == 76:
            job.state = "paused"
        else:
            job.state = "failed"
        self.calls.append(
            Call(
                job.id,
                job.trial,
                job.epoch,
                done,
                job.until_epoch,
                result.exit_code,
                cpu,
                wall,
                final,
                [e.metrics[METRIC] for e in evals if METRIC in e.metrics],
            )
        )
        job.epoch = done


# --------------------------------------------------------------------------- one study


def run_arm(arm: str, dataset: Path, root: Path, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    from optuna.trial import TrialState

    from visionloop.tune.spec import validate_tune_spec
    from visionloop.tune.study import create_or_load
    from visionloop.tune.tuner import Tuner

    where = root / f"{arm}-s{seed}"
    where.mkdir(parents=True)
    spec = validate_tune_spec(tune_doc(arm, dataset, args, seed), f"the {arm} tune spec", where)
    study = create_or_load(spec, f"sqlite:///{where / 'control.db'}")
    queue = InProcessQueue(jobs_dir=where / "jobs", runs_dir=where / "runs")
    tuner = Tuner(spec, study, queue)
    t0, tuner_cpu = time.perf_counter(), 0.0
    while True:
        c = time.process_time()
        progress = tuner.step()
        tuner_cpu += time.process_time() - c
        if progress.done:
            break
        if queue.run_queued() == 0 and tuner.step().running == 0:
            raise RuntimeError(f"{arm}: the study is not done but nothing is queued: {progress}")
    wall = time.perf_counter() - t0
    trials = study.get_trials(deepcopy=False)
    states = {s.name.lower(): sum(t.state == s for t in trials) for s in TrialState}
    return {
        "arm": arm,
        "seed": seed,
        "calls": [asdict(c) for c in queue.calls],
        "params": [t.params for t in sorted(trials, key=lambda t: t.number)],
        "finals": {t.number: t.value for t in trials if t.state == TrialState.COMPLETE},
        "states": {k: v for k, v in states.items() if v},
        "promotions": sum(int(t.user_attrs.get("promotions", 0)) for t in trials),
        "wall_s": wall,
        "tuner_cpu_s": tuner_cpu,
    }


def to_target(calls: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """Compute spent, in the order the calls ran, until a call finishes a trial at `target` or
    better (None if none does), and in all."""
    cpu = epochs = 0.0
    reached: dict[str, Any] | None = None
    for call in calls:
        cpu += call["cpu_s"]
        epochs += call["to_epoch"] - call["from_epoch"]
        if reached is None and call["final"] is not None and call["final"] >= target:
            reached = {"cpu_s": cpu, "epochs": epochs, "trial": call["trial"], "final": call["final"]}
    return {"reached": reached, "total_cpu_s": cpu, "total_epochs": epochs}


def summarize_seed(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    base = runs["random"]
    best = max(v for v in base["finals"].values() if v is not None)
    target = best - TOLERANCE_POINTS / 100
    out: dict[str, Any] = {"random_best": best, "target": target, "arms": {}}
    for arm, run in runs.items():
        same = run["params"] if arm in SAME_DRAWS else run["params"][:TPE_STARTUP]
        if same != base["params"][: len(same)]:
            raise RuntimeError(f"{arm} drew other configurations than random search: the comparison is void")
        out["arms"][arm] = {
            **to_target(run["calls"], target),
            "best_final": max((v for v in run["finals"].values() if v is not None), default=None),
            "trials": run["states"],
            "promotions": run["promotions"],
            "train_calls": len(run["calls"]),
            "wall_s": run["wall_s"],
            "tuner_cpu_s": run["tuner_cpu_s"],
        }
    # Trial k has the same configuration in every arm and training is deterministic, so a
    # trial that finished in two arms must end at the same value (paused and continued or not).
    others = [arm for arm in ARMS[1:] if arm in runs]
    for arm in others:
        both = [
            k
            for k in runs[arm]["finals"]
            if k in base["finals"] and runs[arm]["params"][int(k)] == base["params"][int(k)]
        ]
        same = sum(runs[arm]["finals"][k] == base["finals"][k] for k in both)
        out["arms"][arm]["finals_equal_to_random"] = f"{same}/{len(both)}"
    ref = out["arms"]["random"]["reached"]
    for arm in others:
        got = out["arms"][arm]["reached"]
        out[f"{arm}_over_random_cpu"] = got["cpu_s"] / ref["cpu_s"] if got else None
        out[f"{arm}_over_random_epochs"] = got["epochs"] / ref["epochs"] if got else None
    return out


def write_summary(
    args: argparse.Namespace,
    seeds: list[int],
    per_seed: dict[int, dict[str, Any]],
    raw: dict[str, Any],
    wall_s: float,
) -> Path:
    """The ratios over the seeds, printed and written with every call's figures."""
    ratios: dict[str, Any] = {}
    others = [arm for arm in ARMS[1:] if all(arm in s["arms"] for s in per_seed.values())]
    for arm in others:
        for unit in ("cpu", "epochs"):
            values = [s[f"{arm}_over_random_{unit}"] for s in per_seed.values()]
            got = [v for v in values if v is not None]
            ratios[f"{arm}_over_random_{unit}"] = {
                "per_seed": values,
                "mean": statistics.fmean(got) if got else None,
                "reached": f"{len(got)}/{len(values)}",
            }
    print()
    for key, r in ratios.items():
        mean = f"{r['mean']:.3f}" if r["mean"] is not None else "n/a"
        per = ", ".join("never" if v is None else f"{v:.3f}" for v in r["per_seed"])
        print(f"{key}: mean {mean} (reached in {r['reached']} seeds; per seed {per})")
    # The whole study's compute (every trial to its end or its prune), for scale.
    for arm in others:
        whole = [
            s["arms"][arm]["total_cpu_s"] / s["arms"]["random"]["total_cpu_s"] for s in per_seed.values()
        ]
        ratios[f"{arm}_over_random_whole_study_cpu"] = {"per_seed": whole, "mean": statistics.fmean(whole)}
        print(f"{arm}_over_random_whole_study_cpu: mean {statistics.fmean(whole):.3f}")
    print("target: asha_over_random_cpu <= 0.333")
    path = write_result(
        args.name,
        {
            "config": {
                "seeds": seeds,
                "val_fraction": args.val_fraction,
                "noise": args.noise,
                "trials": args.trials,
                "epochs": args.epochs,
                "min_epochs": args.min_epochs,
                "reduction_factor": args.eta,
                "tolerance_points": TOLERANCE_POINTS,
                "space": SPACE,
                "base_train_spec": train_doc(Path("<digits>"), args.epochs, 0),
                "concurrency": 1,
            },
            "ratios": ratios,
            "per_seed": {str(k): v for k, v in per_seed.items()},
            "runs": raw,
            "total_wall_s": wall_s,
        },
    )
    return path


def recorded_random(args: argparse.Namespace) -> dict[str, Any]:
    """Random search's runs by seed from `--random-from`, refused unless they searched the
    same task and space with the same trial budget and epochs."""
    from _common import RESULTS

    found: dict[str, Any] = {}
    for name in (args.random_from or "").split(",") if args.random_from else []:
        doc = json.loads((RESULTS / f"{name}.json").read_text())
        c = doc["config"]
        mine = (args.val_fraction, args.noise, args.trials, args.epochs, SPACE)
        theirs = (c["val_fraction"], c.get("noise", 0.0), c["trials"], c["epochs"], c["space"])
        if mine != theirs:
            raise SystemExit(f"{name} searched another task, space, budget or epochs than this run")
        found.update({seed: runs["random"] for seed, runs in doc["runs"].items()})
    return found


def merge(args: argparse.Namespace) -> None:
    """Combine the results of one process per seed (`--merge a,b,c`: result names) into one."""
    from _common import RESULTS

    per_seed: dict[int, dict[str, Any]] = {}
    raw: dict[str, Any] = {}
    wall = 0.0
    config: dict[str, Any] | None = None
    for name in args.merge.split(","):
        doc = json.loads((RESULTS / f"{name}.json").read_text())
        mine = {k: v for k, v in doc["config"].items() if k != "seeds"}
        if config is not None and mine != config:
            raise SystemExit(f"{name} ran another configuration than the others: {mine} != {config}")
        config = mine
        for k, v in doc["per_seed"].items():
            per_seed[int(k)] = v
        raw.update(doc["runs"])
        wall += doc["total_wall_s"]
    assert config is not None
    for key in ("trials", "epochs", "min_epochs", "val_fraction", "noise"):
        setattr(args, key, config.get(key, 0.0) if key == "noise" else config[key])
    args.eta = config["reduction_factor"]
    path = write_summary(args, sorted(per_seed), per_seed, raw, wall)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--trials", type=int, default=27)
    p.add_argument("--epochs", type=int, default=9)
    p.add_argument("--min-epochs", type=int, default=1)
    p.add_argument("--eta", type=int, default=3)
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.2,
        help="held out for validation; 0.8 is a small-data task (36 training images a class)",
    )
    p.add_argument(
        "--noise",
        type=float,
        default=0.0,
        help="Gaussian pixel noise (std as a fraction of 0-255) added to every image: a harder task",
    )
    p.add_argument(
        "--arms",
        default=",".join(ARMS),
        help="the arms to train; `random` alone records the curves that replay.py replays the others on",
    )
    p.add_argument(
        "--random-from",
        default=None,
        help="take random search's runs from these results (comma-separated names) instead of training "
        "them again: the same seeds draw the same configurations and training is deterministic",
    )
    p.add_argument("--name", default=None, help="results file name (default from --val-fraction)")
    p.add_argument(
        "--merge",
        default=None,
        help="combine earlier results (comma-separated names, one process per seed) into --name",
    )
    args = p.parse_args()
    if args.merge:
        if args.name is None:
            raise SystemExit("--merge needs --name for the combined results")
        merge(args)
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    arms = [a for a in ARMS if a in args.arms.split(",")]
    if not arms or arms[0] != "random":
        raise SystemExit(f"--arms must include random (the baseline), from {', '.join(ARMS)}")
    if args.name is None:
        suffix = "" if args.val_fraction == 0.2 else f"_val{round(args.val_fraction * 100)}"
        args.name = f"tune_search_efficiency{suffix}"
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)

    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    per_seed: dict[int, dict[str, Any]] = {}
    raw: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="vl-tune-bench-") as tmp:
        root = Path(tmp)
        dataset = build_dataset(root, args.val_fraction, args.noise)
        recorded = recorded_random(args)
        for seed in seeds:
            runs = {}
            for arm in arms:
                if arm == "random" and recorded:
                    if str(seed) not in recorded:
                        raise SystemExit(f"--random-from has no random search of seed {seed}")
                    runs[arm] = recorded[str(seed)]
                else:
                    runs[arm] = run_arm(arm, dataset, root, args, seed)
                a = runs[arm]
                print(
                    f"seed {seed} {arm:9s}: {len(a['calls'])} train calls, "
                    f"{sum(c['to_epoch'] - c['from_epoch'] for c in a['calls'])} epochs, "
                    f"{sum(c['cpu_s'] for c in a['calls']):.1f} CPU-s, {a['states']}, "
                    f"best {max(a['finals'].values(), default=float('nan')):.4f}",
                    flush=True,
                )
            per_seed[seed] = summarize_seed(runs)
            raw[str(seed)] = runs
            s = per_seed[seed]
            for arm in arms:
                r = s["arms"][arm]["reached"]
                shown = (
                    f"{r['cpu_s']:7.1f} CPU-s {r['epochs']:4.0f} epochs "
                    f"(trial {r['trial']}, {r['final']:.4f})"
                    if r
                    else "never"
                )
                print(
                    f"seed {seed} {arm:9s} to within {TOLERANCE_POINTS} pt of {s['random_best']:.4f}: {shown}"
                )
    path = write_summary(args, seeds, per_seed, raw, time.perf_counter() - started)
    print(f"wrote {path} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
