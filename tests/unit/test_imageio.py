"""One image in, 8-bit RGB bytes out: conversions checked pixel by pixel, rejections by reason.

Every stored result is decoded back with torchvision (what the training loader uses) and
compared with the pixels we meant to store.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image, JpegImagePlugin
from torchvision.io import ImageReadMode, decode_image

from _imgfactory import (
    bomb_png,
    cmyk_jpeg,
    encode,
    exif_jpeg,
    gray16_png,
    jpeg,
    noise,
    png,
    rgb16_png,
    truncate,
)
from visionloop.data.imageio import (
    Normalised,
    Rejection,
    RejectReason,
    is_image_name,
    normalise_bytes,
    target_size,
)
from visionloop.data.manifest import ImagePolicy

WHITE = ImagePolicy()
# torchvision 0.29 deprecates its decoders in favour of TorchCodec; they are still what the
# brief (and the loader) use to read shards, so the warning is noise here.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")


def tv_decode(data: bytes) -> np.ndarray:
    """Decode as the training loader does: torchvision, forced to RGB, (H, W, 3) uint8."""
    t = decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    arr: np.ndarray = t.permute(1, 2, 0).numpy()
    return arr


def pil_decode(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def ok(data: bytes, policy: ImagePolicy = WHITE) -> Normalised:
    result = normalise_bytes(data, policy)
    assert isinstance(result, Normalised), result
    return result


def rejected(data: bytes, policy: ImagePolicy = WHITE) -> Rejection:
    result = normalise_bytes(data, policy)
    assert isinstance(result, Rejection), (
        f"expected a rejection, got {result.stored_as} {result.width}x{result.height}"
    )
    return result


def composite(c: int, a: int, bg: int) -> int:
    c, a, bg = int(c), int(a), int(bg)
    return round((c * a + bg * (255 - a)) / 255)


# -- stored as the original bytes ------------------------------------------------------------------


def test_rgb_png_is_stored_byte_for_byte() -> None:
    arr = noise(7, 5, seed=1)
    data = png(arr)
    n = ok(data)
    assert n.stored_as == "original" and n.data == data
    assert (n.width, n.height) == (7, 5)
    assert np.array_equal(tv_decode(n.data), arr)


def test_rgb_jpeg_is_stored_byte_for_byte_and_torchvision_agrees_with_pillow() -> None:
    data = jpeg(noise(16, 8, seed=2), quality=90)
    n = ok(data)
    assert n.stored_as == "original" and n.data == data
    assert np.array_equal(tv_decode(n.data), pil_decode(data))


def test_progressive_jpeg_is_re_encoded_as_baseline() -> None:
    # Only baseline JPEGs are kept as they are: GPU hardware decoders refuse progressive ones.
    source = jpeg(noise(16, 8, seed=2), quality=90, progressive=True, subsampling=0)
    n = ok(source)
    assert n.stored_as == "jpeg" and n.data != source
    stored = Image.open(io.BytesIO(n.data))
    assert not stored.info.get("progressive")
    assert JpegImagePlugin.get_sampling(stored) == 0  # the source's 4:4:4 chroma is kept
    assert np.array_equal(tv_decode(n.data), pil_decode(n.data))
    assert np.abs(tv_decode(n.data).astype(int) - pil_decode(source)).mean() < 2


def test_channel_sums_are_exact() -> None:
    arr = noise(9, 4, seed=3)
    n = ok(png(arr))
    assert n.pixel_sum == tuple(int(arr[:, :, c].astype(np.int64).sum()) for c in range(3))
    assert n.pixel_sq_sum == tuple(int((arr[:, :, c].astype(np.int64) ** 2).sum()) for c in range(3))


# -- conversions, asserted on pixel values -----------------------------------------------------------


def test_grayscale_l_becomes_equal_rgb_channels() -> None:
    gray = np.array([[0, 17, 128, 255]], dtype=np.uint8)
    n = ok(png(gray))
    assert n.stored_as == "png"
    assert np.array_equal(tv_decode(n.data), np.repeat(gray[:, :, None], 3, axis=2))


def test_la_is_composited_onto_the_background() -> None:
    la = np.array([[[100, 128], [100, 0], [100, 255], [7, 1]]], dtype=np.uint8)
    im = Image.fromarray(la, mode="LA")
    for bg in ((255, 255, 255), (0, 0, 0), (10, 200, 30)):
        n = ok(encode(im, "PNG"), ImagePolicy(alpha_background=bg))
        got = tv_decode(n.data)[0]
        expect = [[composite(g, a, b) for b in bg] for g, a in la[0]]
        assert got.tolist() == expect
    white = tv_decode(ok(encode(im, "PNG")).data)[0]
    assert white[0].tolist() == [177, 177, 177]  # 100 at alpha 128 over white
    assert white[1].tolist() == [255, 255, 255]  # fully transparent: the background


def test_rgba_is_composited_onto_the_background() -> None:
    rgba = np.array([[[200, 100, 0, 255], [200, 100, 0, 0], [200, 100, 0, 64]]], dtype=np.uint8)
    bg = (10, 20, 30)
    n = ok(png(rgba), ImagePolicy(alpha_background=bg))
    assert n.stored_as == "png"
    got = tv_decode(n.data)[0].tolist()
    assert got[0] == [200, 100, 0]
    assert got[1] == [10, 20, 30]
    assert got[2] == [composite(200, 64, 10), composite(100, 64, 20), composite(0, 64, 30)]


def _palette_image() -> Image.Image:
    im = Image.fromarray(np.array([[0, 1, 2, 1]], dtype=np.uint8), mode="P")
    im.putpalette([255, 0, 0, 0, 255, 0, 0, 0, 255] + [0] * (256 * 3 - 9))
    return im


def test_palette_without_transparency_maps_through_the_palette() -> None:
    n = ok(encode(_palette_image(), "PNG"))
    assert tv_decode(n.data)[0].tolist() == [[255, 0, 0], [0, 255, 0], [0, 0, 255], [0, 255, 0]]


def test_palette_with_transparency_composites_the_transparent_index() -> None:
    n = ok(encode(_palette_image(), "PNG", transparency=1), ImagePolicy(alpha_background=(9, 9, 9)))
    assert tv_decode(n.data)[0].tolist() == [[255, 0, 0], [9, 9, 9], [0, 0, 255], [9, 9, 9]]


def test_rgb_png_with_colour_key_transparency_is_not_stored_as_original() -> None:
    arr = np.array([[[1, 2, 3], [50, 60, 70]]], dtype=np.uint8)
    n = ok(
        encode(Image.fromarray(arr), "PNG", transparency=(1, 2, 3)), ImagePolicy(alpha_background=(0, 0, 0))
    )
    assert n.stored_as == "png"
    assert tv_decode(n.data)[0].tolist() == [[0, 0, 0], [50, 60, 70]]


def test_cmyk_jpeg_becomes_rgb() -> None:
    n = ok(cmyk_jpeg(16, 16, (0, 255, 0, 0)))  # no cyan, full magenta: magenta
    assert n.stored_as == "jpeg"  # lossy source, re-encoded lossy
    got = tv_decode(n.data)
    assert np.array_equal(got, pil_decode(n.data))  # exactly what any decoder will see
    assert np.abs(got.astype(int) - [255, 0, 255]).max() <= 3


def test_16bit_grayscale_is_scaled_not_clipped() -> None:
    values = np.array([[0, 257, 1000, 32768, 65535]], dtype=np.uint16)
    assert Image.open(io.BytesIO(gray16_png(values))).mode.startswith("I")
    n = ok(gray16_png(values))
    assert n.stored_as == "png"
    # round(v * 255 / 65535); clipping would have made everything above 255 white.
    assert tv_decode(n.data)[0, :, 0].tolist() == [0, 1, 4, 128, 255]


def test_16bit_rgb_png_is_reduced_to_8_bits_and_re_encoded() -> None:
    arr16 = np.array([[[65535, 32768, 0], [256, 511, 4660]]], dtype=np.uint16)
    n = ok(rgb16_png(arr16))
    assert n.stored_as == "png"  # the original is 48-bit: torchvision would not give 8-bit RGB
    assert tv_decode(n.data)[0].tolist() == [[255, 128, 0], [1, 1, 18]]


def test_one_bit_images_become_black_and_white() -> None:
    im = Image.fromarray(np.array([[True, False, True]]))
    assert im.mode == "1"
    n = ok(encode(im, "PNG"))
    assert tv_decode(n.data)[0].tolist() == [[255, 255, 255], [0, 0, 0], [255, 255, 255]]


def _corner_marked(width: int, height: int, block: int = 8) -> np.ndarray:
    """Gray image with a red square block in its top-left corner."""
    arr = np.full((height, width, 3), 128, dtype=np.uint8)
    arr[:block, :block] = (255, 0, 0)
    return arr


def _is_red(block: np.ndarray) -> bool:
    mean = block.reshape(-1, 3).mean(axis=0)
    return bool(mean[0] > 200 and mean[1] < 60 and mean[2] < 60)


def test_exif_rotated_jpeg_is_stored_upright() -> None:
    # Orientation 6: the camera stored the picture rotated; viewers turn it 90° clockwise.
    # The stored top-left corner must end up at the displayed top-right.
    n = ok(exif_jpeg(_corner_marked(32, 16), orientation=6))
    assert n.stored_as == "jpeg"
    assert (n.width, n.height) == (16, 32)
    got = tv_decode(n.data)
    assert got.shape == (32, 16, 3)
    assert _is_red(got[:8, 8:]) and not _is_red(got[:8, :8])
    # The stored file carries no orientation any more: nobody will rotate it twice.
    assert Image.open(io.BytesIO(n.data)).getexif().get(0x0112) in (None, 1)


def test_exif_orientation_3_turns_the_image_half_way() -> None:
    got = tv_decode(ok(exif_jpeg(_corner_marked(32, 16), orientation=3)).data)
    assert got.shape == (16, 32, 3)
    assert _is_red(got[-8:, -8:]) and not _is_red(got[:8, :8])


def test_webp_lossless_is_re_encoded_losslessly_and_lossy_as_jpeg() -> None:
    arr = noise(8, 8, seed=4)
    lossless = ok(encode(Image.fromarray(arr), "WEBP", lossless=True))
    assert lossless.stored_as == "png"
    assert np.array_equal(tv_decode(lossless.data), arr)
    lossy = ok(encode(Image.fromarray(arr), "WEBP", quality=80))
    assert lossy.stored_as == "jpeg"


# -- resizing -------------------------------------------------------------------------------


def test_target_size_keeps_aspect_and_never_upsamples() -> None:
    assert target_size(40, 20, 10) == (10, 5)
    assert target_size(20, 40, 10) == (5, 10)
    assert target_size(1000, 3, 10) == (10, 1)  # never a zero side
    assert target_size(8, 4, 10) is None
    assert target_size(8, 4, None) is None


def test_max_side_resizes_png_and_keeps_small_images_as_they_are() -> None:
    big = ok(png(noise(40, 20, seed=5)), ImagePolicy(max_side=10))
    assert (big.width, big.height) == (10, 5) and big.stored_as == "png"
    assert tv_decode(big.data).shape == (5, 10, 3)
    small_data = png(noise(8, 4, seed=6))
    small = ok(small_data, ImagePolicy(max_side=10))
    assert small.stored_as == "original" and small.data == small_data


def test_max_side_on_a_large_jpeg_uses_high_quality_downsampling() -> None:
    # Smooth gradient: a good downsampler preserves it; nearest-neighbour or a bad draft would not.
    x = np.linspace(0, 255, 400)
    arr = np.stack([np.tile(x, (200, 1))] * 3, axis=2).astype(np.uint8)
    n = ok(jpeg(arr, quality=95), ImagePolicy(max_side=50))
    assert (n.width, n.height) == (50, 25) and n.stored_as == "jpeg"
    got = tv_decode(n.data).astype(int)
    expect = np.linspace(0, 255, 50 * 2 + 1)[1::2]  # centres of the 50 output columns
    assert np.abs(got[12, 2:-2, 0] - expect[2:-2]).max() <= 4


def test_exif_rotation_with_max_side_resizes_the_upright_image() -> None:
    n = ok(exif_jpeg(_corner_marked(128, 64, block=32), orientation=6), ImagePolicy(max_side=32))
    assert (n.width, n.height) == (16, 32)
    got = tv_decode(n.data)
    assert _is_red(got[1:7, 9:15]) and not _is_red(got[1:7, 1:7])


# -- rejections ------------------------------------------------------------------------------


def test_zero_byte_file() -> None:
    assert rejected(b"").reason is RejectReason.EMPTY_FILE


@pytest.mark.parametrize(
    "data",
    [
        b"this is a text file, not a jpeg\n",
        bytes(np.random.default_rng(7).integers(0, 256, 500, dtype=np.uint8)),
    ],
    ids=["text", "random-bytes"],
)
def test_non_images(data: bytes) -> None:
    r = rejected(data)
    assert r.reason is RejectReason.NOT_AN_IMAGE
    assert "remove it" in r.message


@pytest.mark.parametrize("fmt", ["png", "jpeg"])
def test_truncated_files(fmt: str) -> None:
    arr = noise(32, 32, seed=8)
    data = png(arr) if fmt == "png" else jpeg(arr)
    r = rejected(truncate(data, 0.6))
    assert r.reason is RejectReason.TRUNCATED
    assert "re-copy" in r.message


def test_decompression_bomb_is_rejected_from_its_header() -> None:
    data = bomb_png(100_000, 100_000)
    assert len(data) < 200  # tiny on disk...
    r = rejected(data)  # ...and rejected before 30 GB of pixels are allocated
    assert r.reason is RejectReason.TOO_LARGE


def test_max_pixels_is_checked_before_decoding() -> None:
    # A header that claims 4000x4000 with no real pixel data: decoding it would fail, so only a
    # check made on the header alone can report it as too large.
    r = rejected(bomb_png(4000, 4000), ImagePolicy(max_pixels=1_000_000))
    assert r.reason is RejectReason.TOO_LARGE
    assert "4000x4000" in r.message and "--max-pixels" in r.message


def test_sliver_has_a_bad_aspect_and_tiny_images_are_too_small() -> None:
    r = rejected(png(noise(1, 2000, seed=9)))
    assert r.reason is RejectReason.BAD_ASPECT and "--max-aspect" in r.message
    assert ok(png(noise(1, 2000, seed=9)), ImagePolicy(max_aspect=5000)).height == 2000
    small = rejected(png(noise(4, 4, seed=10)), ImagePolicy(min_side=8))
    assert small.reason is RejectReason.TOO_SMALL and "--min-side" in small.message


def test_unsupported_mode_is_rejected_not_crashed() -> None:
    im = Image.fromarray(np.array([[0.5, 1.5]], dtype=np.float32), mode="F")
    assert rejected(encode(im, "TIFF")).reason is RejectReason.UNSUPPORTED_MODE


def test_image_extensions() -> None:
    assert is_image_name("a.JPG") and is_image_name("b.jpeg") and is_image_name("c.webp")
    assert not is_image_name("notes.txt") and not is_image_name("jpg") and not is_image_name("x.jpg.bak")


@pytest.mark.parametrize("fmt", ["ICO", "TGA", "PCX", "EPS"])
def test_only_the_formats_of_image_extensions_are_decoded(fmt: str) -> None:
    # Pillow would try every decoder it has (EPS runs Ghostscript); ingest and the server
    # hand an untrusted file only to the decoders of the formats they accept.
    from visionloop.serve.images import decode
    from visionloop.serve.protocol import ProtocolError

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, format=fmt)
    data = buf.getvalue()
    assert Image.open(io.BytesIO(data)).format == fmt  # Pillow alone would decode it
    result = normalise_bytes(data, WHITE)
    assert isinstance(result, Rejection) and result.reason == RejectReason.NOT_AN_IMAGE
    with pytest.raises(ProtocolError) as e:
        decode(data)
    assert e.value.status == 415


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP", "GIF", "WEBP", "TIFF", "PPM"])
def test_every_accepted_format_is_decoded(fmt: str) -> None:
    from visionloop.serve.images import decode

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (10, 20, 30)).save(buf, format=fmt)
    assert isinstance(normalise_bytes(buf.getvalue(), WHITE), Normalised)
    assert decode(buf.getvalue()).size == (8, 8)
