"""A registered version's weights are loaded from the bytes that were checked: export, eval,
bench and the loop's warm start read final.safetensors once (bounded), hash those bytes
against the sha256 recorded at registration and load (or copy) them, never the path again. A
file swapped right after the check is not what gets loaded; a replaced file is refused with
the sha256 message; bytes and path load the same model.

No training: the run folder is written by hand, with real small_cnn weights."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import torch

from _fakerun import fake_card, fake_run, store_settings
from visionloop import registry
from visionloop.bench.result import sweep_settings
from visionloop.bench.sweep import _make_runner
from visionloop.bench.target import target_from_version
from visionloop.core.fsutil import read_capped
from visionloop.core.settings import Settings
from visionloop.models import ModelCard, create_model, save_weights
from visionloop.models.weights import MAX_WEIGHTS_BYTES, WeightsError, load_weights
from visionloop.registry import api as registry_api
from visionloop.tasks import Task, get_task


@pytest.fixture
def settings(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> Settings:
    return store_settings(tmp_path_factory, tmp_path / "home")


def _card(classes: list[str] | None = None) -> ModelCard:
    """`fake_card` (small_cnn at 16 px), for `classes` if given (default: a, b)."""
    card = fake_card()
    if classes is None:
        return card
    doc = {**card.model_dump(), "num_classes": len(classes), "class_names": classes}
    return ModelCard.model_validate(doc)


def _weights(tmp_path: Path, seed: int, card: ModelCard) -> bytes:
    """The safetensors of a fresh model for `card`, initialised from `seed`."""
    torch.manual_seed(seed)
    model = create_model(card.arch, card.num_classes)
    return save_weights(model, tmp_path / f"w{seed}.safetensors").read_bytes()


def _state(weights: Path | bytes, card: ModelCard | None = None) -> dict[str, torch.Tensor]:
    return get_task("classification").load_model(card or _card(), weights).state_dict()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _registered(
    settings: Settings, tmp_path: Path, card: ModelCard | None = None
) -> tuple[registry.ModelVersionInfo, bytes, bytes]:
    """Version m/1 of `card` (default `_card()`) registered with weights A (seed 0), and
    weights B (seed 1), the same shapes."""
    card = card or _card()
    a, b = _weights(tmp_path, 0, card), _weights(tmp_path, 1, card)
    run = fake_run(tmp_path)
    card.save(run / "model_card.json")
    (run / "final.safetensors").write_bytes(a)
    return registry.register(run, name="m", settings=settings), a, b


def _swap_right_after_the_check(
    monkeypatch: pytest.MonkeyPatch, info: registry.ModelVersionInfo, other: bytes
) -> list[Path]:
    """The weights file is replaced by `other` (a rename, as a copy tool would) right after
    `verified_weights_bytes` read it to check it: whatever opens the path afterwards gets
    `other`. Returns the paths swapped, to show the swap happened."""
    real = read_capped  # the function registry.api calls, under that name
    swapped: list[Path] = []

    def read_then_swap(path: str | os.PathLike[str], limit: int, *, what: str) -> bytes:
        data = real(path, limit, what=what)
        if Path(path) == info.weights:
            tmp = info.weights.with_name(".swap")
            tmp.write_bytes(other)
            tmp.replace(info.weights)
            swapped.append(Path(path))
        return data

    monkeypatch.setattr(registry_api, "read_capped", read_then_swap)
    return swapped


# --------------------------------------------------------------------------- bytes load as paths do


def test_the_registered_weights_load_from_bytes_as_from_the_path(settings: Settings, tmp_path: Path) -> None:
    info, a, b = _registered(settings, tmp_path)
    data = info.verified_weights_bytes()
    assert data == a
    from_bytes, from_path = _state(data), _state(info.weights)
    assert _same(from_bytes, from_path)
    assert _same(from_bytes, load_weights(info.weights))
    assert not _same(from_bytes, _state(b))  # the two seeds do give other weights
    # The detection task takes the bytes too (build_detector).
    det = get_task("detection")
    torch.manual_seed(0)
    model = det.build_model("native_detector", ["a"], kwargs={}, image_size=32)
    path = save_weights(model, tmp_path / "det.safetensors")
    kw: dict[str, Any] = {"kwargs": {}, "image_size": 32}
    det_bytes = det.build_model("native_detector", ["a"], pretrained=path.read_bytes(), **kw).state_dict()
    det_path = det.build_model("native_detector", ["a"], pretrained=path, **kw).state_dict()
    assert _same(det_bytes, det_path) and _same(det_bytes, model.state_dict())


def test_bytes_that_are_not_weights_say_so_without_printing_them() -> None:
    with pytest.raises(WeightsError) as e:
        _state(b"not really weights")
    assert str(e.value).startswith(
        "the safetensors weights given as bytes (18 bytes) is not a readable safetensors file"
    )


def test_a_replaced_file_is_refused_with_the_sha_message(settings: Settings, tmp_path: Path) -> None:
    info, _a, b = _registered(settings, tmp_path)
    info.weights.write_bytes(b)  # valid weights of the same model, another run's
    with pytest.raises(registry.RegistryError) as e:
        info.verified_weights_bytes()
    message = str(e.value)
    assert message.startswith(f"{info.weights} is not the file registered as m/1 (sha256 ")
    assert "it was changed or replaced after registration" in message
    assert "visionloop models register RUN --name m" in message


# --------------------------------------------------------------------------- swapped after the check


def test_weights_swapped_after_the_check_are_not_what_bench_loads(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info, a, b = _registered(settings, tmp_path)
    swapped = _swap_right_after_the_check(monkeypatch, info, b)
    runner, _ = _make_runner(target_from_version(info), "pytorch", "fp32", "cpu", sweep_settings())
    assert swapped == [info.weights] and info.weights.read_bytes() == b
    loaded = cast(Any, runner).model.state_dict()
    assert _same(loaded, _state(a))  # the weights checked, not the swapped-in file


@pytest.mark.parametrize("consumer", ["export", "eval"])
def test_weights_swapped_after_the_check_are_not_what_export_or_eval_loads(
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    digits_dataset: Path,
    consumer: str,
) -> None:
    # Export and eval go on to read the dataset and run the model; the test stops them at
    # the load, once it has seen what was loaded.
    from visionloop.data.manifest import read_manifest

    card = _card(list(read_manifest(digits_dataset).classes))
    info, a, b = _registered(settings, tmp_path, card)
    expected = _state(a, card)
    swapped = _swap_right_after_the_check(monkeypatch, info, b)
    loaded: list[dict[str, torch.Tensor]] = []

    class StopAtLoadError(Exception):
        pass

    real = Task.load_model

    def load_then_stop(self: Task, card: Any, weights: Path | bytes | None) -> torch.nn.Module:
        loaded.append(real(self, card, weights).state_dict())
        raise StopAtLoadError

    monkeypatch.setattr(Task, "load_model", load_then_stop)
    with pytest.raises(StopAtLoadError):
        if consumer == "export":
            from visionloop.export import export_model

            export_model(info, dataset=digits_dataset, settings=settings)
        else:
            from visionloop.eval.api import evaluate_model
            from visionloop.eval.options import EvalOptions

            evaluate_model(info, EvalOptions(dataset=digits_dataset, track=False), settings=settings)
    assert swapped == [info.weights] and info.weights.read_bytes() == b
    assert len(loaded) == 1 and _same(loaded[0], expected)


def test_the_loop_warm_starts_from_the_checked_bytes(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from visionloop.loop.spec import LoopSpec
    from visionloop.loop.steps import RoundSteps

    info, a, b = _registered(settings, tmp_path)
    registry.set_alias("m", info.version, registry.CHAMPION, settings=settings)
    spec = LoopSpec.model_validate(
        {
            "name": "l",
            "model": "m",
            "dataset": str(tmp_path / "ds"),
            "labels": str(tmp_path / "labels"),
            "trigger": {"new_labels": 1},
            "train": {"data": {"dataset": str(tmp_path / "ds")}, "model": {"arch": "small_cnn"}, "epochs": 1},
        }
    )
    rnd = SimpleNamespace(number=1, steps={"dataset": SimpleNamespace(outputs={"dataset": str(tmp_path)})})
    swapped = _swap_right_after_the_check(monkeypatch, info, b)
    job = RoundSteps(spec, settings, cast(Any, None), cast(Any, rnd), cast(Any, None))._job()
    assert swapped == [info.weights] and info.weights.read_bytes() == b
    placed = Path(job["train"]["model"]["pretrained"])
    assert placed.read_bytes() == a
    # Its own file, not a link to the registered one: a later change to that is not the round's.
    assert not placed.samefile(info.weights)


def test_the_weights_read_is_bounded(
    settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    info, _a, _b = _registered(settings, tmp_path)
    assert MAX_WEIGHTS_BYTES == 16 * 2**30
    monkeypatch.setattr("visionloop.models.weights.MAX_WEIGHTS_BYTES", 100)
    with pytest.raises(registry.RegistryError, match=r"m/1's weights cannot be read: .* is larger than 100"):
        info.verified_weights_bytes()
