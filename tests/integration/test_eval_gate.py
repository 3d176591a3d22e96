"""The promotion gate on a really trained model: versions that are measurably worse (damaged
weights), only worse calibrated (logits scaled down: the same predictions, less confident) or
the same, evaluated by `visionloop eval`, promoted through the library and the CLI."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from _modelkit import ModelKit, registered_model  # noqa: F401  (session fixture)
from _trainkit import cli
from visionloop import registry
from visionloop.eval.api import evaluate_model
from visionloop.eval.gate import GateMargins, PromotionGateError, promote
from visionloop.eval.options import EvalOptions
from visionloop.registry.evals import list_evals

STRESS = EvalOptions(
    stress=True, corruptions=("gaussian_noise", "pixelate"), severities=(1, 5), max_images=120, seed=3
)


@dataclass(frozen=True)
class Versions:
    kit: ModelKit
    damaged: int  # noise on every weight: worse clean, worse under stress
    underconfident: int  # logits x 0.25: the same predictions, worse calibrated
    same: int  # the champion's run registered again


def _register_changed(kit: ModelKit, root: Path, label: str, change: Any) -> int:
    """Register a copy of the champion's run whose final weights `change` altered (the
    registry hashes the copy's weights, so the version is consistent with its files)."""
    from safetensors.torch import load_file, save_file

    run = root / f"digits-{label}"
    shutil.copytree(kit.run_dir, run, ignore=shutil.ignore_patterns(".lock", "checkpoints"))
    weights = load_file(run / "final.safetensors")
    save_file(change(weights), run / "final.safetensors")
    return registry.register(run, name=kit.name, settings=kit.settings).version


def _noise(weights: dict[str, Any]) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    out = {}
    for k, w in weights.items():
        if w.is_floating_point() and w.dim() > 1:  # conv and linear weights, not norms' stats
            w = w + 0.6 * w.std() * torch.randn(w.shape, generator=g)
        out[k] = w.contiguous()
    return out


def _soften(weights: dict[str, Any]) -> dict[str, Any]:
    return {k: (w * 0.25 if k.startswith("fc.") else w).contiguous() for k, w in weights.items()}


@pytest.fixture(scope="module")
def base(registered_model: ModelKit, tmp_path_factory: pytest.TempPathFactory) -> Versions:  # noqa: F811
    root = tmp_path_factory.mktemp("gate")
    kit = registered_model.copy_home(root / "home")
    damaged = _register_changed(kit, root, "damaged", _noise)
    underconfident = _register_changed(kit, root, "soft", _soften)
    same = registry.register(kit.run_dir, name=kit.name, settings=kit.settings).version
    s = kit.settings
    for v in (kit.version, damaged, same):
        evaluate_model(f"digits/{v}", EvalOptions(), settings=s)
    for v in (kit.version, damaged):
        evaluate_model(f"digits/{v}", STRESS, settings=s)
    # Without a stored temperature its served confidences are the raw ones.
    evaluate_model(f"digits/{underconfident}", EvalOptions(calibrate=False), settings=s)
    return Versions(kit, damaged, underconfident, same)


@pytest.fixture
def v(base: Versions, tmp_path: Path) -> Versions:
    """A private copy of the evaluated versions, to promote freely."""
    return Versions(base.kit.copy_home(tmp_path / "home"), base.damaged, base.underconfident, base.same)


def _newest(kit: ModelKit, version: int, **match: Any) -> dict[str, Any]:
    info = registry.get_version(f"digits/{version}", kit.settings)
    docs = [d for d in list_evals(info.dir) if all(d.get(k) == x for k, x in match.items())]
    return docs[-1]


def _pts(champion: float, candidate: float) -> str:
    return f"{(champion - candidate) * 100:.2f} points"


def test_a_worse_version_is_refused_naming_every_criterion_with_both_values(v: Versions) -> None:
    kit = v.kit
    before = registry.alias_history("digits", kit.settings)
    with pytest.raises(PromotionGateError) as caught:
        promote("digits", v.damaged, actor="carol", settings=kit.settings)
    # The newest pair on the same data that also scored the same corruptions: the stress runs.
    cand, champ = _newest(kit, v.damaged, images=120), _newest(kit, 1, images=120)
    msg = str(caught.value)
    assert caught.value.exit_code == 3
    assert msg.startswith(
        f"digits/{v.damaged} may not become digits@champion: it is worse than the champion digits/1"
    )
    assert f"the val split of dataset {cand['dataset_version'][:12]}, 120 images, seed 3" in msg
    assert (
        f"accuracy {cand['clean']:.4f} against the champion's {champ['clean']:.4f}: "
        f"{_pts(champ['clean'], cand['clean'])} worse (margin 1.00 points)"
    ) in msg
    assert (
        f"stress mean accuracy {cand['stress_mean']:.4f} against the champion's {champ['stress_mean']:.4f}: "
        f"{_pts(champ['stress_mean'], cand['stress_mean'])} worse (margin 2.00 points)"
    ) in msg
    rise = cand["calibration"]["ece_after"] - champ["calibration"]["ece_after"]
    assert (
        f"ECE after temperature scaling {cand['calibration']['ece_after']:.4f} against the champion's "
        f"{champ['calibration']['ece_after']:.4f}: {rise:.4f} higher (margin 0.0200)"
    ) in msg
    assert f"Compared {cand['path']} (v{v.damaged}) with {champ['path']} (v1)." in msg
    assert f'visionloop models alias digits {v.damaged} champion --force --reason "..."' in msg
    decision = caught.value.decision
    assert [c.name for c in decision.failures] == ["clean", "stress", "calibration"]
    assert decision.criteria[0].candidate == cand["clean"] and decision.criteria[0].champion == champ["clean"]
    # Nothing moved, nothing recorded.
    assert registry.aliases("digits", kit.settings) == {"champion": 1}
    assert registry.alias_history("digits", kit.settings) == before

    # Only the stress criterion, when the others are given room.
    with pytest.raises(PromotionGateError) as caught:
        promote(
            "digits", v.damaged, margins=GateMargins(max_drop=50, max_ece_rise=0.5), settings=kit.settings
        )
    assert [c.name for c in caught.value.decision.failures] == ["stress"]
    assert "stress mean accuracy" in str(caught.value) and "  - accuracy" not in str(caught.value)
    # ... and none with room for all three.
    done = promote(
        "digits", v.damaged, margins=GateMargins(50, 50, 0.5), actor="carol", settings=kit.settings
    )
    assert done.outcome == "passed" and done.previous == 1
    assert registry.aliases("digits", kit.settings) == {"champion": v.damaged}
    event = registry.alias_history("digits", kit.settings)[-1]
    assert event.gate is not None and event.gate["margins"] == {
        "max_drop": 50.0,
        "max_stress_drop": 50.0,
        "max_ece_rise": 0.5,
    }


def test_forced_through_the_cli_with_a_reason_that_is_recorded_and_shown(v: Versions) -> None:
    kit, env = v.kit, v.kit.env()
    bad = str(v.damaged)
    r = cli("models", "alias", "digits", bad, "champion", env=env)
    assert r.returncode == 3, r.stderr
    assert "may not become digits@champion" in r.stderr and "points worse (margin 1.00 points)" in r.stderr
    assert "--force --reason" in r.stderr and "Traceback" not in r.stderr

    r = cli("models", "alias", "digits", bad, "champion", "--force", env=env)
    assert r.returncode == 2 and "--reason" in r.stderr and "forcing a promotion needs a reason" in r.stderr
    r = cli("models", "alias", "digits", bad, "champion", "--force", "--reason", "  ", env=env)
    assert r.returncode == 2 and "needs a reason" in r.stderr
    assert registry.aliases("digits", kit.settings) == {"champion": 1}

    reason = "v1 misreads the new scanner's 7s"
    r = cli(
        "models", "alias", "digits", bad, "champion", "--force", "--reason", reason, "--actor", "alice",
        env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    cand, champ = _newest(kit, v.damaged, images=120), _newest(kit, 1, images=120)
    out = r.stdout
    assert f"gate: v{bad} against the champion v1 on the val split" in out
    assert "refused, forced with a reason" in out
    assert f"FAIL  accuracy {cand['clean']:.4f} against the champion's {champ['clean']:.4f}" in out
    assert f"FAIL  stress mean accuracy {cand['stress_mean']:.4f}" in out
    assert cand["path"] in out and champ["path"] in out
    assert f"reason: {reason}" in out and f"digits@champion -> v{bad}" in out
    assert registry.aliases("digits", kit.settings) == {"champion": v.damaged}

    event = registry.alias_history("digits", kit.settings)[-1]
    assert (event.action, event.version, event.previous, event.actor, event.reason) == (
        "set", v.damaged, 1, "alice", reason,
    )  # fmt: skip
    gate = event.gate
    assert gate is not None
    assert (gate["outcome"], gate["decision"], gate["champion"]) == ("forced", "refused", 1)
    assert gate["candidate_report"] == cand["path"] and gate["champion_report"] == champ["path"]
    by_name = {c["name"]: c for c in gate["criteria"]}
    assert by_name["clean"]["candidate"] == cand["clean"] and by_name["clean"]["champion"] == champ["clean"]
    assert by_name["clean"]["worse_by"] == pytest.approx((champ["clean"] - cand["clean"]) * 100)
    assert by_name["stress"]["candidate"] == cand["stress_mean"] and not by_name["stress"]["passed"]
    assert gate["data"]["images"] == 120 and gate["data"]["seed"] == 3
    raw = json.loads((kit.home / "models" / "digits" / "alias_history.json").read_text())
    assert "reason" not in raw[0] and "gate" not in raw[0]  # the modelkit's plain move, as before
    assert raw[-1]["reason"] == reason

    r = cli("models", "show", "digits", env=env)
    assert r.returncode == 0, r.stderr
    assert "reason" in r.stdout and reason in r.stdout and "forced" in r.stdout
    r = cli("models", "show", "digits", "--json", env=env)
    shown = json.loads(r.stdout)["alias_history"]
    assert shown[-1]["reason"] == reason and shown[-1]["gate"]["outcome"] == "forced"
    assert shown[0]["reason"] is None and shown[0]["gate"] is None


def test_an_equal_or_better_version_passes(v: Versions) -> None:
    kit = v.kit
    done = promote("digits", v.same, actor="dan", settings=kit.settings)
    assert done.outcome == "passed" and done.decision is not None
    cand, champ = _newest(kit, v.same), _newest(kit, 1, images=359)
    assert done.decision.candidate_report == cand["path"] and done.decision.champion_report == champ["path"]
    clean, ece = done.decision.criteria
    assert (clean.name, clean.candidate, clean.champion, clean.worse_by) == (
        "clean", champ["clean"], champ["clean"], 0.0,
    )  # fmt: skip
    assert ece.label == "ECE after temperature scaling" and ece.passed
    stressed = _newest(kit, 1, images=120)
    assert done.decision.skipped == (
        "stress mean: not compared: neither report scored corruptions (visionloop eval --stress); "
        f"the champion's stress evaluation is on other data (val, 120 images, seed 3, "
        f"dataset {stressed['dataset_version'][:12]})",
    )
    gate = registry.alias_history("digits", kit.settings)[-1].gate
    assert gate is not None and gate["outcome"] == "passed" and gate["criteria"][0]["worse_by"] == 0.0

    # The damaged version made champion (forced), the original is better on every criterion.
    promote("digits", v.damaged, force_reason="testing the way back", settings=kit.settings)
    done = promote("digits", 1, settings=kit.settings)
    assert done.outcome == "passed" and done.previous == v.damaged and done.decision is not None
    assert [c.name for c in done.decision.criteria] == ["clean", "stress", "calibration"]
    assert all(c.worse_by < 0 and c.passed for c in done.decision.criteria)
    assert "points better" in done.decision.criteria[0].describe()

    # Already the champion, or another alias: no gate.
    assert promote("digits", 1, settings=kit.settings).outcome == "no gate"
    done = promote("digits", v.damaged, alias="challenger", settings=kit.settings)
    assert done.outcome == "no gate" and done.note == "the promotion gate guards champion only"
    assert registry.aliases("digits", kit.settings) == {"champion": 1, "challenger": v.damaged}


def test_calibration_alone_refuses_and_a_stored_temperature_settles_it(v: Versions) -> None:
    kit = v.kit
    # The same predictions (accuracy equal), confidences four times too soft; it stored no
    # temperature, so its raw ECE (what it would serve) is compared with the champion's raw ECE.
    with pytest.raises(PromotionGateError) as caught:
        promote("digits", v.underconfident, settings=kit.settings)
    cand, champ = _newest(kit, v.underconfident), _newest(kit, 1, images=359)
    (failed,) = caught.value.decision.failures
    assert (failed.name, failed.label) == ("calibration", "ECE")
    assert failed.candidate == cand["calibration"]["ece"] and failed.champion == champ["calibration"]["ece"]
    assert failed.candidate > failed.champion + 0.3
    clean = caught.value.decision.criteria[0]
    assert clean.passed and clean.worse_by == 0.0
    assert (
        f"ECE {cand['calibration']['ece']:.4f} against the champion's {champ['calibration']['ece']:.4f}: "
        f"{cand['calibration']['ece'] - champ['calibration']['ece']:.4f} higher (margin 0.0200)"
    ) in str(caught.value)

    # Evaluated again on its own val split, it stores its temperature, which undoes the
    # softening: the newest pair compares ECE after temperature scaling, and it passes.
    evaluate_model(f"digits/{v.underconfident}", EvalOptions(), settings=kit.settings)
    done = promote("digits", v.underconfident, settings=kit.settings)
    assert done.outcome == "passed" and done.decision is not None
    ece = done.decision.criteria[-1]
    assert ece.label == "ECE after temperature scaling"
    assert ece.candidate == pytest.approx(ece.champion, abs=1e-6)


def test_without_evaluations_on_the_same_data_it_is_ungated_unless_required(v: Versions) -> None:
    kit, s = v.kit, v.kit.settings
    fresh = registry.register(kit.run_dir, name="digits", settings=s).version
    # Other data: the train split, and the val split under another seed and image count.
    evaluate_model(f"digits/{fresh}", EvalOptions(split="train", max_images=100), settings=s)
    evaluate_model(f"digits/{fresh}", EvalOptions(seed=1, max_images=200), settings=s)
    with pytest.raises(PromotionGateError) as caught:
        promote("digits", fresh, require_eval=True, settings=s)
    msg = str(caught.value)
    assert caught.value.decision.outcome == "ungated" and caught.value.exit_code == 3
    assert f"digits/{fresh} may not become digits@champion without a comparison" in msg
    assert "--require-eval" in msg and "no pair of evaluations on the same data" in msg
    version = _newest(kit, 1)["dataset_version"][:12]
    assert (
        f"the candidate has 2 evaluations (val, 200 images, seed 1, dataset {version}; "
        f"train, 100 images, seed 0, dataset {version})"
    ) in msg
    assert (
        f"the champion has 2 evaluations (val, 120 images, seed 3, dataset {version}; "
        f"val, 359 images, seed 0, dataset {version})"
    ) in msg
    assert '--force --reason "..."' in msg
    assert registry.aliases("digits", s) == {"champion": 1}

    # Allowed without --require-eval, recorded as not gated, with what to run to gate it.
    done = promote("digits", fresh, settings=s)
    assert done.outcome == "ungated" and done.note is not None
    hint = f"visionloop eval digits/{fresh} --dataset {kit.dataset} --split val --max-images 120 --seed 3"
    assert hint + " --stress --corruptions gaussian_noise,pixelate --severities 1,5`" in done.note
    event = registry.alias_history("digits", s)[-1]
    assert event.gate is not None and event.gate["outcome"] == "ungated" and event.gate["criteria"] == []
    assert "no pair of evaluations" in event.gate["note"]

    # The hint, run as given, makes the pair: moving back and forth is gated from then on.
    promote("digits", 1, force_reason="back", settings=s)
    words = done.note.split("`")[1].split()
    assert words[:2] == ["visionloop", "eval"]
    r = cli(*words[1:], env=kit.env())
    assert r.returncode == 0, r.stderr
    done = promote("digits", fresh, require_eval=True, settings=s)
    assert done.outcome == "passed" and done.decision is not None and done.decision.data is not None
    assert [c.name for c in done.decision.criteria] == ["clean", "stress", "calibration"]
    assert done.decision.data["seed"] == 3 and done.decision.data["images"] == 120


def test_cli_ungated_and_require_eval(v: Versions) -> None:
    kit, env = v.kit, v.kit.env()
    fresh = registry.register(kit.run_dir, name="digits", settings=kit.settings).version
    r = cli("models", "alias", "digits", str(fresh), "champion", "--require-eval", env=env)
    assert r.returncode == 3 and "without a comparison" in r.stderr and "--require-eval" in r.stderr
    r = cli("models", "alias", "digits", str(fresh), "champion", env=env)
    assert r.returncode == 0, r.stderr
    assert "gate: not gated: no pair of evaluations on the same data" in r.stdout
    assert f"visionloop eval digits/{fresh}" in r.stdout and f"digits@champion -> v{fresh}" in r.stdout
    r = cli("models", "alias", "digits", "1", "champion", "--max-drop", "-1", env=env)
    assert r.returncode == 2 and "--max-drop must be a number of at least 0, got -1.0" in r.stderr
    assert registry.aliases("digits", kit.settings) == {"champion": fresh}


def test_a_champion_moved_while_the_gate_decided_is_not_overwritten(v: Versions) -> None:
    kit = v.kit
    # What promote does after deciding against v1: move only if v1 is still the champion.
    registry.set_alias("digits", v.same, "champion", actor="someone else", settings=kit.settings)
    with pytest.raises(registry.RegistryError, match=r"changed while .* \(it was v1, it is now v4\)"):
        registry.set_alias(
            "digits", v.damaged, "champion", expected_previous=1, gate={"outcome": "passed"},
            settings=kit.settings,
        )  # fmt: skip
    assert registry.aliases("digits", kit.settings) == {"champion": v.same}
    assert registry.alias_history("digits", kit.settings)[-1].actor == "someone else"
