"""`visionloop models ...`: register runs, list and show versions, move aliases, roll back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.markup import escape
from rich.table import Table

from visionloop.cli.console import out, print_wide

if TYPE_CHECKING:
    from visionloop.registry import ModelVersionInfo

app = typer.Typer(
    help=(
        "The model registry: register finished runs as model versions, point aliases "
        "(champion, challenger) at them, roll back. Models are referenced as NAME (the champion, "
        "else the newest version), NAME@ALIAS or NAME/VERSION."
    ),
    no_args_is_help=True,
)


def _echo_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, ensure_ascii=False, default=str))


def _version_json(info: ModelVersionInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "version": info.version,
        "dir": str(info.dir),
        "aliases": list(info.aliases),
        "run_id": info.run_id,
        "created_at": info.created_at,
        "tags": info.tags,
    }


def _accuracy(info: ModelVersionInfo) -> str:
    """The version's primary validation metric, named: "accuracy 97.77%", "mAP 64.79%"."""
    from visionloop.tasks import get_task

    try:
        metric = get_task(info.card().task).primary_metric
    except Exception:  # a version without a readable card still lists
        metric = "accuracy"
    value = info.tags.get(f"visionloop.metric.{metric}")
    try:
        return f"{metric} {float(value):.2%}" if value else "-"
    except ValueError:  # a tag edited by hand (the MLflow UI) into something not a number
        return "-"


@app.command("register")
def register_cmd(
    run: str = typer.Argument(
        ..., help="A run directory, a run name under $VISIONLOOP_HOME/runs, or an MLflow run id or name."
    ),
    name: str | None = typer.Option(
        None, "--name", "-n", help="Model name (default: the run folder's name)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Register a finished run's final model as a new version."""
    from visionloop.registry import register

    info = register(run, name=name)
    if as_json:
        _echo_json(_version_json(info))
        return
    out.print(f"registered [bold]{info.name}/{info.version}[/] from {info.lineage().get('run_dir')}")
    out.print(f"  files        {info.dir}")
    out.print(f"  val metric   {_accuracy(info)}")
    out.print(f"  MLflow run   {info.run_id or '-'}")
    out.print(f"  next         visionloop models alias {info.name} {info.version} champion")


@app.command("list")
def list_cmd(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """List registered models."""
    from visionloop.registry import list_models

    models = list_models()
    if as_json:
        _echo_json([m.__dict__ for m in models])
        return
    if not models:
        out.print(
            "no registered models yet. Register a run with `visionloop models register RUN --name NAME`."
        )
        return
    table = Table("name", "versions", "latest", "aliases", "updated")
    for m in models:
        aliases = ", ".join(f"{a} -> v{v}" for a, v in sorted(m.aliases.items())) or "-"
        table.add_row(m.name, str(m.versions), f"v{m.latest}" if m.latest else "-", aliases, m.updated_at)
    print_wide(table)


@app.command("show")
def show_cmd(
    ref: str = typer.Argument(..., help="NAME, NAME@ALIAS or NAME/VERSION."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Show a model's versions and alias history, and one version in detail: card, metrics,
    lineage (run, dataset), exports with their gate results, and evaluations (`visionloop eval`)."""
    from visionloop.registry import alias_history, get_version, list_versions, parse_ref
    from visionloop.registry.evals import EVALS_DIR, list_evals

    parsed = parse_ref(ref)
    info = get_version(parsed)
    versions = list_versions(parsed.name)
    events = alias_history(parsed.name)
    card = info.card()
    lineage = info.lineage()
    exports = info.exports()
    refused = info.exports(refused_reexports=True)
    evals = [_eval_summary(e) for e in list_evals(info.dir)]
    if as_json:
        _echo_json(
            {
                **_version_json(info),
                "card": card.model_dump(mode="json"),
                "lineage": lineage,
                "exports": {k: r.model_dump(mode="json") for k, r in exports.items()},
                "refused_reexports": {k: r.model_dump(mode="json") for k, r in refused.items()},
                "versions": [_version_json(v) for v in versions],
                "alias_history": [e.model_dump() for e in events],
                "evals": evals,
            }
        )
        return
    table = Table("version", "aliases", "created", "val metric", "arch", "dataset", "run", title=parsed.name)
    for v in versions:
        mark = "[bold]" if v.version == info.version else ""
        table.add_row(
            f"{mark}v{v.version}",
            ", ".join(v.aliases) or "-",
            v.created_at,
            _accuracy(v),
            v.tags.get("visionloop.arch", "-"),
            (v.tags.get("visionloop.dataset_version") or "-")[:12],
            (v.run_id or "-")[:12],
        )
    print_wide(table)
    out.print(f"\n[bold]{info.name}/{info.version}[/]  {', '.join(info.aliases) or ''}")
    c, h, w = card.input_size
    out.print(f"  arch           {card.arch} {card.model_kwargs or ''}".rstrip())
    out.print(
        f"  classes        {card.num_classes}: {', '.join(card.class_names[:10])}"
        + (" ..." if card.num_classes > 10 else "")
    )
    out.print(f"  input          {c}x{h}x{w}, mean {list(card.mean)}, std {list(card.std)}")
    metrics = ", ".join(f"{k} {v:.4g}" for k, v in (card.metrics or {}).items() if v is not None)
    out.print(f"  metrics        {metrics or '-'}")
    out.print(f"  run            {lineage.get('run_dir', '-')} (MLflow {info.run_id or '-'})")
    out.print(f"  dataset        {lineage.get('dataset_path', '-')} (version {card.dataset_version or '-'})")
    if card.dataset_lineage:
        chain = " ← ".join(v[:12] for v in card.dataset_lineage)
        out.print(
            f"  data lineage   {(card.dataset_version or '-')[:12]} ← {chain} "
            "(`visionloop data info` shows each step)"
        )
    out.print(f"  weights        sha256 {info.tags.get('visionloop.weights_sha256', '-')}")
    out.print(
        f"  registered     {lineage.get('registered_at', info.created_at)} "
        f"by {lineage.get('registered_by', '-')}"
    )
    out.print(f"  files          {info.dir}")
    if exports:
        table = Table(
            "export",
            "passed",
            "score",
            "fp32",
            "drop (pts)",
            "max |diff|",
            "agreement",
            "size",
            title="exports",
        )
        # A refused re-export sits beside the earlier export that passed and is still served.
        rows = [(key, r, "[green]yes[/]" if r.passed else "[red]no[/]") for key, r in exports.items()]
        rows += [(key, r, f"[red]re-export refused[/] {r.created_at}") for key, r in refused.items()]
        for key, r, passed in rows:
            table.add_row(
                key,
                passed,
                _pct(r.accuracy),
                _pct(r.reference_accuracy),
                _num(r.drop_points, ".2f"),
                _num(r.max_abs_diff, ".3g"),
                _pct(r.top1_agreement),
                _size(r.size_bytes),
            )
        print_wide(table)
    else:
        out.print(f"  exports        none (visionloop export {info.name}/{info.version} --precision fp32)")
    if evals:
        table = Table("when", "data", "images", "metric", "stress mean", "ECE", "temperature", "report")
        table.title = "evaluations"
        for ev in evals:
            ece = _num(ev["ece"], ".4f")
            if ev["ece_after"] is not None:
                # _num: an eval report edited by hand can hold a string here, which `:.4f` raised on.
                ece += f" → {_num(ev['ece_after'], '.4f')}"
            table.add_row(
                str(ev["created_at"]),
                escape(f"{ev['dataset']} [{ev['split']}]"),
                str(ev["images"]),
                f"{ev['metric']} {_num(ev['clean'], '.4f')}",
                _num(ev["stress_mean"], ".4f"),
                ece,
                _num(ev["temperature"], ".3f") + (" (stored)" if ev["stored"] else ""),
                escape(Path(str(ev["path"])).parent.name),
            )
        print_wide(table)
        out.print(f"  evaluations    {escape(str(info.dir / EVALS_DIR))}/<report>/eval.json")
    else:
        out.print(f"  evaluations    none (visionloop eval {info.name}/{info.version} --stress)")
    if events:
        table = Table(
            "when", "who", "action", "alias", "version", "was", "gate", "reason", title="alias history"
        )
        for e in events:
            was = f"v{e.previous}" if e.previous is not None else "-"
            gate = str(e.gate.get("outcome", "-")) if e.gate else "-"
            table.add_row(
                e.at, e.actor, e.action, e.alias, f"v{e.version}", was, gate, escape(e.reason or "-")
            )
        print_wide(table)


def _eval_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """The few figures of an eval report that `models show` lists (the rest is in its file)."""
    c = doc.get("calibration") if isinstance(doc.get("calibration"), dict) else {}
    assert isinstance(c, dict)
    return {
        "created_at": doc.get("created_at"),
        "dataset": doc.get("dataset"),
        "split": doc.get("split"),
        "images": doc.get("images"),
        "metric": doc.get("metric"),
        "clean": doc.get("clean"),
        "stress_mean": doc.get("stress_mean"),
        "ece": c.get("ece"),
        "ece_after": c.get("ece_after"),
        "temperature": c.get("temperature"),
        "stored": bool(c.get("stored")),
        "path": doc.get("path"),
    }


def _pct(value: Any) -> str:
    return _num(value, ".2%")


def _num(value: Any, fmt: str) -> str:
    if not isinstance(value, int | float):
        return "-"
    try:
        return format(value, fmt)
    except OverflowError:  # a 400-digit integer in a hand-edited report has no float format
        return "-"


def _size(value: Any) -> str:
    from visionloop.bench.table import human_bytes  # the units bench prints, for the same files

    return human_bytes(int(value)) if isinstance(value, int | float) else "-"


@app.command("alias")
def alias_cmd(
    name: str = typer.Argument(..., help="Model name."),
    version: int = typer.Argument(..., help="Version number to point the alias at."),
    alias: str = typer.Argument(..., help="Alias: champion, challenger, or any name."),
    actor: str | None = typer.Option(None, "--actor", help="Who is doing this (default: your login)."),
    force: bool = typer.Option(
        False, "--force", help="Move the champion even though the promotion gate refuses (needs --reason)."
    ),
    reason: str | None = typer.Option(
        None, "--reason", help="Why, recorded in the alias history (required with --force)."
    ),
    max_drop: float = typer.Option(
        1.0, "--max-drop", help="Gate: largest drop of the clean metric, in points, against the champion."
    ),
    max_stress_drop: float = typer.Option(
        2.0, "--max-stress-drop", help="Gate: largest drop of the stress mean, in points."
    ),
    max_ece_rise: float = typer.Option(
        0.02, "--max-ece-rise", help="Gate: largest rise of the calibration error (ECE), absolute."
    ),
    require_eval: bool = typer.Option(
        False,
        "--require-eval",
        help="Gate: refuse when the two versions have no evaluations on the same data to compare.",
    ),
) -> None:
    """Point ALIAS at VERSION (recorded in the alias history with who, when and why).

    Moving the champion goes through the promotion gate: it is refused when VERSION is worse than the current champion beyond the margins (clean metric, stress mean, calibration), compared on the newest pair of `visionloop eval` reports of both made on the same data. Without such a pair it is allowed and recorded as not gated (--require-eval refuses it). --force --reason "..." overrides a refusal; the reason and the gate's decision are recorded.
    """  # noqa: E501 (one line per paragraph: Rich keeps the line breaks of a help text)
    from visionloop.eval.gate import GateMargins, decision_lines, promote

    if force and not (reason and reason.strip()):
        raise typer.BadParameter(
            'forcing a promotion needs a reason, recorded in the alias history: --force --reason "..."',
            param_hint="--reason",
        )
    margins = GateMargins(max_drop=max_drop, max_stress_drop=max_stress_drop, max_ece_rise=max_ece_rise)
    done = promote(
        name,
        version,
        alias=alias,
        force_reason=reason if force else None,
        reason=reason,
        margins=margins,
        require_eval=require_eval,
        actor=actor,
    )
    info, decision = done.info, done.decision
    if done.outcome == "ungated":
        out.print(f"gate: {escape(done.note or 'not gated')}")
    elif decision is not None:
        verdict = {"passed": "[green]passed[/]", "forced": "[red]refused[/], forced with a reason"}
        out.print(
            f"gate: v{info.version} against the champion v{done.previous} on "
            f"{escape(decision.where())}: {verdict[done.outcome]}"
        )
        for line in decision_lines(decision):
            out.print(f"  {escape(line)}")
        out.print(f"  reports        {escape(str(decision.candidate_report))}")
        out.print(f"                 {escape(str(decision.champion_report))}")
    elif alias == "champion" and done.note:
        out.print(f"gate: none ({escape(done.note)})")
    if done.reason:
        out.print(f"reason: {escape(done.reason)}")
    out.print(f"{info.name}@{alias} -> v{info.version}")


@app.command("unalias")
def unalias_cmd(
    name: str = typer.Argument(..., help="Model name."),
    alias: str = typer.Argument(..., help="The alias to remove (not champion: move that instead)."),
    actor: str | None = typer.Option(None, "--actor", help="Who is doing this (default: your login)."),
    reason: str | None = typer.Option(None, "--reason", help="Why, recorded in the alias history."),
) -> None:
    """Remove ALIAS from NAME (a challenger whose trial is over, say), recorded in the alias
    history; servers following it drop that version. The champion cannot be removed: promote or
    roll back instead."""
    from visionloop.registry import RegistryError, unset_alias

    removed = unset_alias(name, alias, actor=actor, reason=reason)
    if removed is None:
        raise RegistryError(
            f"{name} has no alias {alias!r}; `visionloop models show {name}` lists its aliases"
        )
    out.print(f"{name}@{alias} removed (it was v{removed})")


@app.command("rollback")
def rollback_cmd(
    name: str = typer.Argument(..., help="Model name."),
    alias: str = typer.Option("champion", "--alias", help="The alias to move back."),
    actor: str | None = typer.Option(None, "--actor", help="Who is doing this (default: your login)."),
) -> None:
    """Move the champion back to the previous champion."""
    from visionloop.registry import aliases, rollback

    before = aliases(name).get(alias)
    info = rollback(name, alias=alias, actor=actor)
    out.print(f"{info.name}@{alias}: v{before} -> v{info.version}")
