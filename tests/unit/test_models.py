"""The model contract, over every native model and a curated set of small torchvision ones:
logits of shape (N, num_classes), finite, and a finite gradient for every trainable parameter."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torchvision
from torch import nn

from visionloop.core.errors import SpecError
from visionloop.models import (
    ModelDefaults,
    create_model,
    find_classifier,
    is_model,
    list_models,
    model_defaults,
    model_source,
    register_model,
    registry,
)

NUM_CLASSES = 7
NATIVE = [n for n in list_models() if model_source(n) == "native"]
# Small or representative torchvision families; 64 px keeps each under ~3 s on 2 CPU cores.
CURATED_TORCHVISION = [
    "resnet18",
    "mobilenet_v3_small",
    "efficientnet_b0",
    "regnet_x_400mf",
    "shufflenet_v2_x0_5",
    "squeezenet1_0",
    "convnext_tiny",
]
TORCHVISION_NAMES = torchvision.models.list_models(module=torchvision.models)


def _check_forward_backward(model: nn.Module, x: torch.Tensor) -> None:
    model.train()
    out = model(x)
    assert isinstance(out, torch.Tensor), f"forward returned {type(out).__name__}, not a logits tensor"
    assert out.shape == (x.shape[0], NUM_CLASSES)
    assert torch.isfinite(out).all()
    out.logsumexp(dim=1).mean().backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{name} got no gradient"
            assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
    model.eval()
    with torch.no_grad():
        assert model(x).shape == (x.shape[0], NUM_CLASSES)


def test_there_are_native_models() -> None:
    assert {"small_cnn", "tiny_resnet"} <= set(NATIVE)


@pytest.mark.parametrize("name", NATIVE)
def test_native_model_contract(name: str) -> None:
    torch.manual_seed(0)
    c, h, w = model_defaults(name).input_size
    _check_forward_backward(create_model(name, NUM_CLASSES), torch.randn(2, c, h, w))


@pytest.mark.parametrize("name", CURATED_TORCHVISION)
def test_torchvision_model_contract(name: str) -> None:
    torch.manual_seed(0)
    _check_forward_backward(create_model(name, NUM_CLASSES), torch.randn(2, 3, 64, 64))


@pytest.mark.parametrize("name", NATIVE)
@pytest.mark.parametrize("size", [(8, 8), (17, 23), (96, 64)])
def test_native_models_take_any_input_size(name: str, size: tuple[int, int]) -> None:
    model = create_model(name, NUM_CLASSES).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 3, *size)).shape == (1, NUM_CLASSES)


@pytest.mark.parametrize("name", NATIVE)
def test_native_models_train_deterministically_on_cpu(name: str) -> None:
    """Two identical runs under deterministic mode end with bitwise-equal weights (and the
    mode raises for no op they use)."""

    def run() -> dict[str, torch.Tensor]:
        torch.manual_seed(1)
        model = create_model(name, NUM_CLASSES)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        x, y = torch.randn(8, 3, 32, 32), torch.randint(0, NUM_CLASSES, (8,))
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return model.state_dict()

    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        a, b = run(), run()
    finally:
        torch.use_deterministic_algorithms(before)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_small_cnn_size_is_cpu_friendly() -> None:
    params = sum(p.numel() for p in create_model("small_cnn", 10).parameters())
    assert 100_000 <= params <= 300_000


def test_every_torchvision_classification_model_is_listed() -> None:
    listed = set(list_models())
    assert len(TORCHVISION_NAMES) >= 80
    for name in TORCHVISION_NAMES:
        assert name in listed
        assert model_source(name) == "torchvision"


def test_list_models_filters_by_pattern() -> None:
    resnets = list_models("resnet*")
    assert "resnet18" in resnets and "resnet50" in resnets
    assert all(n.startswith("resnet") for n in resnets)
    assert list_models("small_*") == ["small_cnn"]
    assert list_models("no-such-*") == []
    assert list_models() == sorted(list_models())


def test_head_is_found_in_every_torchvision_model() -> None:
    """Pretrained loading relies on the last Linear/Conv2d being the classifier. Built on the
    meta device (no memory, no init) so the whole zoo takes seconds; regnets compute their
    widths with real tensor ops at construction and cannot be built there."""
    for name in TORCHVISION_NAMES:
        if name.startswith("regnet_") and name != "regnet_x_400mf":
            continue
        device = "cpu" if name.startswith("regnet_") else "meta"
        with torch.device(device):
            model = create_model(name, NUM_CLASSES)
        head = find_classifier(model)
        assert head is not None, name
        module = model.get_submodule(head)
        out = module.out_features if isinstance(module, nn.Linear) else module.out_channels
        assert out == NUM_CLASSES, f"{name}: {head} has {out} outputs"
        if name in ("googlenet", "inception_v3"):
            # Built with aux_logits=False: one logits tensor in train mode too, not a tuple.
            with torch.device("meta"):
                logits = model.train()(torch.empty(2, 3, 299, 299))
            assert isinstance(logits, torch.Tensor) and logits.shape == (2, NUM_CLASSES), name


def test_torchvision_defaults_reproduce_torchvision_eval_recipe() -> None:
    for name in TORCHVISION_NAMES:
        d = model_defaults(name)
        t = torchvision.models.get_model_weights(name).DEFAULT.transforms()
        assert d.input_size[0] == 3
        assert d.mean == tuple(t.mean) and d.std == tuple(t.std)
        if name.startswith("vit_") and t.crop_size[0] != 224:
            # Built without weights a ViT takes 224 px; see registry._torchvision_defaults.
            assert d.input_size == (3, 224, 224), name
            continue
        assert d.input_size == (3, t.crop_size[0], t.crop_size[0]), name
        assert math.floor(d.input_size[1] / d.crop_pct) == t.resize_size[0], name
        assert d.interpolation == t.interpolation.value, name


def test_imagenet_values_for_resnet18_and_native_values_for_small_cnn() -> None:
    d = model_defaults("resnet18")
    assert d == ModelDefaults(
        input_size=(3, 224, 224),
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
        crop_pct=0.875,
        interpolation="bilinear",
    )
    assert model_defaults("small_cnn").input_size == (3, 32, 32)
    assert model_defaults("small_cnn").crop_pct == 1.0


def test_vit_defaults_match_the_model_built_without_weights() -> None:
    d = model_defaults("vit_h_14")
    assert d.input_size == (3, 224, 224)
    with torch.device("meta"):
        model = create_model("vit_h_14", NUM_CLASSES)
    assert model.image_size == 224


def test_unknown_name_suggests_close_names_and_how_to_list() -> None:
    with pytest.raises(SpecError) as e:
        create_model("resnet19", 3)
    msg = str(e.value)
    assert "'resnet19'" in msg and "resnet18" in msg and "list_models" in msg
    with pytest.raises(SpecError, match="smal_cnn"):
        model_defaults("smal_cnn")
    assert not is_model("resnet19")


def test_bad_kwargs_and_num_classes_are_spec_errors() -> None:
    with pytest.raises(SpecError, match="widht"):
        create_model("small_cnn", 3, widht=3)
    with pytest.raises(SpecError, match="never downloads"):
        create_model("resnet18", 3, weights="IMAGENET1K_V1")
    for bad in (0, -1, True, 2.5):
        with pytest.raises(SpecError, match="num_classes"):
            create_model("small_cnn", bad)  # type: ignore[arg-type]


def test_model_kwargs_reach_the_constructor() -> None:
    model = create_model("small_cnn", 4, widths=(8, 16), in_chans=1)
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 4)
    assert sum(p.numel() for p in model.parameters()) < 5_000


def test_register_model_adds_a_listed_model_and_refuses_a_second_factory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Register into a copy of the registry so that no other test sees this model.
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))

    @register_model("test_only_linear", defaults=ModelDefaults(input_size=(1, 4, 4), mean=(0.0,), std=(1.0,)))
    def test_only_linear(num_classes: int) -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(16, num_classes))

    assert "test_only_linear" in list_models("test_only_*")
    assert model_source("test_only_linear") == "native"
    assert create_model("test_only_linear", 3)(torch.zeros(2, 1, 4, 4)).shape == (2, 3)
    assert model_defaults("test_only_linear").input_size == (1, 4, 4)

    def other(num_classes: int) -> nn.Module:
        return nn.Linear(1, num_classes)

    with pytest.raises(ValueError, match="already registered"):
        register_model("test_only_linear")(other)
    with pytest.raises(ValueError, match=r"already registered \(torchvision\)"):
        register_model("resnet18")(other)


def test_importing_the_registry_does_not_import_torch() -> None:
    code = "import sys, visionloop.models; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
