"""Hostile and careless input to `eval`, `bench`, `cost report` and `runs list/show`: each is
answered with a short error naming the problem, never a hang, a traceback or a blamed store."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from visionloop.bench.result import BenchError, BenchResult, sweep_settings
from visionloop.core.errors import NotFoundError, SpecError, TrackingError
from visionloop.core.settings import Settings
from visionloop.eval.options import EvalOptions, check_options
from visionloop.track import query, store


def _settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")


def _store_with_no_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "store_exists", lambda settings: True)
    monkeypatch.setattr(store, "client", lambda settings: object())
    monkeypatch.setattr(store, "search_all", lambda client, filter_string, **kw: [])


# --------------------------------------------------------------------------- runs


def test_runs_show_huge_argument_is_refused_short_and_not_blamed_on_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _store_with_no_runs(monkeypatch)
    with pytest.raises(NotFoundError) as info:
        query.find_run(_settings(tmp_path), "a" * 100_000)
    message = str(info.value)
    assert "too long to be a run id, name or directory" in message
    assert "(100,000 characters)" in message and len(message) < 400
    assert "tracking store" not in message


def test_runs_show_control_character_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _store_with_no_runs(monkeypatch)
    with pytest.raises(NotFoundError, match=r"run 'x\\x00y' contains a control character"):
        query.find_run(_settings(tmp_path), "x\x00y")


def test_runs_show_name_too_long_for_the_filesystem_is_just_not_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 300 characters, one path component: Path.exists() raises ENAMETOOLONG, which was reported
    # as a tracking store failure.
    _store_with_no_runs(monkeypatch)
    with pytest.raises(NotFoundError, match="no run matches 'bbbb"):
        query.find_run(_settings(tmp_path), "b" * 300)


def test_runs_list_absurd_limit_is_an_option_error(tmp_path: Path) -> None:
    with pytest.raises(TrackingError, match=r"--limit must be at most 50000, got 1000000000"):
        query.list_runs(_settings(tmp_path), limit=10**9)


@pytest.fixture(autouse=True)
def _wide_console(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without COLUMNS, print_wide prints piped tables 240 wide; with it, at the width of a
    # console an earlier test may have made narrow (names folded mid-word).
    monkeypatch.delenv("COLUMNS", raising=False)


def _summary(**kw: Any) -> query.RunSummary:
    base: dict[str, Any] = {
        "run_id": "0" * 32,
        "name": "[/]run",
        "experiment": "[bold]exp",
        "status": "FINISHED",
        "start_time": None,
        "end_time": None,
        "duration_s": None,
        "last_step": None,
        "val_accuracy": None,
        "dataset_version": "[/]",
        "run_dir": "[red]dir",
    }
    return query.RunSummary(**(base | kw))


def test_runs_list_prints_markup_in_names_as_text(monkeypatch: pytest.MonkeyPatch) -> None:
    from visionloop.cli import runs

    monkeypatch.setattr(query, "list_runs", lambda settings, **kw: [_summary()])
    r = CliRunner().invoke(runs.app, ["list"])
    assert r.exit_code == 0, r.output
    assert "[/]run" in r.output and "[bold]exp" in r.output and "[red]dir" in r.output


def test_runs_show_prints_markup_in_tags_and_params_as_text(monkeypatch: pytest.MonkeyPatch) -> None:
    from visionloop.cli import runs

    detail = query.RunDetail(
        summary=_summary(),
        experiment_id="1",
        artifact_uri="file:///x",
        git_commit=None,
        tags={"[/]tag": "[/]"},
        params={"p": "[bold"},
        metrics=[],
        artifacts=[],
        artifacts_truncated=False,
        ui_command="mlflow ui",
    )
    monkeypatch.setattr(query, "describe_run", lambda settings, ref: detail)
    r = CliRunner().invoke(runs.app, ["show", "x"])
    assert r.exit_code == 0, r.output
    assert "[/]tag" in r.output and "[bold" in r.output


# --------------------------------------------------------------------------- cost


def test_cost_report_prints_markup_in_team_and_job_names_as_text(monkeypatch: pytest.MonkeyPatch) -> None:
    from visionloop.cli import queue_admin

    line = {
        "gpu_hours": 1.0,
        "cost": 2.0,
        "lost_gpu_hours_preemption": 0.0,
        "lost_gpu_hours_interruption": 0.0,
        "spot_gpu_hours": 0.0,
        "spot_saved": 0.0,
    }
    data = {
        "currency": "USD",
        "by_team": {"[/]team": line},
        "by_job": {"7": line},
        "total": line,
        "labelling": [
            {
                "dataset_version": "v" * 20,
                "parent_version": None,
                "team": "[/]lab",
                "images": 3,
                "cost": 1.0,
                "recorded_at": 0.0,
                "dataset_path": "/d",
            },
        ],
        "labelling_total": 1.0,
    }

    @contextmanager
    def fake_client() -> Iterator[Any]:
        yield SimpleNamespace(cost=lambda team, since: data)

    monkeypatch.setattr(queue_admin, "_client", fake_client)
    r = CliRunner().invoke(queue_admin.cost_app, ["report"])
    assert r.exit_code == 0, r.output
    assert "[/]team" in r.output and "[/]lab" in r.output


# --------------------------------------------------------------------------- bench


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"batch_sizes": "1,99999999"},
            "--batch-sizes: 99999999 is not a batch size; use whole numbers from 1 to 4096",
        ),
        ({"batch_sizes": "9" * 4000}, "--batch-sizes: 9999999999999999999999999999999999999999... is not"),
        (
            {"batch_sizes": "x" * 100_000},
            "--batch-sizes: 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...' is not a whole",
        ),
        (
            {"formats": "y" * 100_000},
            "--formats: unknown value(s) 'yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy...'; choose",
        ),
        ({"duration_s": float("nan")}, "--duration must be > 0 and at most 3600 seconds (got nan)"),
        ({"duration_s": float("inf")}, "--duration must be > 0 and at most 3600 seconds (got inf)"),
        ({"warmup": 10**9}, "--warmup must be >= 0 and at most 10000 calls (got 1000000000)"),
        ({"iterations": 10**9}, "--iterations must be >= 1 and at most 100000 (got 1000000000)"),
        ({"threads": 10**9}, "--threads must be >= 1 and at most 1024 (got 1000000000)"),
    ],
)
def test_bench_refuses_absurd_options(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(BenchError) as info:
        sweep_settings(**kw)
    assert str(info.value).startswith(message)
    assert len(str(info.value)) < 200


def _result_json() -> dict[str, Any]:
    return json.loads(
        BenchResult(
            model="m", arch="small_cnn", input_size=(3, 8, 8), settings=sweep_settings()
        ).model_dump_json()
    )


@pytest.mark.timeout(60)  # a guard only: before the fix the read waited for ever on the FIFO
def test_bench_result_load_refuses_a_fifo(tmp_path: Path) -> None:
    path = tmp_path / "bench.json"
    os.mkfifo(path)
    with pytest.raises(BenchError, match=r"bench\.json is a FIFO .*; rerun `visionloop bench`\.$"):
        BenchResult.load(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\xff\xfe{}", "cannot be read as UTF-8 JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "nests too deeply to be read"),
        (b"{", "cannot be read as UTF-8 JSON"),
    ],
)
def test_bench_result_load_refuses_garbage_in_one_line(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bench.json"
    path.write_bytes(content)
    with pytest.raises(BenchError, match=message) as info:
        BenchResult.load(path)
    assert "\n" not in str(info.value)


def test_bench_result_load_names_the_first_schema_problem_in_one_line(tmp_path: Path) -> None:
    doc = _result_json()
    doc["configs"] = [{"format": "pickle"}] * 50
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(BenchError, match=r"is not a benchmark result \(configs\.0\.format: ") as info:
        BenchResult.load(path)
    assert "\n" not in str(info.value)
    assert BenchResult.load(_write(tmp_path / "ok.json", _result_json())).model == "m"


def _write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(json.dumps(doc))
    return path


# --------------------------------------------------------------------------- eval


@pytest.mark.timeout(60)  # a guard only: before the fix reading the spec waited for ever
def test_eval_loss_spec_fifo_falls_back_instead_of_hanging(tmp_path: Path) -> None:
    from visionloop.eval.api import _loss_fn
    from visionloop.registry.layout import SPEC_RESOLVED_FILE
    from visionloop.tasks import get_task

    os.mkfifo(tmp_path / SPEC_RESOLVED_FILE)
    info: Any = SimpleNamespace(dir=tmp_path, card=lambda: SimpleNamespace(arch="small_cnn"))
    assert callable(_loss_fn(get_task("classification"), info))


def test_saved_spec_with_aliases_is_refused(tmp_path: Path) -> None:
    import yaml

    from visionloop.bench.evalset import dataset_from_spec, read_saved_spec

    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )
    (tmp_path / "spec.yaml").write_text(bomb + "data: {dataset: /d}\n")
    with pytest.raises(yaml.YAMLError):
        read_saved_spec(tmp_path / "spec.yaml")
    assert dataset_from_spec(tmp_path) is None


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"seed": -1}, "--seed must be a whole number >= 0, got -1"),
        ({"batch_size": 99_999_999}, "--batch-size must be from 1 to 4096, got 99999999"),
        ({"batch_size": 0}, "--batch-size must be from 1 to 4096, got 0"),
        ({"device": "c" * 100_000}, "unknown device 'ccccccccccccccccccccccccccccccccccccccc...; use"),
    ],
)
def test_eval_refuses_absurd_options(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        check_options(EvalOptions(**kw))
    assert str(info.value).startswith(message)
    assert len(str(info.value)) < 200


def test_eval_loss_without_saved_spec_uses_defaults(tmp_path: Path) -> None:
    # The fallback spec itself failed validation ("give exactly one of epochs or steps").
    from visionloop.eval.api import _loss_fn
    from visionloop.tasks import get_task

    info: Any = SimpleNamespace(dir=tmp_path, card=lambda: SimpleNamespace(arch="small_cnn"))
    assert callable(_loss_fn(get_task("classification"), info))
