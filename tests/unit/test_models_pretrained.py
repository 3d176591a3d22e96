"""Pretrained weights come only from local files, and only tensors are ever unpickled."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from visionloop.models import WeightsError, create_model, load_pretrained, load_weights, save_weights


@pytest.fixture(scope="module")
def imagenet_resnet18() -> dict[str, torch.Tensor]:
    """A 1000-class resnet18 state dict, standing in for downloaded ImageNet weights."""
    torch.manual_seed(0)
    return create_model("resnet18", 1000).state_dict()


def _assert_all_but_head_loaded(model: torch.nn.Module, source: dict[str, torch.Tensor]) -> None:
    target = model.state_dict()
    assert torch.equal(target["conv1.weight"], source["conv1.weight"])
    for key, value in source.items():
        if key.startswith("fc."):
            assert target[key].shape[0] == 10
        else:
            assert torch.equal(target[key], value), key


@pytest.mark.parametrize("fmt", ["safetensors", "pt", "pth-wrapped", "pt-ddp-prefixed"])
def test_a_1000_class_file_loads_into_a_10_class_model_except_the_head(
    fmt: str, imagenet_resnet18: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    if fmt == "safetensors":
        path = save_weights(imagenet_resnet18, tmp_path / "r18.safetensors")
    elif fmt == "pt":
        path = tmp_path / "r18.pt"
        torch.save(imagenet_resnet18, path)
    elif fmt == "pth-wrapped":
        # A training script's checkpoint: weights under "model", beside non-tensor state.
        path = tmp_path / "r18.pth"
        torch.save({"model": imagenet_resnet18, "epoch": 90, "optimizer": {"lr": 0.1}}, path)
    else:
        path = tmp_path / "r18.pt"
        torch.save({f"module.{k}": v for k, v in imagenet_resnet18.items()}, path)

    torch.manual_seed(1)
    model = create_model("resnet18", 10, pretrained=path)
    _assert_all_but_head_loaded(model, imagenet_resnet18)


def test_load_report_names_loaded_and_skipped_keys(
    imagenet_resnet18: dict[str, torch.Tensor], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = save_weights(imagenet_resnet18, tmp_path / "r18.safetensors")
    model = create_model("resnet18", 10)
    assert isinstance(model.fc, torch.nn.Linear)
    fresh_head = model.fc.weight.detach().clone()
    with caplog.at_level(logging.INFO, logger="visionloop.models.weights"):
        report = load_pretrained(model, path)
    assert report.head == "fc"
    assert report.skipped == ("fc.weight", "fc.bias")
    assert set(report.loaded) == set(imagenet_resnet18) - {"fc.weight", "fc.bias"}
    assert torch.equal(model.fc.weight, fresh_head), "the head must keep its fresh initialisation"
    assert "fc.weight kept at init (file (1000, 512), model (10, 512))" in caplog.text
    assert f"loaded {len(report.loaded)} tensors" in report.summary()


def test_same_num_classes_loads_everything(
    imagenet_resnet18: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    path = save_weights(imagenet_resnet18, tmp_path / "r18.safetensors")
    model = create_model("resnet18", 1000)
    report = load_pretrained(model, path)
    assert report.skipped == ()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in imagenet_resnet18.items())


def test_a_backbone_only_file_keeps_the_fresh_head(
    imagenet_resnet18: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    backbone = {k: v for k, v in imagenet_resnet18.items() if not k.startswith("fc.")}
    path = save_weights(backbone, tmp_path / "backbone.safetensors")
    report = load_pretrained(create_model("resnet18", 10), path)
    assert report.skipped == ("fc.weight", "fc.bias")


def test_a_mismatched_non_head_key_is_an_error_and_nothing_loads(
    imagenet_resnet18: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    bad = dict(imagenet_resnet18)
    bad["layer1.0.conv1.weight"] = torch.zeros(32, 64, 3, 3)
    path = save_weights(bad, tmp_path / "bad.safetensors")
    model = create_model("resnet18", 10)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(WeightsError) as e:
        load_pretrained(model, path)
    msg = str(e.value)
    assert "layer1.0.conv1.weight: file (32, 64, 3, 3) vs model (64, 64, 3, 3)" in msg
    assert "Likely cause" in msg and "Nothing was loaded" in msg
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_weights_of_another_architecture_name_the_keys_and_the_cause(tmp_path: Path) -> None:
    path = save_weights(create_model("resnet34", 10), tmp_path / "r34.safetensors")
    with pytest.raises(WeightsError) as e:
        create_model("resnet18", 10, pretrained=path)
    msg = str(e.value)
    assert "unexpected in the file" in msg and "layer1.2." in msg
    assert "model.arch" in msg


def test_a_key_prefix_is_diagnosed(tmp_path: Path) -> None:
    sd = create_model("small_cnn", 10).state_dict()
    path = save_weights({f"backbone.{k}": v for k, v in sd.items()}, tmp_path / "prefixed.safetensors")
    with pytest.raises(WeightsError, match=r"'backbone\.' prefix"):
        create_model("small_cnn", 10, pretrained=path)


def test_a_pickled_full_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "whole_model.pt"
    torch.save(create_model("small_cnn", 10), path)
    with pytest.raises(WeightsError) as e:
        create_model("small_cnn", 10, pretrained=path)
    msg = str(e.value)
    assert "torch.save(model)" in msg and "state dict" in msg and "weights_only=False" in msg


def test_unreadable_or_unsupported_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(WeightsError, match="does not exist"):
        load_weights(tmp_path / "missing.safetensors")

    (tmp_path / "w.bin").write_bytes(b"\0" * 16)
    with pytest.raises(WeightsError, match=r"unsupported weights format \.bin"):
        load_weights(tmp_path / "w.bin")

    good = save_weights(create_model("small_cnn", 2), tmp_path / "good.safetensors")
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(WeightsError, match="truncated"):
        load_weights(truncated)

    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    with pytest.raises(WeightsError, match="not a state dict"):
        load_weights(tmp_path / "tensor.pt")

    torch.save({"epoch": 3, "lr": 0.1}, tmp_path / "nostate.pt")
    with pytest.raises(WeightsError, match="without a state dict"):
        load_weights(tmp_path / "nostate.pt")


def test_a_file_from_another_tool_loads(tmp_path: Path) -> None:
    """Plain safetensors written by safetensors itself (not by save_weights) load too."""
    sd = {k: v.contiguous() for k, v in create_model("small_cnn", 3).state_dict().items()}
    save_file(sd, str(tmp_path / "plain.safetensors"))
    model = create_model("small_cnn", 3, pretrained=tmp_path / "plain.safetensors")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sd.items())
