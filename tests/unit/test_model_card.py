"""The model card round-trips exactly, refuses inconsistent content, and rebuilds the same
model and eval preprocessing that training used."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torchvision
from PIL import Image
from pydantic import ValidationError
from torchvision.transforms.v2 import functional as F

from visionloop import __version__
from visionloop.core.errors import NotFoundError
from visionloop.data.imageio import to_rgb
from visionloop.data.manifest import (
    ChannelStats,
    DatasetManifest,
    ImagePolicy,
    SizeStats,
    SourceInfo,
    SplitInfo,
    SplitPolicy,
)
from visionloop.models import (
    MODEL_CARD_NAME,
    ModelCard,
    ModelCardError,
    create_model,
    eval_preprocess,
    model_defaults,
    save_weights,
)

CLASSES = ["cat", "dog", "fox"]


def _manifest() -> DatasetManifest:
    split = SplitInfo(count=6, per_class=dict.fromkeys(CLASSES, 2), shard_dir="shards/train", bytes=1000)
    return DatasetManifest(
        version="ds-3f2a9c",
        classes=CLASSES,
        splits={"train": split},
        image_policy=ImagePolicy(),
        source=SourceInfo(kind="imagefolder", path="/data/pets", files_seen=6),
        split_policy=SplitPolicy(seed=0, val_fraction=0.0, test_fraction=0.0, from_source=False),
        channel_stats=ChannelStats(mean=(0.4, 0.4, 0.4), std=(0.2, 0.2, 0.2)),
        size_stats=SizeStats(min=(32, 32), median=(32, 32), max=(32, 32)),
        created_at="2025-01-01T00:00:00+00:00",
        visionloop_version="0.1.0",
    )


def test_from_manifest_takes_classes_version_and_registry_defaults() -> None:
    card = ModelCard.from_manifest(_manifest(), arch="resnet18", model_kwargs={"zero_init_residual": True})
    assert card.class_names == CLASSES and card.num_classes == 3
    assert card.dataset_version == "ds-3f2a9c"
    d = model_defaults("resnet18")
    assert (card.input_size, card.mean, card.std, card.crop_pct, card.interpolation) == (
        d.input_size,
        d.mean,
        d.std,
        d.crop_pct,
        d.interpolation,
    )
    assert card.task == "classification"
    assert card.visionloop_version == __version__
    assert card.created_at.endswith("+00:00")


def test_overrides_win_over_registry_defaults() -> None:
    m = _manifest()
    card = ModelCard.from_manifest(
        m,
        arch="small_cnn",
        input_size=(3, 48, 48),
        mean=m.channel_stats.mean,
        std=m.channel_stats.std,
        crop_pct=0.9,
        metrics={"val/accuracy": 0.97},
        run_uid="run-1",
    )
    assert card.input_size == (3, 48, 48) and card.mean == (0.4, 0.4, 0.4) and card.crop_pct == 0.9
    assert card.metrics == {"val/accuracy": 0.97} and card.run_uid == "run-1"


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    card = ModelCard.from_manifest(
        _manifest(), arch="small_cnn", model_kwargs={"widths": [8, 16]}, metrics={"val/accuracy": 0.5}
    )
    path = card.save(tmp_path / "model" / MODEL_CARD_NAME)
    assert path.is_file()
    raw = json.loads(path.read_text())
    assert raw["arch"] == "small_cnn" and raw["class_names"] == CLASSES and raw["input_size"] == [3, 32, 32]
    assert ModelCard.load(path) == card
    # A model folder works in place of the file, for both directions.
    assert ModelCard.load(tmp_path / "model") == card
    assert card.save(tmp_path / "model") == path
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == [MODEL_CARD_NAME]


def test_non_finite_metrics_are_stored_as_null(tmp_path: Path) -> None:
    card = ModelCard.from_manifest(
        _manifest(), arch="small_cnn", metrics={"loss": float("nan"), "accuracy": 0.1, "x": float("inf")}
    )
    assert card.metrics == {"loss": None, "accuracy": 0.1, "x": None}
    path = card.save(tmp_path / "card.json")
    assert json.loads(path.read_text())["metrics"] == {"loss": None, "accuracy": 0.1, "x": None}
    assert ModelCard.load(path) == card


def test_inconsistent_cards_are_refused() -> None:
    base = ModelCard.from_manifest(_manifest(), arch="small_cnn").model_dump()
    cases: list[tuple[dict[str, object], str]] = [
        ({"class_names": ["a", "b"]}, "num_classes is 3"),
        ({"class_names": ["a", "a", "b"]}, "repeated"),
        ({"mean": (0.5, 0.5)}, "one per input channel"),
        ({"std": (0.5, 0.0, 0.5)}, "must be > 0"),
        ({"crop_pct": 1.5}, "crop_pct"),
        ({"model_kwargs": {"act": object()}}, "JSON-serialisable"),
        ({"colour": "blue"}, "colour"),
    ]
    for change, match in cases:
        with pytest.raises(ValidationError, match=match):
            ModelCard.model_validate({**base, **change})


def test_load_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="no model card"):
        ModelCard.load(tmp_path / "nowhere.json")

    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ModelCardError, match="cannot be read as JSON"):
        ModelCard.load(broken)

    card = ModelCard.from_manifest(_manifest(), arch="small_cnn")
    raw = card.model_dump(mode="json")
    invalid = tmp_path / "invalid.json"
    invalid.write_text(json.dumps({**raw, "num_classes": 0}))
    with pytest.raises(ModelCardError, match="not a valid model card") as e:
        ModelCard.load(invalid)
    assert "num_classes" in str(e.value)

    future = tmp_path / "future.json"
    future.write_text(json.dumps({**raw, "format_version": 99}))
    with pytest.raises(ModelCardError, match="upgrade visionloop"):
        ModelCard.load(future)


def test_eval_preprocess_matches_torchvision_recipe_for_resnet18() -> None:
    card = ModelCard.from_manifest(_manifest(), arch="resnet18")
    pre = card.eval_preprocess()
    assert (pre.resize_size, pre.crop_size, pre.interpolation) == (256, (224, 224), "bilinear")

    torch.manual_seed(0)
    img = torch.randint(0, 256, (3, 300, 400), dtype=torch.uint8)
    ours = pre.to_transform()(img)
    assert ours.shape == (3, 224, 224) and ours.dtype == torch.float32

    # Exactly the recipe, spelled out with torchvision's functional ops...
    expected = F.resize(img, 256, interpolation=F.InterpolationMode.BILINEAR, antialias=True)
    expected = F.to_dtype(F.center_crop(expected, [224, 224]), torch.float32, scale=True)
    expected = F.normalize(expected, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    assert torch.equal(ours, expected)
    # ...and torchvision's own eval transform for resnet18 weights, whose older uint8 resize
    # kernel rounds differently: never more than one grey level apart.
    theirs = torchvision.models.ResNet18_Weights.IMAGENET1K_V1.transforms()(img)
    one_level = 1.0 / (255 * 0.224) + 1e-6
    assert (ours - theirs).abs().max() <= one_level


def test_eval_preprocess_handles_pil_images_like_ingest_and_non_square_inputs() -> None:
    card = ModelCard.from_manifest(_manifest(), arch="small_cnn", input_size=(3, 24, 40), crop_pct=0.8)
    assert card.alpha_background == (255, 255, 255)  # from the manifest's image policy
    pre = card.eval_preprocess()
    assert pre.resize_size == (30, 50) and pre.crop_size == (24, 40)
    # Half-transparent red: ingest composites it onto white, so must serving.
    rgba = Image.new("RGBA", (64, 48), (255, 0, 0, 128))
    expected_rgb = to_rgb(rgba, (255, 255, 255))[0, 0] / 255.0
    x = pre.to_transform()(rgba)
    assert x.shape == (3, 24, 40) and x.dtype == torch.float32
    torch.testing.assert_close(x[:, 0, 0], torch.tensor((expected_rgb - 0.5) / 0.5, dtype=torch.float32))
    # A grayscale PIL image becomes three equal channels.
    gray = pre.to_transform()(Image.new("L", (40, 24), 51))
    torch.testing.assert_close(gray[:, 5, 5], torch.full((3,), (0.2 - 0.5) / 0.5))


def test_eval_preprocess_of_defaults_equals_the_cards() -> None:
    card = ModelCard.from_manifest(_manifest(), arch="efficientnet_b3")
    assert card.eval_preprocess() == eval_preprocess(model_defaults("efficientnet_b3"))
    assert card.eval_preprocess().resize_size == 320  # torchvision's resize for efficientnet_b3


def test_card_rebuilds_the_trained_model(tmp_path: Path) -> None:
    card = ModelCard.from_manifest(_manifest(), arch="small_cnn", model_kwargs={"widths": [8, 16]})
    trained = create_model("small_cnn", 3, widths=[8, 16])
    weights = save_weights(trained, tmp_path / "model.safetensors")
    card.save(tmp_path)
    rebuilt = ModelCard.load(tmp_path).create_model(weights)
    for k, v in trained.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[k], v), k
