"""The promotion gate: a version becomes the champion only if it is not worse than the current
champion beyond set margins, on evaluations of both made on the same data.

`compare` is the pure decision over two versions' eval reports (as `registry.evals.list_evals`
reads them back); `promote` moves the alias through it and records the decision in the alias
history. What it compares, from the newest pair of reports made on the same data (the same
dataset version, split, number of images and seed):

- the clean primary metric: refused when it drops more than `max_drop` points (direction from
  the report's `mode`);
- the stress mean: refused when it drops more than `max_stress_drop` points; compared only when
  both reports scored the same (corruption, severity) cells;
- calibration: refused when the ECE rises more than `max_ece_rise`; the ECE after temperature
  scaling when both reports stored their temperature (what the server applies), else the raw
  ECE of both.

Policy where the gate cannot decide:
- no champion yet, the target already the champion, or an alias other than the champion: no
  gate (the move is recorded as usual);
- no pair of reports on the same data: the promotion is allowed and recorded as `ungated`, with
  the `visionloop eval` commands that would gate it; `require_eval=True` refuses it instead.
A refusal can be overridden only with a reason (`force_reason`), recorded with the decision.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from visionloop.core.errors import SpecError, VisionloopError
from visionloop.core.settings import Settings, load_settings
from visionloop.registry import CHAMPION, ModelRef, ModelVersionInfo, aliases, get_version, set_alias
from visionloop.registry.evals import list_evals
from visionloop.registry.layout import check_name, version_dir

DEFAULT_MAX_DROP = 1.0  # points of the clean primary metric
DEFAULT_MAX_STRESS_DROP = 2.0  # points of the stress mean
DEFAULT_MAX_ECE_RISE = 0.02  # absolute expected calibration error
# Values are read back from JSON: a drop of exactly the margin must not fail by rounding.
_EPS = 1e-9

Outcome = Literal["passed", "refused", "ungated"]


class PromotionGateError(VisionloopError):
    """The promotion gate refused to move the champion; `decision` says why."""

    exit_code = 3

    def __init__(self, message: str, decision: GateDecision) -> None:
        super().__init__(message)
        self.decision = decision


@dataclass(frozen=True)
class GateMargins:
    """How much worse than the champion a candidate may be and still be promoted."""

    max_drop: float = DEFAULT_MAX_DROP
    max_stress_drop: float = DEFAULT_MAX_STRESS_DROP
    max_ece_rise: float = DEFAULT_MAX_ECE_RISE

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                option = "--" + name.replace("_", "-")
                raise SpecError(
                    f"{option} must be a number of at least 0, got {value!r} (e.g. {option} "
                    f"{getattr(GateMargins, name)})."
                )

    def to_dict(self) -> dict[str, float]:
        return {k: float(v) for k, v in asdict(self).items()}


@dataclass(frozen=True)
class Criterion:
    """One comparison: the candidate's and the champion's value, how much worse the candidate
    is (negative: better) and the margin that allows."""

    name: Literal["clean", "stress", "calibration"]
    label: str  # what was compared: "accuracy", "stress mean accuracy", "ECE"
    candidate: float
    champion: float
    worse_by: float  # points of the metric for clean and stress, absolute ECE for calibration
    margin: float
    unit: str  # "points" or ""
    passed: bool

    def describe(self) -> str:
        """e.g. "accuracy 0.8747 against the champion's 0.9805: 10.58 points worse (margin 1.00 points)"."""
        if self.unit:
            amount, margin = f"{abs(self.worse_by):.2f} {self.unit}", f"{self.margin:.2f} {self.unit}"
            side = "worse" if self.worse_by > 0 else "better"
        else:
            amount, margin = f"{abs(self.worse_by):.4f}", f"{self.margin:.4f}"
            side = "higher" if self.worse_by > 0 else "lower"
        change = "equal" if self.worse_by == 0 else f"{amount} {side}"
        return (
            f"{self.label} {self.candidate:.4f} against the champion's {self.champion:.4f}: "
            f"{change} (margin {margin})"
        )


@dataclass(frozen=True)
class GateDecision:
    """What `compare` found. `ungated`: no pair of reports on the same data (see `note`)."""

    outcome: Outcome
    margins: GateMargins
    criteria: tuple[Criterion, ...] = ()
    skipped: tuple[str, ...] = ()  # criteria not compared, and why
    candidate_report: str | None = None
    champion_report: str | None = None
    data: dict[str, Any] | None = None  # what both were evaluated on
    note: str | None = None

    @property
    def failures(self) -> tuple[Criterion, ...]:
        return tuple(c for c in self.criteria if not c.passed)

    def where(self) -> str:
        """The data both were evaluated on, in words."""
        d = self.data or {}
        return (
            f"the {d.get('split')} split of dataset {str(d.get('dataset_version'))[:12]}, "
            f"{d.get('images')} images, seed {d.get('seed')}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "decision": self.outcome,
            "margins": self.margins.to_dict(),
            "data": self.data,
            "criteria": [asdict(c) for c in self.criteria],
            "skipped": list(self.skipped),
            "candidate_report": self.candidate_report,
            "champion_report": self.champion_report,
            "note": self.note,
        }


# --------------------------------------------------------------------------- the comparison


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _usable(doc: dict[str, Any]) -> bool:
    """A report with everything the gate pairs and compares on (hand-edited or damaged ones
    are left out)."""
    return (
        isinstance(doc.get("dataset_version"), str)
        and isinstance(doc.get("split"), str)
        and isinstance(doc.get("images"), int)
        and isinstance(doc.get("seed"), int)
        and isinstance(doc.get("metric"), str)
        and doc.get("mode") in ("max", "min")
        and _number(doc.get("clean")) is not None
    )


def _key(doc: dict[str, Any]) -> tuple[Any, ...]:
    """The same data: the same images (dataset version, split, the same count spread the same
    way over it), corrupted and halved for calibration by the same seed; the same metric."""
    return (doc["dataset_version"], doc["split"], doc["images"], doc["seed"], doc["metric"], doc["mode"])


def _cells(doc: dict[str, Any]) -> frozenset[tuple[str, int]]:
    stress = doc.get("stress")
    cells: set[tuple[str, int]] = set()
    for c in stress if isinstance(stress, list) else []:
        if (
            isinstance(c, dict)
            and isinstance(c.get("corruption"), str)
            and isinstance(c.get("severity"), int)
        ):
            cells.add((c["corruption"], c["severity"]))
    return frozenset(cells)


def _stress_comparable(cand: dict[str, Any], champ: dict[str, Any]) -> bool:
    return (
        bool(_cells(cand))
        and _cells(cand) == _cells(champ)
        and _number(cand.get("stress_mean")) is not None
        and _number(champ.get("stress_mean")) is not None
    )


def _describe_data(doc: dict[str, Any]) -> str:
    return (
        f"{doc['split']}, {doc['images']} images, seed {doc['seed']}, "
        f"dataset {str(doc['dataset_version'])[:12]}"
    )


def _inventory(docs: list[dict[str, Any]]) -> str:
    """What evaluations a version has, by the data they were made on."""
    if not docs:
        return "no evaluations"
    seen: list[str] = []
    for d in reversed(docs):  # newest first
        text = _describe_data(d)
        if text not in seen:
            seen.append(text)
    shown = "; ".join(seen[:3]) + (f"; and {len(seen) - 3} more" if len(seen) > 3 else "")
    return f"{len(docs)} evaluation{'s' if len(docs) != 1 else ''} ({shown})"


def _points(candidate: float, champion: float, mode: str) -> float:
    """How many points worse the candidate is (negative: better)."""
    return (champion - candidate) * 100 if mode == "max" else (candidate - champion) * 100


def _calibration(cand: dict[str, Any], champ: dict[str, Any], margin: float) -> Criterion | str:
    a, b = cand.get("calibration"), champ.get("calibration")
    if not isinstance(a, dict) or not isinstance(b, dict):
        missing = [who for who, c in (("candidate", a), ("champion", b)) if not isinstance(c, dict)]
        return f"calibration: not compared: no calibration in the {' and '.join(missing)}'s report"
    after = _number(a.get("ece_after")), _number(b.get("ece_after"))
    if after[0] is not None and after[1] is not None and a.get("stored") is True and b.get("stored") is True:
        # Both serve with the temperature they stored: compare what the server's answers carry.
        label, values = "ECE after temperature scaling", (after[0], after[1])
    else:
        raw = _number(a.get("ece")), _number(b.get("ece"))
        if raw[0] is None or raw[1] is None:
            return "calibration: not compared: a report has no ECE"
        label, values = "ECE", (raw[0], raw[1])
    rise = values[0] - values[1]
    return Criterion("calibration", label, values[0], values[1], rise, margin, "", rise <= margin + _EPS)


def _stress_skipped(
    cand: dict[str, Any],
    champ: dict[str, Any],
    cand_all: list[dict[str, Any]],
    champ_all: list[dict[str, Any]],
) -> str:
    a, b = _cells(cand), _cells(champ)
    if not a and not b:
        why = "neither report scored corruptions (visionloop eval --stress)"
    elif not a or not b:
        who = "candidate" if a else "champion"
        why = f"only the {who}'s report scored corruptions (visionloop eval --stress)"
    elif a != b:
        why = (
            f"the reports scored different corruption cells ({len(a)} and {len(b)} "
            "corruption x severity cells, not the same set)"
        )
    else:
        why = "a report has no stress mean"
    # Stress tests of either version on other data cannot stand in for the pair's.
    for who, doc, docs in (("candidate", cand, cand_all), ("champion", champ, champ_all)):
        elsewhere = [d for d in docs if _cells(d) and d is not doc]
        if not _cells(doc) and elsewhere:
            why += f"; the {who}'s stress evaluation is on other data ({_describe_data(elsewhere[-1])})"
    return f"stress mean: not compared: {why}"


def compare(
    candidate_evals: Sequence[dict[str, Any]],
    champion_evals: Sequence[dict[str, Any]],
    margins: GateMargins | None = None,
) -> GateDecision:
    """Compare a candidate with the champion on the newest pair of their eval reports made on
    the same data (preferring a pair that also scored the same corruption cells)."""
    margins = margins or GateMargins()
    cand = [d for d in candidate_evals if _usable(d)]
    champ = [d for d in champion_evals if _usable(d)]
    pairs = [(i, j) for i, c in enumerate(cand) for j, h in enumerate(champ) if _key(c) == _key(h)]
    if not pairs:
        return GateDecision(
            outcome="ungated",
            margins=margins,
            note=(
                "no pair of evaluations on the same data (the same dataset version, split, number "
                f"of images and seed): the candidate has {_inventory(cand)}; the champion has "
                f"{_inventory(champ)}"
            ),
        )

    def rank(p: tuple[int, int]) -> tuple[bool, str, str, int]:
        c, h = cand[p[0]], champ[p[1]]
        times = sorted((str(c.get("created_at") or ""), str(h.get("created_at") or "")))
        # A pair that can compare robustness too, then the pair whose older report is newest.
        return (_stress_comparable(c, h), times[0], times[1], p[0] + p[1])

    i, j = max(pairs, key=rank)
    c, h = cand[i], champ[j]
    mode = str(c["mode"])
    criteria: list[Criterion] = []
    skipped: list[str] = []
    drop = _points(float(c["clean"]), float(h["clean"]), mode)
    criteria.append(
        Criterion(
            "clean", str(c["metric"]), float(c["clean"]), float(h["clean"]), drop,
            margins.max_drop, "points", drop <= margins.max_drop + _EPS,
        )
    )  # fmt: skip
    if _stress_comparable(c, h):
        sc, sh = float(c["stress_mean"]), float(h["stress_mean"])
        drop = _points(sc, sh, mode)
        criteria.append(
            Criterion(
                "stress", f"stress mean {c['metric']}", sc, sh, drop,
                margins.max_stress_drop, "points", drop <= margins.max_stress_drop + _EPS,
            )
        )  # fmt: skip
    else:
        skipped.append(_stress_skipped(c, h, cand, champ))
    ece = _calibration(c, h, margins.max_ece_rise)
    if isinstance(ece, Criterion):
        criteria.append(ece)
    else:
        skipped.append(ece)
    return GateDecision(
        outcome="passed" if all(x.passed for x in criteria) else "refused",
        margins=margins,
        criteria=tuple(criteria),
        skipped=tuple(skipped),
        candidate_report=str(c.get("path") or "") or None,
        champion_report=str(h.get("path") or "") or None,
        data={k: c[k] for k in ("dataset_version", "split", "images", "seed", "metric")}
        | {"dataset": c.get("dataset")},
    )


# --------------------------------------------------------------------------- promotion


@dataclass(frozen=True)
class Promotion:
    """What `promote` did: the alias moved to `info`, from `previous`.

    `outcome`: "passed", "forced" (refused by the gate, moved with a reason), "ungated" (no
    comparable evaluations; `note` says what to run) or "no gate" (no champion yet, already the
    champion, or not the champion alias; `note` says which).
    """

    info: ModelVersionInfo
    alias: str
    previous: int | None
    outcome: Literal["passed", "forced", "ungated", "no gate"]
    decision: GateDecision | None = None
    reason: str | None = None
    note: str | None = None
    record: dict[str, Any] | None = field(default=None, repr=False)  # as written to the history


def _eval_command(ref: str, like: dict[str, Any] | None) -> str:
    """The `visionloop eval` command that evaluates `ref` on the data of the report `like`
    (or on the model's own validation split)."""
    words = ["visionloop", "eval", ref]
    if like is not None:
        if like.get("dataset"):
            words += ["--dataset", str(like["dataset"])]
        words += ["--split", str(like["split"]), "--max-images", str(like["images"])]
        words += ["--seed", str(like["seed"])]
        cells = _cells(like)
        corruptions = sorted({c for c, _ in cells})
        severities = sorted({s for _, s in cells})
        # A full grid is what one --stress run makes; anything else cannot be asked for at once.
        if cells and len(cells) == len(corruptions) * len(severities):
            words += ["--stress", "--corruptions", ",".join(corruptions)]
            words += ["--severities", ",".join(str(s) for s in severities)]
    return shlex.join(words)


def _to_run(name: str, version: int, champion: int, champion_evals: list[dict[str, Any]]) -> str:
    usable = [d for d in champion_evals if _usable(d)]
    if usable:
        return (
            f"evaluate v{version} on the champion's newest evaluation data: "
            f"`{_eval_command(f'{name}/{version}', usable[-1])}`"
        )
    return (
        f"evaluate both on the same data: `visionloop eval {name}/{version} --stress` and "
        f"`visionloop eval {name}/{champion} --stress` (the same --dataset, --split, --max-images "
        "and --seed for both)"
    )


def _force_hint(name: str, version: int, alias: str) -> str:
    return (
        f'`visionloop models alias {name} {version} {alias} --force --reason "..."` (the reason is '
        "recorded in the alias history)"
    )


def refusal_message(
    name: str, version: int, champion: int, decision: GateDecision, alias: str = CHAMPION
) -> str:
    """The error a refused promotion prints: every failing criterion with both values and its
    margin, the two reports, and how to force it."""
    lines = [
        f"{name}/{version} may not become {name}@{alias}: it is worse than the champion "
        f"{name}/{champion} beyond the promotion gate's margins, on {decision.where()}:"
    ]
    lines += [f"  - {c.describe()}" for c in decision.failures]
    lines.append(
        f"Compared {decision.candidate_report} (v{version}) with {decision.champion_report} (v{champion})."
    )
    lines.append(
        f"To promote it anyway, say why: {_force_hint(name, version, alias)}; or set the margins "
        "with --max-drop, --max-stress-drop, --max-ece-rise."
    )
    return "\n".join(lines)


def decision_lines(decision: GateDecision) -> list[str]:
    """One line per criterion (compared or not), for a terminal."""
    lines = [f"{'ok  ' if c.passed else 'FAIL'}  {c.describe()}" for c in decision.criteria]
    lines += [f"-     {s}" for s in decision.skipped]
    return lines


def decide(target: ModelVersionInfo, champion: int, margins: GateMargins, settings: Settings) -> GateDecision:
    """The gate's decision on `target` against version `champion` of the same model, from the
    newest pair of evaluations of both on the same data (what `promote` checks before it moves
    the champion)."""
    champion_evals = list_evals(version_dir(settings.home, target.name, champion))
    return compare(list_evals(target.dir), champion_evals, margins)


def promote(
    name: str,
    version: int,
    *,
    alias: str = CHAMPION,
    force_reason: str | None = None,
    reason: str | None = None,
    margins: GateMargins | None = None,
    require_eval: bool = False,
    actor: str | None = None,
    settings: Settings | None = None,
) -> Promotion:
    """Point `alias` at `version` of `name`, through the promotion gate when `alias` is the
    champion: refused (PromotionGateError) when the candidate is worse than the current
    champion beyond `margins`, or, with `require_eval`, when no pair of evaluations on the same
    data exists; `force_reason` overrides a refusal and is recorded. `reason` is recorded
    without overriding anything. The decision goes to the alias history with the move."""
    settings = settings or load_settings()
    margins = margins or GateMargins()
    name = check_name(name)
    if force_reason is not None:
        force_reason = force_reason.strip()
        if not force_reason:
            raise SpecError(
                'forcing a promotion needs a reason, recorded in the alias history: --force --reason "..."'
            )
    why = force_reason or (reason.strip() if reason and reason.strip() else None)
    target = get_version(ModelRef(name, version=version), settings)  # a clear error if there is none
    current = aliases(name, settings).get(alias)

    def move(gate: dict[str, Any] | None) -> ModelVersionInfo:
        return set_alias(
            name, version, alias, actor=actor, settings=settings, reason=why, gate=gate,
            expected_previous=current,
        )  # fmt: skip

    if alias != CHAMPION or current is None or current == version:
        why_not = (
            f"the promotion gate guards {CHAMPION} only"
            if alias != CHAMPION
            else f"{name} has no {alias} yet: nothing to compare with"
            if current is None
            else f"v{version} is already the {alias}"
        )
        return Promotion(move(None), alias, current, "no gate", None, why, why_not)

    decision = decide(target, current, margins, settings)
    forced = force_reason is not None
    outcome: Literal["passed", "forced", "ungated"]
    note: str | None = None
    if decision.outcome == "refused":
        if not forced:
            raise PromotionGateError(refusal_message(name, version, current, decision, alias), decision)
        outcome = "forced"
    elif decision.outcome == "ungated":
        to_run = _to_run(name, version, current, list_evals(version_dir(settings.home, name, current)))
        if require_eval and not forced:
            raise PromotionGateError(
                f"{name}/{version} may not become {name}@{alias} without a comparison with the "
                f"champion {name}/{current} (--require-eval): {decision.note}.\nTo gate it, "
                f"{to_run}; then run this again. To promote it anyway, say why: "
                f"{_force_hint(name, version, alias)}.",
                decision,
            )
        outcome = "forced" if require_eval else "ungated"
        note = f"not gated: {decision.note}. To gate it, {to_run}"
    else:
        outcome = "passed"
    record = {"outcome": outcome, "champion": current, "require_eval": require_eval, **decision.to_dict()}
    info = move(record)
    return Promotion(info, alias, current, outcome, decision, why, note, record)
