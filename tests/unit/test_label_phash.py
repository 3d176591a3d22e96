"""Perceptual hashes and the near-duplicate search: the hash's bits against a scipy reference,
copies caught and different images not, hostile files refused, and the greedy in-order
search checked against a brute-force one."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import scipy.fft  # type: ignore[import-untyped]  # no type hints; comes with scikit-learn
from PIL import Image, ImageDraw, ImageFilter

import visionloop.label.phash as ph
from _imgfactory import bomb_png, encode, exif_jpeg, png
from visionloop.core.errors import DataError
from visionloop.label.phash import (
    DEFAULT_MAX_DISTANCE,
    Duplicate,
    as_hashes,
    from_hex,
    hamming,
    near_duplicates,
    phash_bytes,
    phash_file,
    phash_pixels,
    to_hex,
)


def photo(seed: int, size: tuple[int, int] = (320, 240)) -> np.ndarray:
    """A photo-like RGB image: a smooth colour field, texture, a few filled shapes."""
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    waves = [np.sin(xx / rng.uniform(20, 120) + yy / rng.uniform(20, 120) + rng.uniform(0, 6)) for _ in "rgb"]
    field = np.stack(waves, -1)
    base = 120 + 60 * field + rng.normal(0, 8, (h, w, 3))
    im = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).filter(ImageFilter.GaussianBlur(1))
    draw = ImageDraw.Draw(im)
    for _ in range(5):
        x0, y0 = int(rng.integers(0, w - 60)), int(rng.integers(0, h - 60))
        box = (x0, y0, x0 + int(rng.integers(30, 150)), y0 + int(rng.integers(30, 150)))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
    return np.asarray(im)


Copy = Callable[[np.ndarray], bytes]


def jpeg_of(arr: np.ndarray, quality: int = 90, scale: float = 1.0) -> bytes:
    im = Image.fromarray(arr)
    if scale != 1.0:
        im = im.resize((round(im.width * scale), round(im.height * scale)), Image.Resampling.LANCZOS)
    return encode(im, "JPEG", quality=quality)


# ---------------------------------------------------------------------------------------------
# The hash


def reference_phash(gray32: np.ndarray) -> int:
    """The documented hash, spelled out with scipy: unnormalised 2-D DCT-II, the 8x8 lowest
    frequencies, bit set where above their median, row-major, first coefficient as bit 63."""
    low = scipy.fft.dctn(gray32.astype(np.float64), type=2)[:8, :8].reshape(-1)
    bits = low > np.median(low)
    return sum(1 << (63 - i) for i, b in enumerate(bits) if b)


def test_hash_bits_match_a_scipy_dct_reference() -> None:
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (32, 32)) for _ in range(20)]
    images.append(np.asarray(Image.fromarray(photo(1)).convert("L").resize((32, 32))))
    got = phash_pixels(np.stack(images))
    assert got.dtype == np.uint64 and got.shape == (len(images),)
    assert [int(h) for h in got] == [reference_phash(im) for im in images]
    with pytest.raises(ValueError, match="32, 32"):
        phash_pixels(np.zeros((16, 16)))


@pytest.mark.parametrize(
    ("name", "copy"),
    [
        ("jpeg q50", lambda a: jpeg_of(a, quality=50)),
        ("halved + jpeg q75", lambda a: jpeg_of(a, quality=75, scale=0.5)),
        ("doubled, png", lambda a: png(np.asarray(Image.fromarray(a).resize((640, 480))))),
    ],
)
def test_a_resized_recompressed_copy_is_a_near_duplicate(name: str, copy: Copy) -> None:
    for seed in range(5):
        arr = photo(seed)
        original = phash_bytes(png(arr))
        assert int(hamming(original, phash_bytes(copy(arr)))) <= DEFAULT_MAX_DISTANCE, (name, seed)


def test_different_images_are_far_apart() -> None:
    hashes = as_hashes([phash_bytes(jpeg_of(photo(seed))) for seed in range(12)])
    d = hamming(hashes[:, None], hashes[None, :])[np.triu_indices(12, k=1)]
    assert d.min() > 2 * DEFAULT_MAX_DISTANCE  # distinct photo-like images differ in ~half the bits
    assert near_duplicates(hashes) == []


def test_exif_orientation_is_applied_before_hashing() -> None:
    upright = photo(3)
    stored_turned = np.ascontiguousarray(np.rot90(upright))  # a camera's sideways pixels
    tagged = phash_bytes(exif_jpeg(stored_turned, orientation=6))  # "rotate 90 CW to display"
    assert int(hamming(tagged, phash_bytes(jpeg_of(upright)))) <= DEFAULT_MAX_DISTANCE
    assert int(hamming(tagged, phash_bytes(jpeg_of(stored_turned)))) > DEFAULT_MAX_DISTANCE


def test_transparency_is_composited_on_white_like_ingest() -> None:
    rgba = np.dstack([photo(4), np.full((240, 320), 255, np.uint8)])
    rgba[:, :160, 3] = 0  # the left half transparent: white once composited
    white_left = photo(4).copy()
    white_left[:, :160] = 255
    assert phash_bytes(png(rgba)) == phash_bytes(png(white_left))


def test_a_decompression_bomb_is_refused_from_its_header(tmp_path: object) -> None:
    with pytest.raises(DataError, match=r"declares .*pixels"):
        phash_bytes(bomb_png())  # 10 billion: past Pillow's own limit, refused at open()
    with pytest.raises(DataError, match=r"12000x10000 = 120,000,000 pixels, over the limit of 100,000,000"):
        phash_bytes(bomb_png(12_000, 10_000))  # under Pillow's limit, over ours
    with pytest.raises(DataError, match="over the limit of 1,000"):
        phash_bytes(png(photo(0)), max_pixels=1000)


def test_what_is_not_an_image_says_so(tmp_path: object) -> None:
    with pytest.raises(DataError, match="not an image"):
        phash_bytes(b"%PDF-1.7 not a picture", name="scan.pdf")
    data = jpeg_of(photo(0))
    with pytest.raises(DataError, match=r"cut\.jpg cannot be decoded"):
        phash_bytes(data[: len(data) // 3], name="cut.jpg")
    with pytest.raises(DataError, match="cannot be read"):
        phash_file("/nonexistent/x.jpg")


def test_a_fifo_or_a_file_past_any_image_size_is_refused_unread(tmp_path: Path) -> None:
    from _hangkit import in_thread

    fifo = tmp_path / "stream.jpg"
    os.mkfifo(fifo)
    got = in_thread(lambda: phash_file(fifo))
    assert isinstance(got, DataError) and "is a FIFO (named pipe)" in str(got), got
    big = tmp_path / "big.jpg"
    big.write_bytes(jpeg_of(photo(1)) + b"\0" * 2048)  # past 8 bytes a pixel of 16 pixels, + 64 MiB
    with open(big, "r+b") as f:
        f.truncate(16 * 8 + 64 * 2**20 + 1)
    with pytest.raises(DataError, match="larger than"):
        phash_file(big, max_pixels=16)


def test_hash_of_a_file_equals_hash_of_its_bytes(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "a.jpg"
    data = jpeg_of(photo(7))
    path.write_bytes(data)
    assert phash_file(path) == phash_bytes(data)


# ---------------------------------------------------------------------------------------------
# Hamming distances and hash values


def test_hamming_broadcasts_and_counts_all_64_bits() -> None:
    a = as_hashes([0, 2**64 - 1, 0b1011])
    assert hamming(a, 0).tolist() == [0, 64, 3]
    assert hamming(a[:, None], a[None, :]).tolist() == [[0, 64, 3], [64, 0, 61], [3, 61, 0]]


def test_popcount_without_numpy_bitwise_count(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.random.default_rng(1).integers(0, 2**63, 1000, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    expected = [bin(int(v)).count("1") for v in x]
    monkeypatch.delattr(np, "bitwise_count", raising=False)
    assert ph._popcount(x).tolist() == expected


def test_hash_values_convert_without_loss() -> None:
    big = 2**63 + 5
    assert as_hashes([big, 3]).tolist() == [big, 3]
    assert as_hashes(np.array([-1], dtype=np.int64)).tolist() == [2**64 - 1]  # a database's int64
    assert from_hex(to_hex(big)) == big and to_hex(1) == "0000000000000001"
    with pytest.raises(ValueError, match="16 hex digits"):
        from_hex("abc")
    with pytest.raises(ValueError, match="64-bit unsigned"):
        as_hashes(np.array([1.5]))


# ---------------------------------------------------------------------------------------------
# The near-duplicate search


def test_reference_matches_name_the_nearest_training_image() -> None:
    train = [0b1111_0000, 0b1111_1111, 0]
    cand = [0b1111_1110, 0b1_1000_0000_0001, 0b1000_0000]
    found = near_duplicates(cand, train, max_distance=1)
    assert found == [Duplicate(0, 1, True, 1), Duplicate(2, 2, True, 1)]
    # equally near two training images: the earlier is named
    assert near_duplicates([0b00], [0b01, 0b10], max_distance=1) == [Duplicate(0, 0, True, 1)]


def test_threshold_is_inclusive() -> None:
    assert near_duplicates([0b111], [0], max_distance=3) == [Duplicate(0, 0, True, 3)]
    assert near_duplicates([0b1111], [0], max_distance=3) == []


def test_within_pool_keeps_the_first_of_each_group_and_dropped_ones_drop_nothing() -> None:
    # a ~ b (1 bit), b ~ c (1 bit), a !~ c (2 bits): b goes (a copy of a), c stays, since b,
    # the only candidate near it, was itself left out.
    a, b, c = 0b00, 0b01, 0b11
    assert near_duplicates([a, b, c], max_distance=1) == [Duplicate(1, 0, False, 1)]
    # Order decides who is kept: given best first, the best of a group survives.
    assert near_duplicates([b, a], max_distance=1) == [Duplicate(1, 0, False, 1)]
    # A candidate near a training image does not count as kept either.
    # b is a copy of training image 0b11; a, near b but 2 bits from 0b11, stays.
    assert near_duplicates([b, a], [0b11], max_distance=1) == [Duplicate(0, 0, True, 1)]
    assert near_duplicates([a, a], max_distance=0, within=False) == []


def brute_force(cand: list[int], ref: list[int], t: int) -> list[Duplicate]:
    out: list[Duplicate] = []
    kept: list[int] = []
    for j, h in enumerate(cand):
        dr = [(bin(h ^ r).count("1"), i) for i, r in enumerate(ref)]
        if dr and min(dr)[0] <= t:
            out.append(Duplicate(j, min(dr)[1], True, min(dr)[0]))
            continue
        dk = [(bin(h ^ cand[i]).count("1"), i) for i in kept]
        if dk and min(dk)[0] <= t:
            out.append(Duplicate(j, min(dk)[1], False, min(dk)[0]))
            continue
        kept.append(j)
    return out


@pytest.mark.parametrize("chunk_cells", [7, 64, 1 << 22])
def test_chunked_search_equals_brute_force(monkeypatch: pytest.MonkeyPatch, chunk_cells: int) -> None:
    rng = np.random.default_rng(5)
    base = [int(v) for v in rng.integers(0, 2**63, 40, dtype=np.uint64)]

    def flip(h: int, bits: int) -> int:
        for b in rng.choice(64, bits, replace=False):
            h ^= 1 << int(b)
        return h

    ref = base[:15]
    cand = [flip(base[int(i)], int(rng.integers(0, 9))) for i in rng.integers(0, 40, 120)]
    monkeypatch.setattr(ph, "_CHUNK_CELLS", chunk_cells)
    for t in (0, 3, 6):
        assert near_duplicates(cand, ref, max_distance=t) == brute_force(cand, ref, t)
        assert near_duplicates(cand, None, max_distance=t) == brute_force(cand, [], t)


def test_empty_inputs() -> None:
    assert near_duplicates([], [1, 2]) == []
    assert near_duplicates([1], []) == []
    with pytest.raises(ValueError, match="0 to 64"):
        near_duplicates([1], max_distance=65)


def test_a_copy_among_photos_is_found_end_to_end() -> None:
    photos = [photo(seed) for seed in range(6)]
    train = [phash_bytes(png(p)) for p in photos[:3]]
    pool_images = [
        jpeg_of(photos[1], quality=60, scale=0.5),  # a copy of a training image
        jpeg_of(photos[4]),
        jpeg_of(photos[4], quality=70, scale=0.75),  # a copy of the pool's previous image
        jpeg_of(photos[5]),
    ]
    pool = [phash_bytes(d) for d in pool_images]
    found = near_duplicates(pool, train)
    assert [(d.index, d.of, d.in_reference) for d in found] == [(0, 1, True), (2, 1, False)]
    assert all(isinstance(d.distance, int) for d in found)
    # and nothing pairs two different images, in any order
    for order in itertools.permutations([1, 3]):
        assert near_duplicates([pool[i] for i in order], train) == []
