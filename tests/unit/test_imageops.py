"""visionloop.data.imageops gives the pixels torchvision 0.29 gives, bitwise, on random images
and sizes (it exists only so that a classifier's processes need not import torchvision), and a
training process does not import torchvision at all."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_image
from torchvision.transforms.v2 import functional as TF

from visionloop.data import imageops


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
    """The reason for the module: a classifier's trainer, evaluator and export read images
    without torchvision (whose import pulls in torch._dynamo)."""
    code = (
        "import sys\n"
        "import visionloop.train.api, visionloop.eval.run, visionloop.export.data\n"
        "import visionloop.tasks.classification.data\n"
        "from visionloop.models import create_model\n"
        "create_model('small_cnn', 10)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchvision'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
