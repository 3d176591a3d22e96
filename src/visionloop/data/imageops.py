"""Decoding and uint8 image operations for the classification data path, in torch and Pillow.

Why not torchvision's `io.decode_image` and `transforms.v2.functional`: importing any part of
torchvision imports all of it, and `torchvision.ops` imports `torch._dynamo`, about 2.3 s of
CPU in every training, evaluation and export process, which a classifier's data path never
uses (a task that needs torchvision imports it itself). These functions make the
same torch calls in the same order as torchvision 0.29's kernels for uint8 (C, H, W) tensors,
so the pixels are bitwise those torchvision gives; `tests/unit/test_imageops.py` holds them to
it on random images and sizes.
"""

from __future__ import annotations

import io
import math
import platform
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image
from torch.nn.functional import interpolate
from torch.nn.functional import pad as torch_pad

# torchvision's grayscale weights (ITU-R 601-2 luma), as its tensor kernels use them.
_LUMA = (0.2989, 0.587, 0.114)


def decode_rgb(data: bytes) -> torch.Tensor:
    """A shard record's encoded image (PNG/JPEG bytes, as ingest wrote it) → uint8 (3, H, W).

    Ingest stores 8-bit RGB (or baseline JPEG kept as it came), so converting to RGB is the
    only mode change here; Pillow's decompression-bomb limit still applies."""
    with Image.open(io.BytesIO(data)) as im:
        rgb = im if im.mode == "RGB" else im.convert("RGB")
        array = np.asarray(rgb, dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).contiguous()


def _native_uint8_resize(image: torch.Tensor) -> bool:
    """Whether torch resizes uint8 bilinearly itself (AVX2/AVX-512 or ARM CPUs), as
    torchvision decides: elsewhere it goes through float32 and rounds."""
    return image.device.type == "cpu" and (
        torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
        or platform.machine() in ("aarch64", "arm64")
    )


def output_size(height: int, width: int, size: Sequence[int]) -> tuple[int, int]:
    """(H, W) after a resize to `size`: `[short side]` keeps the aspect ratio (the long side
    truncated, as torchvision does), `[H, W]` is exact."""
    if len(size) == 1:
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = int(size[0]), int(size[0] * long / short)
        new_w, new_h = (new_short, new_long) if width <= height else (new_long, new_short)
        return new_h, new_w
    return int(size[0]), int(size[1])


def resize(image: torch.Tensor, size: Sequence[int] | int, interpolation: str = "bilinear") -> torch.Tensor:
    """Resize a (..., C, H, W) image, its dtype kept: bilinear and bicubic with antialiasing,
    nearest without (torchvision's rules for each)."""
    if interpolation not in ("bilinear", "bicubic", "nearest"):
        raise ValueError(f"interpolation must be bilinear, bicubic or nearest, not {interpolation!r}")
    size = [size] if isinstance(size, int) else list(size)
    shape = image.shape
    numel = image.numel()
    channels, height, width = shape[-3:]
    new_h, new_w = output_size(height, width, size)
    if (new_h, new_w) == (height, width) or numel == 0:
        return image
    dtype = image.dtype
    native = dtype in (torch.float32, torch.float64) or (
        dtype == torch.uint8
        and (
            interpolation == "nearest"
            or (image.device.type == "cpu" and interpolation == "bicubic")
            or (interpolation == "bilinear" and _native_uint8_resize(image))
        )
    )
    x = image.reshape(-1, channels, height, width)
    strides = x.stride()
    if x.is_contiguous(memory_format=torch.channels_last) and x.shape[0] == 1 and numel != strides[0]:
        # torchvision's restride: a single channels_last image would otherwise come back
        # contiguous from interpolate (pytorch/pytorch#68430).
        x = x.as_strided((1, channels, height, width), [numel, *strides[1:]])
    if not native:
        x = x.to(dtype=torch.float32)
    if interpolation == "nearest":
        x = interpolate(x, size=[new_h, new_w], mode="nearest")
    else:
        x = interpolate(x, size=[new_h, new_w], mode=interpolation, align_corners=False, antialias=True)
    if not native:
        if interpolation == "bicubic" and dtype == torch.uint8:
            x = x.clamp_(min=0, max=255)  # bicubic overshoots; torchvision clamps on this path
        if not dtype.is_floating_point:
            x = x.round_()
        x = x.to(dtype=dtype)
    return x.reshape((*shape[:-3], channels, new_h, new_w))


def crop(image: torch.Tensor, top: int, left: int, height: int, width: int) -> torch.Tensor:
    """The box (top, left, height, width); any part outside the image is zeros."""
    h, w = image.shape[-2:]
    right, bottom = left + width, top + height
    if left < 0 or top < 0 or right > w or bottom > h:
        image = image[..., max(top, 0) : bottom, max(left, 0) : right]
        padding = [
            max(min(right, 0) - left, 0),
            max(right - max(w, left), 0),
            max(min(bottom, 0) - top, 0),
            max(bottom - max(h, top), 0),
        ]
        return torch_pad(image, padding, mode="constant", value=0.0)
    return image[..., top:bottom, left:right]


def resized_crop(
    image: torch.Tensor, top: int, left: int, height: int, width: int, size: Sequence[int]
) -> torch.Tensor:
    return resize(crop(image, top, left, height, width), size)


def center_crop(image: torch.Tensor, size: Sequence[int]) -> torch.Tensor:
    """The centred (H, W) box, zero-padded where the image is smaller."""
    crop_h, crop_w = (int(size[0]), int(size[0])) if len(size) == 1 else (int(size[0]), int(size[1]))
    height, width = image.shape[-2:]
    if crop_h > height or crop_w > width:
        left = (crop_w - width) // 2 if crop_w > width else 0
        top = (crop_h - height) // 2 if crop_h > height else 0
        right = (crop_w - width + 1) // 2 if crop_w > width else 0
        bottom = (crop_h - height + 1) // 2 if crop_h > height else 0
        image = torch_pad(image, [left, right, top, bottom], value=0.0)
        height, width = image.shape[-2:]
        if (crop_h, crop_w) == (height, width):
            return image
    top = round((height - crop_h) / 2.0)
    left = round((width - crop_w) / 2.0)
    return image[..., top : top + crop_h, left : left + crop_w]


def rgb(image: torch.Tensor) -> torch.Tensor:
    """A 1-channel image repeated to 3 channels; a 3-channel one as it is."""
    if image.shape[-3] >= 3:
        return image
    reps = [1] * image.dim()
    reps[-3] = 3
    return image.repeat(reps)


def grayscale(image: torch.Tensor, channels: int = 1) -> torch.Tensor:
    """Luma (truncated to the image's dtype, as torchvision does), on `channels` channels."""
    if channels not in (1, 3):
        raise ValueError(f"a grayscale image has 1 or 3 channels, not {channels}")
    if image.shape[-3] == 1:
        return image.clone() if channels == 1 else rgb(image)
    r, g, b = image.unbind(dim=-3)
    gray = r.mul(_LUMA[0]).add_(g, alpha=_LUMA[1]).add_(b, alpha=_LUMA[2]).unsqueeze(dim=-3).to(image.dtype)
    return gray.expand(image.shape) if channels == 3 else gray


def horizontal_flip(image: torch.Tensor) -> torch.Tensor:
    return image.flip(-1)


def _max_value(dtype: torch.dtype) -> float:
    return 1.0 if dtype.is_floating_point else float(torch.iinfo(dtype).max)


def _blend(image: torch.Tensor, other: torch.Tensor, ratio: float) -> torch.Tensor:
    ratio = float(ratio)
    out = image.mul(ratio).add_(other, alpha=1.0 - ratio).clamp_(0, _max_value(image.dtype))
    return out if image.is_floating_point() else out.to(image.dtype)


def _luma_float(image: torch.Tensor) -> torch.Tensor:
    """Grayscale of an RGB image in float, floored for integer images (torchvision's rule)."""
    r, g, b = image.unbind(dim=-3)
    gray = r.mul(_LUMA[0]).add_(g, alpha=_LUMA[1]).add_(b, alpha=_LUMA[2]).unsqueeze(dim=-3)
    return gray if image.is_floating_point() else gray.floor_()


def _check_factor(name: str, factor: float, image: torch.Tensor) -> None:
    if factor < 0 or not math.isfinite(factor):
        raise ValueError(f"{name} ({factor}) must be a finite number >= 0")
    if image.shape[-3] not in (1, 3):
        raise TypeError(f"images must have 1 or 3 channels, not {image.shape[-3]}")


def adjust_brightness(image: torch.Tensor, factor: float) -> torch.Tensor:
    _check_factor("brightness factor", factor, image)
    out = image.mul(factor).clamp_(0, _max_value(image.dtype))
    return out if image.is_floating_point() else out.to(image.dtype)


def adjust_contrast(image: torch.Tensor, factor: float) -> torch.Tensor:
    _check_factor("contrast factor", factor, image)
    if image.shape[-3] == 3:
        gray = _luma_float(image)
    else:
        gray = image if image.is_floating_point() else image.to(torch.float32)
    mean = torch.mean(gray, dim=(-3, -2, -1), keepdim=True)
    return _blend(image, mean, factor)


def adjust_saturation(image: torch.Tensor, factor: float) -> torch.Tensor:
    _check_factor("saturation factor", factor, image)
    if image.shape[-3] == 1:
        return image
    return _blend(image, _luma_float(image), factor)
