"""visionloop.data.imageops gives the pixels torchvision 0.29 gives, bitwise, on random images
and sizes (it exists only so that a classifier's processes need not import torchvision), and a
training process does not import torchvision at all."""

from __future__ import annotations

import io
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as TF

from visionloop.data import imageops
from visionloop.models.card import LETTERBOX_FILL, EvalPreprocess, letterbox_shape


def _images(n: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        h, w = (int(v) for v in rng.integers(1, 90, 2))
        # Smooth and noisy content both: a gradient plus noise, so rounding cases occur.
        base = np.linspace(0, 255, h * w * 3).reshape(h, w, 3)
        noise = rng.integers(-40, 40, (h, w, 3))
        arr = np.clip(base + noise, 0, 255).astype(np.uint8)
        out.append(torch.from_numpy(arr).permute(2, 0, 1).contiguous())
    return out


def _encode(img: torch.Tensor, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img.permute(1, 2, 0).numpy()).save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("fmt", "kw"),
    [("PNG", {}), ("JPEG", {"quality": 90}), ("JPEG", {"quality": 75, "subsampling": 2})],
)
def test_decode_matches_torchvision(fmt: str, kw: dict[str, object]) -> None:
    for img in _images(12, seed=1):
        data = _encode(img, fmt, **kw)
        want = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
        got = imageops.decode_rgb(data)
        assert got.dtype == torch.uint8 and got.is_contiguous()
        assert torch.equal(got, want), (fmt, kw, img.shape)


def test_decode_turns_grayscale_and_palette_into_rgb() -> None:
    gray = np.arange(12, dtype=np.uint8).reshape(3, 4) * 20
    for im in (Image.fromarray(gray, "L"), Image.fromarray(gray, "L").convert("P")):
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        got = imageops.decode_rgb(buf.getvalue())
        assert got.shape == (3, 3, 4)
        assert all(torch.equal(got[c], torch.from_numpy(gray)) for c in range(3))


def test_decode_of_garbage_raises() -> None:
    with pytest.raises(OSError, match="cannot identify"):
        imageops.decode_rgb(b"not an image")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32])
def test_resize_crops_and_colour_match_torchvision(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(2)
    for img in _images(40, seed=3):
        if dtype == torch.float32:
            img = img.float() / 255
        _, h, w = img.shape
        size = [int(rng.integers(1, 64))] if rng.random() < 0.5 else [int(v) for v in rng.integers(1, 64, 2)]
        want = TF.resize(img, size, antialias=True)
        assert torch.equal(imageops.resize(img, size), want), (img.shape, size)
        top, left = int(rng.integers(-5, h)), int(rng.integers(-5, w))
        ch, cw = int(rng.integers(1, h + 6)), int(rng.integers(1, w + 6))
        assert torch.equal(imageops.crop(img, top, left, ch, cw), TF.crop(img, top, left, ch, cw))
        out = [int(v) for v in rng.integers(1, 48, 2)]
        got = imageops.resized_crop(img, top, left, ch, cw, out)
        assert torch.equal(got, TF.resized_crop(img, top, left, ch, cw, out, antialias=True))
        box = [int(v) for v in rng.integers(1, 100, 2)]
        assert torch.equal(imageops.center_crop(img, box), TF.center_crop(img, box)), (img.shape, box)
        assert torch.equal(imageops.horizontal_flip(img), TF.horizontal_flip(img))
        f = float(rng.uniform(0, 2.5))
        assert torch.equal(imageops.adjust_brightness(img, f), TF.adjust_brightness(img, f))
        assert torch.equal(imageops.adjust_contrast(img, f), TF.adjust_contrast(img, f))
        assert torch.equal(imageops.adjust_saturation(img, f), TF.adjust_saturation(img, f))
        one = img[:1]
        assert torch.equal(imageops.adjust_contrast(one, f), TF.adjust_contrast(one, f))
        assert torch.equal(imageops.adjust_saturation(one, f), TF.adjust_saturation(one, f))


def test_a_channels_last_image_resizes_like_torchvision() -> None:
    img = _images(1, seed=4)[0].unsqueeze(0).contiguous(memory_format=torch.channels_last)[0]
    assert torch.equal(imageops.resize(img, [33, 20]), TF.resize(img, [33, 20], antialias=True))


def test_negative_or_non_finite_factors_are_refused() -> None:
    img = _images(1, seed=5)[0]
    with pytest.raises(ValueError, match="contrast factor"):
        imageops.adjust_contrast(img, -0.1)
    with pytest.raises(ValueError, match="brightness factor"):
        imageops.adjust_brightness(img, float("nan"))


def test_the_classification_data_path_does_not_import_torchvision() -> None:
    """The reason for the module: a classifier's trainer, evaluator, export, server and label
    scoring read and preprocess images without torchvision (whose import pulls in
    torch._dynamo)."""
    code = (
        "import sys\n"
        "import visionloop.train.api, visionloop.eval.run, visionloop.export.data\n"
        "import visionloop.tasks.classification.data\n"
        "from visionloop.models import create_model\n"
        "create_model('small_cnn', 10)\n"
        "import torch, visionloop.eval.api, visionloop.serve.images, visionloop.label.scoring\n"
        "from visionloop.models.card import EvalPreprocess\n"
        "pre = EvalPreprocess(channels=3, resize_size=20, crop_size=(16, 16), interpolation='bicubic',\n"
        "                     mean=(0.5,) * 3, std=(0.2,) * 3)\n"
        "assert pre.to_transform()(torch.zeros(3, 30, 40, dtype=torch.uint8)).shape == (3, 16, 16)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchvision'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def _torchvision_eval_transform(pre: EvalPreprocess) -> Any:
    """The card's transform as it was built from torchvision's v2 transforms (the reference)."""
    from torchvision.transforms import v2

    from visionloop.models.card import _IngestRGB

    mode = v2.InterpolationMode(pre.interpolation)
    colour = v2.RGB() if pre.channels == 3 else v2.Grayscale(num_output_channels=pre.channels)
    size = pre.resize_size if isinstance(pre.resize_size, int) else list(pre.resize_size)
    if pre.resize == "letterbox":

        def letterbox(img: torch.Tensor) -> torch.Tensor:
            h, w = int(img.shape[-2]), int(img.shape[-1])
            nh, nw = letterbox_shape(h, w, pre.crop_size)
            if (nh, nw) != (h, w):
                img = TF.resize(img, [nh, nw], interpolation=mode, antialias=True)
            out = torch.full((img.shape[0], *pre.crop_size), LETTERBOX_FILL, dtype=img.dtype)
            out[:, :nh, :nw] = img
            return out

        geometry: list[Any] = [letterbox]
    else:
        geometry = [v2.Resize(size, interpolation=mode, antialias=True), v2.CenterCrop(list(pre.crop_size))]
    return v2.Compose(
        [
            _IngestRGB(pre.alpha_background),
            colour,
            *geometry,
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(list(pre.mean), list(pre.std)),
        ]
    )


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "nearest"])
@pytest.mark.parametrize(("channels", "resize"), [(3, "crop"), (1, "crop"), (3, "letterbox")])
def test_the_model_cards_eval_transform_matches_torchvision(
    interpolation: str, channels: int, resize: str
) -> None:
    rng = np.random.default_rng(6)
    for k, img in enumerate(_images(10, seed=7)):
        c, h, w = (channels, 24, 20) if k % 2 else (channels, 17, 17)
        size: int | tuple[int, int] = int(rng.integers(17, 30)) if k % 3 else (int(h * 1.2), int(w * 1.3))
        if resize == "letterbox":
            size = max(h, w)
        pre = EvalPreprocess(
            channels=c, resize_size=size, crop_size=(h, w), interpolation=interpolation,
            mean=(0.4,) * c, std=(0.25,) * c, resize=resize,
        )  # fmt: skip
        ours, theirs = pre.to_transform(), _torchvision_eval_transform(pre)
        pil = Image.fromarray(img.permute(1, 2, 0).numpy())
        rgba = pil.convert("RGBA")
        rgba.putalpha(128)
        for x in (img, pil, rgba, pil.convert("L")):
            a, b = ours(x), theirs(x)
            assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape == (c, h, w)
            assert torch.equal(a, b), (interpolation, channels, resize, type(x), k)
