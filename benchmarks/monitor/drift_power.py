"""Drift monitor: false-alarm rate on undrifted traffic and detection power under shift.

What is real:
- the model: small_cnn trained by the real trainer on scikit-learn's digits at 16 px (the real
  ingest, half of the images held out), **without digit 9**, registered, and exported to ONNX
  fp32 through `visionloop.export.export_model` (parity and accuracy gates passed);
- the served pipeline: every image goes as a PNG file through the server's own decode
  (`serve.images.decode_image(..., stats=True)`: the card's preprocessing and the image
  statistics), the exported model in ONNX Runtime (1 intra-op thread) and the task's
  `drift_outputs`, and each row becomes the `MonitorFields` the server logs, round-tripped
  through the log's JSON (`PredictionRecord.to_json` → orjson → `from_json`, which rounds the
  drift columns to 6 decimals), so the monitor reads what it would read from a prediction log;
- the reference: a `Reference` built as `monitor.reference.build_reference` builds it (ONNX
  outputs as computed, predicted-class counts, confidences, image statistics, the ATC
  threshold from the reference images' correctness);
- the decision: `monitor.windows.judge`, the monitor's own verdict (KS-BBSD, MMD on the
  outputs, label shift, image-statistic KS, Bonferroni over the tests, auto-thinning).

What is simulated: the traffic. Every held-out image of digits 0-8 (the pool H) is scored once,
clean and under each shift (`eval.corruptions.corrupt`, seeded per image with `image_seed`);
the 9s (never trained on) are scored clean. Each trial draws a random reference R of
`--reference` images from H and a disjoint window W of m images from H minus R, so under no
shift R and W are exchangeable and the share of windows that alarm is the monitor's real
false-alarm rate. Shifted windows take W's images under the shift (the same R and W as the
clean trial with the same number: common random numbers across shifts); the unseen-class shift
replaces a share f of W's rows with random 9s. Correlated traffic (a camera that keeps an
object in view for a while) is a stream of runs: each run one image of H minus R repeated a
geometric number of times (mean `--run-length`), exact repeats being the harshest case of
correlated frames.

Checks and baselines in the same run: the clean images re-encoded unchanged must log exactly
what the stored ones do (else a shift's PNG re-encoding, not the shift, could be detected);
correlated windows are judged with thin=1 (no thinning) beside thin="auto"; and the log's
6-decimal rounding is isolated by judging undrifted windows as logged, unrounded, and against a
reference rounded as the log rounds, at the model's own sharpness and under two temperatures
(a stored temperature sharpens what both the server logs and the reference stores).

Reported per configuration and window size: the share of windows with drift (a Wilson 95%
interval), which tests flagged, the mean label-free accuracy estimate (ATC) against the mean
true accuracy of the window's images (a 9 is always wrong), and, for the null, each test's own
rejection rate at alpha (is each test's p-value valid?). A window that thinning leaves with
fewer than 20 samples is not tested (status too_few_samples, drift False) and is counted.

    python benchmarks/monitor/drift_power.py [--trials 100] [--null-trials 200]
        [--correlated-trials 100] [--correlated-null-trials 300] [--seed 0] [--quick]

Defaults: ~5 CPU-minutes (7.5 min of wall clock on the loaded 2-core VM); --quick, a smoke
run, under a minute. Results: benchmarks/results/monitor_drift_power.json.
"""

from __future__ import annotations

import os

# One thread everywhere (set before numpy and torch are imported): the machine is shared, and
# the MMD's matrix products go through BLAS, whose threads wait for each other on busy cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import argparse
import io
import math
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import machine, write_result
from visionloop.monitor.history import WindowRecord
from visionloop.monitor.reference import Reference, atc_threshold
from visionloop.monitor.windows import judge
from visionloop.serve.record import MonitorFields, PredictionRecord
from visionloop.tasks.drift_outputs import EMBEDDING_OUTPUT

MODEL = "digits-no9"
UNSEEN = "9"
ALPHA = 0.05
SHIFTS = ("motion_blur", "glare", "night")
SEVERITIES = (1, 3, 5)
WINDOWS = (50, 100, 200, 400)
UNSEEN_FRACTIONS = (0.1, 0.3)
CORRELATED_WINDOWS = (200, 1000, 2000)
CORRELATED_SHIFT = ("night", 3)
# None: the model as trained; 0.656: the temperature fitted to the demo's model (BENCHMARKS.md,
# "Calibration and stress"); 0.5: a sharper one.
ROUNDING_TEMPERATURES = (None, 0.656, 0.5)
# MMD runs on the export's embeddings (`mmd_embeddings`); `--no-embedding` exports without
# that output, and the monitor falls back to MMD on the drift columns (`mmd_outputs`).
TESTS = ("ks_bbsd", "mmd_embeddings", "mmd_outputs", "label_shift", "image_stats")

Array = npt.NDArray[Any]


# --------------------------------------------------------------------------- the model


def build_model(root: Path, epochs: int) -> tuple[Any, Path, Path]:
    """Digits without 9 → ingest (half held out) → train → register → ONNX fp32 export.
    Returns the settings, the dataset folder and the folder of the held-back 9s."""
    import shutil

    import yaml

    from visionloop.cli.demo import write_digits_imagefolder
    from visionloop.core.settings import Settings
    from visionloop.data.ingest import IngestOptions, ingest
    from visionloop.export import export_model
    from visionloop.registry import register
    from visionloop.specs import load_train_spec
    from visionloop.train.api import train

    home = root / "home"
    settings = Settings(home=home, tracking_uri=f"sqlite:///{home / 'mlflow.db'}").ensure()
    images = root / "digits-images"
    write_digits_imagefolder(images, scale=2)  # 16 px PNGs
    nines = root / "unseen"
    shutil.move(images / UNSEEN, nines)
    dataset = root / "digits-ds"
    ingest(images, dataset, IngestOptions(val_fraction=0.5, seed=0, workers=1))
    doc = {
        "data": {
            "dataset": str(dataset),
            "batch_size": 64,
            "workers": 0,
            "image_size": 16,
            "augment": {"hflip": 0.0, "scale": [0.6, 1.0], "color_jitter": 0.2},
        },
        "model": {"arch": "small_cnn", "kwargs": {"drop_rate": 0.1}},
        "optimizer": {"name": "adamw", "lr": 0.003, "weight_decay": 0.01},
        "schedule": {"name": "cosine", "warmup_steps": 5},
        "epochs": epochs,
        "seed": 0,
        "deterministic": True,
        "tracking": {"experiment": "bench-drift"},
    }
    spec_path = root / "train.yaml"
    spec_path.write_text(yaml.safe_dump(doc, sort_keys=False))
    spec, resolved = load_train_spec(spec_path)
    run_dir = settings.runs_dir / MODEL
    result = train(spec, run_dir, spec_text=spec_path.read_text(), resolved=resolved, settings=settings)
    if result.exit_code != 0:
        raise RuntimeError(f"training failed: {result}")
    info = register(run_dir, name=MODEL, settings=settings)
    export_model(f"{info.name}/{info.version}", fmt="onnx", precision="fp32", settings=settings)
    return settings, dataset, nines


@dataclass
class Served:
    """The exported model as the server runs it."""

    name: str
    version: int
    model: Any  # serve.runtime.OnnxModel
    card: Any
    task: Any
    temperature: float | None
    transform: Any
    need: int

    @classmethod
    def load(cls, settings: Any) -> Served:
        from visionloop.registry import get_version
        from visionloop.serve.images import needed_side
        from visionloop.serve.source import RegistrySource
        from visionloop.tasks import get_task

        info = get_version(MODEL, settings)
        resolved = RegistrySource(settings, precision="fp32").version(info.name, info.version)
        card = resolved.card
        pre = card.eval_preprocess()
        return cls(
            name=info.name,
            version=info.version,
            model=resolved.load(intra_op_threads=1),
            card=card,
            task=get_task(card.task),
            temperature=resolved.temperature,
            transform=pre.to_transform(),
            need=needed_side(pre),
        )


# --------------------------------------------------------------------------- scoring images


@dataclass
class Bank:
    """Per image, what the server computes and logs for it."""

    outputs: Array  # (n, K) float32 drift columns as computed: what a reference stores
    predicted: Array  # (n,) int
    confidence: Array  # (n,) float32
    stats: dict[str, Array]  # image statistic -> (n,)
    correct: Array  # (n,) bool
    logged: list[MonitorFields]  # as read back from the prediction log
    embeddings: Array | None = None  # (n, k) the export's embedding output, when it has one

    def take(self, idx: Array) -> list[MonitorFields]:
        return [self.logged[i] for i in idx]


def score(served: Served, pngs: Sequence[bytes], labels: Array, batch: int = 32) -> Bank:
    """Each PNG through the server's decode (with statistics), the ONNX model and the task's
    drift outputs, as `build_reference` and the server do."""
    from visionloop.serve.images import MAX_PIXELS, decode_image

    spec = served.model.inputs[0]
    columns, classes, conf, logged, embedded = [], [], [], [], []
    stats: dict[str, list[float]] = {}
    for start in range(0, len(pngs), batch):
        decoded = [
            decode_image(b, served.transform, spec.dtype, served.need, MAX_PIXELS, stats=True)
            for b in pngs[start : start + batch]
        ]
        outputs = served.model.run({spec.name: np.concatenate([d.input for d in decoded])})
        if served.temperature is not None:
            outputs = dict(served.task.calibrate(outputs, served.temperature))
        drift = served.task.drift_outputs(outputs, served.card.class_names)
        emb = outputs.get(EMBEDDING_OUTPUT)
        if emb is not None:
            embedded.append(np.asarray(emb, dtype=np.float32))
        columns.append(np.asarray(drift.columns, dtype=np.float32))
        classes.append(np.asarray(drift.classes, dtype=np.int64))
        conf.append(np.asarray(drift.confidence, dtype=np.float32))
        for r, d in enumerate(decoded):
            assert d.stats is not None
            for k, v in d.stats.items():
                stats.setdefault(k, []).append(v)
            fields = MonitorFields(
                outputs=drift.columns[r],
                predicted=int(drift.classes[r]),
                confidence=float(drift.confidence[r]),
                image=d.stats,
                embedding=None if emb is None else emb[r],
            )
            logged.append(_through_log(served, fields))
    predicted = np.concatenate(classes)
    return Bank(
        outputs=np.concatenate(columns),
        predicted=predicted,
        confidence=np.concatenate(conf),
        stats={k: np.asarray(v, dtype=np.float32) for k, v in stats.items()},
        correct=predicted == labels,
        logged=logged,
        embeddings=np.concatenate(embedded) if embedded else None,
    )


def _through_log(served: Served, fields: MonitorFields) -> MonitorFields:
    """The fields as `visionloop monitor` reads them back from the server's prediction log."""
    record = PredictionRecord(0.0, served.name, served.version, "primary", 1.0, monitor=fields)
    back = PredictionRecord.from_json(orjson.loads(orjson.dumps(record.to_json())))
    assert back.monitor is not None
    return back.monitor


def heldout_images(settings: Any) -> tuple[list[bytes], Array]:
    """The validation split's stored image files and labels (the split the reference uses)."""
    from visionloop.eval.api import dataset_for, split_reader
    from visionloop.registry import get_version

    info = get_version(MODEL, settings)
    path, manifest = dataset_for(info, None)
    _, reader = split_reader(path, manifest, None)
    records = reader.read_many(list(range(len(reader))))
    return [bytes(r["image"]) for r in records], np.asarray([int(r["label"]) for r in records])


def shifted(pngs: Sequence[bytes], name: str | None, severity: int, seed: int) -> list[bytes]:
    """Each image corrupted (seeded per image) and re-encoded as PNG, as a camera would send it;
    `name` None re-encodes the image unchanged (the check that re-encoding alone moves nothing)."""
    from PIL import Image

    from visionloop.eval.corruptions import corrupt, image_seed

    out = []
    for i, data in enumerate(pngs):
        with Image.open(io.BytesIO(data)) as im:
            pixels = np.asarray(im.convert("RGB") if im.mode not in ("L", "RGB") else im)
        bad = pixels if name is None else corrupt(pixels, name, severity, image_seed(seed, i))
        buf = io.BytesIO()
        Image.fromarray(bad).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def build_banks(
    served: Served,
    pngs: Sequence[bytes],
    labels: Array,
    nines_dir: Path,
    severities: Sequence[int],
    seed: int,
) -> dict[str, Bank]:
    """The pool clean, re-encoded unchanged (a check), and under every shift; the 9s clean."""
    banks = {"clean": score(served, pngs, labels)}
    again = score(served, shifted(pngs, None, 1, seed), labels)
    if again.logged != banks["clean"].logged:
        raise RuntimeError(
            "re-encoding the images unchanged moved their logged fields: shifts would be confounded"
        )
    for name in SHIFTS:
        for severity in severities:
            banks[f"{name}/{severity}"] = score(served, shifted(pngs, name, severity, seed), labels)
    nines = [p.read_bytes() for p in sorted(nines_dir.glob("*.png"))]
    banks["unseen"] = score(served, nines, np.full(len(nines), -1))  # never right
    return banks


# --------------------------------------------------------------------------- trials


def make_reference(served: Served, clean: Bank, idx: Array, embeddings: bool = True) -> Reference:
    """A reference of the pool images `idx`, built as `build_reference` builds one; without
    `embeddings`, as for an export without that output (the monitor's MMD on the outputs)."""
    k = clean.outputs.shape[1]
    names = tuple(served.card.class_names)
    return Reference(
        model=served.name,
        version=served.version,
        task=served.task.name,
        dataset="<pool>",
        split="val",
        images=len(idx),
        precision="fp32",
        temperature=served.temperature,
        output_names=tuple(f"p({n})" for n in names[:k]),
        outputs=clean.outputs[idx],
        class_names=names,
        class_counts=np.bincount(clean.predicted[idx], minlength=len(names)).astype(np.int64),
        confidence=clean.confidence[idx],
        image={key: v[idx] for key, v in clean.stats.items()},
        accuracy=float(clean.correct[idx].mean()),
        atc_threshold=atc_threshold(clean.confidence[idx], clean.correct[idx]),
        embeddings=None if clean.embeddings is None or not embeddings else clean.embeddings[idx],
    )


def records(served: Served, fields: Sequence[MonitorFields]) -> list[PredictionRecord]:
    return [
        PredictionRecord(1.7e9 + i, served.name, served.version, "primary", 1.0, monitor=f)
        for i, f in enumerate(fields)
    ]


@dataclass
class Tally:
    """The windows of one configuration."""

    trials: int = 0
    drift: int = 0
    too_few: int = 0
    flagged: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TESTS, 0))
    own_level: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TESTS, 0))  # p < alpha
    tested: list[int] = field(default_factory=list)
    estimated: list[float] = field(default_factory=list)
    true: list[float] = field(default_factory=list)

    def add(self, rec: WindowRecord, true_accuracy: float) -> None:
        self.trials += 1
        self.drift += bool(rec.drift)
        self.too_few += rec.status == "too_few_samples"
        for name in rec.flagged:
            self.flagged[name] = self.flagged.get(name, 0) + 1
        for name, p in rec.p_values.items():
            if p is not None and p < rec.alpha:
                self.own_level[name] = self.own_level.get(name, 0) + 1
        self.tested.append(rec.tested)
        if rec.estimated_accuracy is not None:
            self.estimated.append(rec.estimated_accuracy)
        self.true.append(true_accuracy)

    def summary(self) -> dict[str, Any]:
        low, high = wilson(self.drift, self.trials)
        return {
            "trials": self.trials,
            "drift": self.drift,
            "rate": self.drift / self.trials,
            "wilson95": [low, high],
            "too_few_samples": self.too_few,
            "flagged": self.flagged,
            "test_rejects_at_alpha": self.own_level,
            "mean_tested": float(np.mean(self.tested)),
            "mean_estimated_accuracy": float(np.mean(self.estimated)) if self.estimated else None,
            "mean_true_accuracy": float(np.mean(self.true)),
            "mean_abs_error": float(np.mean(np.abs(np.subtract(self.estimated, self.true))))
            if self.estimated
            else None,
        }


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k / n."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def split(rng: np.random.Generator, pool: int, reference: int, m: int) -> tuple[Array, Array]:
    """A random reference and a disjoint window of m images (the rest of the pool's order)."""
    order = rng.permutation(pool)
    return np.sort(order[:reference]), order[reference : reference + m]


def run_independent(
    served: Served, banks: dict[str, Bank], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Null, shifts × severities and unseen-class shares, at each window size; trial t of
    every configuration uses the same reference and window (common random numbers)."""
    clean, nines = banks["clean"], banks["unseen"]
    shift_keys = [f"{s}/{v}" for s in SHIFTS for v in args.severities]
    unseen_keys = [f"unseen/{f:g}" for f in UNSEEN_FRACTIONS]
    tallies: dict[str, Tally] = {}
    for m in args.windows:
        for t in range(max(args.trials, args.null_trials)):
            rng = np.random.default_rng((args.seed, m, t))
            ref_idx, win_idx = split(rng, len(clean.correct), args.reference, m)
            ref = make_reference(served, clean, ref_idx, args.embedding)
            configs: list[tuple[str, list[MonitorFields], float]] = []
            configs.append(("none", clean.take(win_idx), float(clean.correct[win_idx].mean())))
            if t < args.trials:
                for key in shift_keys:
                    bank = banks[key]
                    configs.append((key, bank.take(win_idx), float(bank.correct[win_idx].mean())))
                for key, f in zip(unseen_keys, UNSEEN_FRACTIONS, strict=True):
                    configs.append((key, *with_unseen(rng, clean, nines, win_idx, f)))
            for key, fields, true_acc in configs:
                rec = judge(ref, records(served, fields), alpha=ALPHA, seed=t)
                tallies.setdefault(f"{key}@{m}", Tally()).add(rec, true_acc)
        print(f"  windows of {m}: done ({time.perf_counter() - STARTED:.0f} s)", flush=True)
    return {k: v.summary() for k, v in tallies.items()}


def with_unseen(
    rng: np.random.Generator, clean: Bank, nines: Bank, win_idx: Array, share: float
) -> tuple[list[MonitorFields], float]:
    """The window with round(share * m) of its rows, at random places, replaced by random 9s."""
    m = len(win_idx)
    n = round(share * m)
    places = set(rng.choice(m, size=n, replace=False).tolist())
    picks = iter(rng.choice(len(nines.correct), size=n, replace=n > len(nines.correct)).tolist())
    fields, right = [], 0
    for pos, i in enumerate(win_idx):
        if pos in places:
            fields.append(nines.logged[next(picks)])
        else:
            fields.append(clean.logged[i])
            right += bool(clean.correct[i])
    return fields, right / m


def stream(rng: np.random.Generator, candidates: Array, m: int, run_length: float) -> Array:
    """m requests of video-like traffic: runs of one image each, geometric lengths (mean
    `run_length`), a new image per run drawn without replacement from `candidates`."""
    order = rng.permutation(candidates)
    out: list[int] = []
    for image in _cycle(order):
        out.extend([int(image)] * int(rng.geometric(1.0 / run_length)))
        if len(out) >= m:
            return np.asarray(out[:m])
    raise AssertionError("unreachable")


def _cycle(items: Array) -> Iterator[int]:
    while True:
        yield from items.tolist()


def run_correlated(
    served: Served, banks: dict[str, Bank], args: argparse.Namespace
) -> dict[str, dict[str, Any]]:
    """Video-like windows judged with thin=1 and thin="auto": undrifted in every trial, and
    under night/3 (and with thin=1) in the first `correlated_trials` of them."""
    clean = banks["clean"]
    shift = banks[f"{CORRELATED_SHIFT[0]}/{CORRELATED_SHIFT[1]}"]
    tallies: dict[str, Tally] = {}
    steps: dict[str, list[int]] = {}
    pool = len(clean.correct)
    for m in args.correlated_windows:
        for t in range(max(args.correlated_trials, args.correlated_null_trials)):
            rng = np.random.default_rng((args.seed, 1_000_000 + m, t))
            ref_idx, rest = split(rng, pool, args.reference, pool - args.reference)
            ref = make_reference(served, clean, ref_idx, args.embedding)
            win = stream(rng, rest, m, args.run_length)
            steps.setdefault(f"distinct@{m}", []).append(len(np.unique(win)))
            for key, bank in (("none", clean), ("night/3", shift)):
                for thin in (1, "auto"):
                    if t >= args.correlated_trials and (key != "none" or thin != "auto"):
                        continue
                    rec = judge(ref, records(served, bank.take(win)), alpha=ALPHA, thin=thin, seed=t)
                    name = f"{key}@{m}/thin={thin}"
                    tallies.setdefault(name, Tally()).add(rec, float(bank.correct[win].mean()))
                    if thin == "auto":
                        steps.setdefault(name, []).append(round(m / max(rec.tested, 1)))
        print(f"  correlated windows of {m}: done ({time.perf_counter() - STARTED:.0f} s)", flush=True)
    out = {k: v.summary() for k, v in tallies.items()}
    for key, values in steps.items():
        if key.startswith("distinct@"):
            out[key] = {"mean_distinct_images": float(np.mean(values))}
        else:
            # requests / tested: the thinning step judge chose, to rounding
            out[key]["thinning_step"] = {
                "median": float(np.median(values)),
                "min": int(min(values)),
                "max": int(max(values)),
            }
    return out


# --------------------------------------------------------------------------- the log's rounding


def rounding_check(
    served: Served, banks: dict[str, Bank], pngs: Sequence[bytes], labels: Array, args: argparse.Namespace
) -> dict[str, Any]:
    """The prediction log keeps the drift columns to 6 decimals; the reference keeps them as
    computed. Null windows at m = `rounding_window`, per temperature (a stored temperature
    sharpens the probabilities the server logs and the reference stores), judged three ways:
    as logged (the product's path), on the unrounded columns (the tests' own level), and
    against a reference rounded as the log rounds (a candidate fix)."""
    out: dict[str, Any] = {}
    m = args.rounding_window
    for temperature in args.rounding_temperatures:
        bank = (
            banks["clean"]
            if temperature is None
            else score(replace(served, temperature=temperature), pngs, labels)
        )
        exact = [
            MonitorFields(
                outputs=row, predicted=int(p), confidence=float(c), image=f.image, embedding=f.embedding
            )
            for row, p, c, f in zip(bank.outputs, bank.predicted, bank.confidence, bank.logged, strict=True)
        ]
        tallies = {arm: Tally() for arm in ("as_logged", "unrounded_window", "rounded_reference")}
        for t in range(args.null_trials):
            rng = np.random.default_rng((args.seed, m, t))  # the null trials' draws at this m
            ref_idx, win_idx = split(rng, len(bank.correct), args.reference, m)
            ref = make_reference(served, bank, ref_idx, args.embedding)
            assert ref.outputs is not None
            # in float64, as the window's logged values are read: float32 cannot hold 1e-6 exactly
            as_logged: Any = np.round(ref.outputs.astype(np.float64), 6)
            rounded = replace(ref, outputs=as_logged)
            true_acc = float(bank.correct[win_idx].mean())
            for arm, reference, fields in (
                ("as_logged", ref, bank.take(win_idx)),
                ("unrounded_window", ref, [exact[i] for i in win_idx]),
                ("rounded_reference", rounded, bank.take(win_idx)),
            ):
                tallies[arm].add(judge(reference, records(served, fields), alpha=ALPHA, seed=t), true_acc)
        tiny = bank.outputs < 5e-7
        out[f"T={temperature or 1:g}"] = {
            "temperature": temperature,
            "share_below_5e-7": float(tiny.mean()),
            "largest_column_share_below_5e-7": float(tiny.mean(axis=0).max()),
            "window": m,
            **{arm: tally.summary() for arm, tally in tallies.items()},
        }
    print(f"  rounding check: done ({time.perf_counter() - STARTED:.0f} s)", flush=True)
    return out


# --------------------------------------------------------------------------- printing


def print_rates(
    title: str, results: dict[str, dict[str, Any]], keys: Sequence[str], cols: Sequence[int]
) -> None:
    print(f"\n{title}")
    print("| configuration | " + " | ".join(f"m = {m}" for m in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for key in keys:
        cells = []
        for m in cols:
            r = results.get(f"{key}@{m}")
            cells.append("—" if r is None else _rate_cell(r))
        print(f"| {key} | " + " | ".join(cells) + " |")


def _rate_cell(r: dict[str, Any]) -> str:
    low, high = r["wilson95"]
    return f"{r['rate']:.1%} [{low:.1%}, {high:.1%}] ({r['drift']}/{r['trials']})"


def print_accuracy(results: dict[str, dict[str, Any]], keys: Sequence[str], m: int) -> None:
    print(f"\nLabel-free accuracy estimate (ATC) at m = {m}: mean estimate vs mean true accuracy")
    print("| configuration | estimated | true | mean abs. error per window |")
    print("|---|---|---|---|")
    for key in keys:
        r = results.get(f"{key}@{m}")
        if r is not None and r["mean_estimated_accuracy"] is not None:
            print(
                f"| {key} | {r['mean_estimated_accuracy']:.3f} | {r['mean_true_accuracy']:.3f} "
                f"| {r['mean_abs_error']:.3f} |"
            )


def print_tests(results: dict[str, dict[str, Any]], keys: Sequence[str]) -> None:
    print("\nPer test: windows flagged in the verdict (p < alpha/T) / rejecting at alpha on its own")
    print("| configuration | " + " | ".join(TESTS) + " |")
    print("|---|" + "---|" * len(TESTS))
    for key in keys:
        r = results[key]
        n = r["trials"]
        cells = [
            f"{r['flagged'].get(t, 0) / n:.1%} / {r['test_rejects_at_alpha'].get(t, 0) / n:.1%}"
            for t in TESTS
        ]
        print(f"| {key} | " + " | ".join(cells) + " |")


def print_rounding(results: dict[str, dict[str, Any]]) -> None:
    print("\nThe log's 6-decimal rounding: undrifted windows, share with drift")
    print(
        "| temperature | values < 5e-7 (all / worst column) | as logged | unrounded window "
        "| rounded reference |"
    )
    print("|---|---|---|---|---|")
    for key, r in results.items():
        cells = " | ".join(
            _rate_cell(r[arm]) for arm in ("as_logged", "unrounded_window", "rounded_reference")
        )
        print(
            f"| {key} (m = {r['window']}) | {r['share_below_5e-7']:.1%} / "
            f"{r['largest_column_share_below_5e-7']:.1%} | {cells} |"
        )


def print_correlated(results: dict[str, dict[str, Any]], windows: Sequence[int]) -> None:
    print("\nCorrelated traffic (runs of repeated frames): share of windows with drift")
    print("| window (requests) | distinct images | shift | thin=1 | thin=auto | auto step (median) |")
    print("|---|---|---|---|---|---|")
    for m in windows:
        distinct = results[f"distinct@{m}"]["mean_distinct_images"]
        for key in ("none", "night/3"):
            one, auto = results[f"{key}@{m}/thin=1"], results[f"{key}@{m}/thin=auto"]
            print(
                f"| {m} | {distinct:.0f} | {key} | {_rate_cell(one)} | {_rate_cell(auto)} "
                f"| {auto['thinning_step']['median']:.0f} (tested {auto['mean_tested']:.0f}, "
                f"too few {auto['too_few_samples']}) |"
            )


# --------------------------------------------------------------------------- main

STARTED = time.perf_counter()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=100, help="windows per shifted configuration")
    p.add_argument("--null-trials", type=int, default=200, help="undrifted windows per window size")
    p.add_argument("--correlated-trials", type=int, default=100, help="video windows: thin=1 and shifted")
    p.add_argument("--correlated-null-trials", type=int, default=300, help="video windows: undrifted, auto")
    p.add_argument("--rounding-window", type=int, default=200)
    p.add_argument("--reference", type=int, default=300, help="images in each trial's reference")
    p.add_argument("--run-length", type=float, default=10.0, help="mean frames per run (correlated)")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="a smoke run: few trials, one epoch")
    p.add_argument("--name", default=None, help="results file name (default monitor_drift_power)")
    p.add_argument(
        "--no-embedding",
        dest="embedding",
        action="store_false",
        help="judge as for an export without the embedding output: MMD on the drift columns",
    )
    args = p.parse_args()
    args.windows = list(WINDOWS)
    args.correlated_windows = list(CORRELATED_WINDOWS)
    args.severities = list(SEVERITIES)
    args.rounding_temperatures = list(ROUNDING_TEMPERATURES)
    if args.quick:
        args.trials, args.null_trials, args.epochs = 4, 6, 1
        args.correlated_trials, args.correlated_null_trials = 3, 4
        args.windows, args.correlated_windows = [50, 200], [200]
        args.severities, args.rounding_temperatures = [3], [0.5]
    if args.name is None:
        args.name = "monitor_drift_power" + ("_quick" if args.quick else "")
    return args


def main() -> None:
    args = parse_args()
    import torch

    torch.set_num_threads(1)
    cpu0 = time.process_time()
    with tempfile.TemporaryDirectory(prefix="vl-drift-bench-") as tmp:
        os.environ["VISIONLOOP_HOME"] = str(Path(tmp) / "home")
        settings, _, nines_dir = build_model(Path(tmp), args.epochs)
        t_model = time.perf_counter() - STARTED
        served = Served.load(settings)
        pngs, labels = heldout_images(settings)
        banks = build_banks(served, pngs, labels, nines_dir, args.severities, args.seed)
        t_banks = time.perf_counter() - STARTED
        pool = len(banks["clean"].correct)
        print(
            f"model: {MODEL} (classes {', '.join(served.card.class_names)}), trained and exported in "
            f"{t_model:.0f} s; held-out pool {pool} images, accuracy {banks['clean'].correct.mean():.4f}; "
            f"{len(banks['unseen'].correct)} unseen 9s; images scored in {t_banks - t_model:.0f} s",
            flush=True,
        )
        accuracy = {k: float(b.correct.mean()) for k, b in banks.items()}
        independent = run_independent(served, banks, args)
        rounding = rounding_check(served, banks, pngs, labels, args)
        correlated = run_correlated(served, banks, args)
    wall, cpu = time.perf_counter() - STARTED, time.process_time() - cpu0

    keys = (
        ["none"]
        + [f"{s}/{v}" for s in SHIFTS for v in args.severities]
        + [f"unseen/{f:g}" for f in UNSEEN_FRACTIONS]
    )
    print_rates(f"False alarms (none) and detection power, alpha = {ALPHA}", independent, keys, args.windows)
    null = [f"none@{m}" for m in args.windows]
    pooled = sum(independent[k]["drift"] for k in null), sum(independent[k]["trials"] for k in null)
    low, high = wilson(*pooled)
    print(
        f"null, all window sizes: {pooled[0]}/{pooled[1]} = {pooled[0] / pooled[1]:.1%} "
        f"[{low:.1%}, {high:.1%}]"
    )
    print_tests(independent, null + [f"{k}@{min(args.windows)}" for k in keys[1:]])
    print_accuracy(independent, keys, 200 if 200 in args.windows else max(args.windows))
    print_correlated(correlated, args.correlated_windows)
    print_rounding(rounding)
    info = machine()
    print(f"\nmachine: {info['cpu']}, {info['cores']} cores; load average {os.getloadavg()}")
    print(f"seeds: base {args.seed}; wall {wall:.0f} s, CPU {cpu:.0f} s")
    path = write_result(
        args.name,
        {
            "config": {
                "alpha": ALPHA,
                "reference_images": args.reference,
                "pool_images": pool,
                "windows": args.windows,
                "trials": args.trials,
                "null_trials": args.null_trials,
                "correlated_trials": args.correlated_trials,
                "correlated_null_trials": args.correlated_null_trials,
                "rounding_window": args.rounding_window,
                "rounding_temperatures": args.rounding_temperatures,
                "correlated_windows": args.correlated_windows,
                "run_length": args.run_length,
                "epochs": args.epochs,
                "seed": args.seed,
                "shifts": list(SHIFTS),
                "severities": args.severities,
                "unseen_fractions": list(UNSEEN_FRACTIONS),
            },
            "accuracy_per_bank": accuracy,
            "independent": independent,
            "log_rounding": rounding,
            "correlated": correlated,
            "wall_s": wall,
            "cpu_s": cpu,
            "load_average": list(os.getloadavg()),
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
