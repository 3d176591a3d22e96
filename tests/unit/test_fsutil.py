"""core.fsutil's bounded reads: `read_capped` and `read_capped_text` read a regular file whole
up to a limit, refuse a FIFO, device or folder before a byte is read (a FIFO must not hang the
reader), and name the file, the limit and what to do in their errors."""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest

from _hangkit import in_thread
from visionloop.core.fsutil import (
    LongLine,
    NotRegularFileError,
    NotTextError,
    TooLargeError,
    capped_lines,
    human_bytes,
    json_objects,
    read_capped,
    read_capped_text,
    tail_lines,
)

LIMIT = 64 * 1024


def _file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("size", [0, 1, LIMIT - 1, LIMIT])
def test_a_file_under_or_at_the_limit_is_read_whole(tmp_path: Path, size: int) -> None:
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    assert read_capped(_file(tmp_path, data), LIMIT, what="a test file") == data


def test_a_file_one_byte_over_the_limit_is_refused_from_its_size(tmp_path: Path) -> None:
    path = _file(tmp_path, b"x" * (LIMIT + 1))
    with pytest.raises(TooLargeError) as e:
        read_capped(path, LIMIT, what="a test file")
    assert str(e.value) == (
        f"{path} is larger than 64 KiB, the limit for a test file; check that it is the right file"
    )
    assert (e.value.filename, e.value.limit, e.value.size) == (str(path), LIMIT, LIMIT + 1)
    assert isinstance(e.value, ValueError) and not isinstance(e.value, OSError)


def test_a_file_whose_size_is_not_reported_is_refused_after_limit_plus_one_bytes(tmp_path: Path) -> None:
    # /proc files report size 0 and hold more: the fstat check passes, the read catches it.
    status = Path("/proc/self/status")
    if not status.is_file():
        pytest.skip("needs Linux /proc")
    with pytest.raises(TooLargeError) as e:
        read_capped(status, 16, what="a status")
    assert e.value.size is None
    assert len(read_capped(status, 1 << 20, what="a status")) > 16


@pytest.mark.parametrize("read", [read_capped, read_capped_text])
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path, read: Callable[..., object]) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # opening it blocking would wait for a writer forever
    got = in_thread(lambda: read(fifo, LIMIT, what="a test file"))
    assert isinstance(got, NotRegularFileError), got
    assert str(got) == f"{fifo} is a FIFO (named pipe), not a regular file; remove it or replace it"


def test_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(NotRegularFileError, match="is a folder, not a regular file"):
        read_capped(tmp_path, LIMIT, what="a test file")


def test_a_device_is_refused(tmp_path: Path) -> None:
    if not Path("/dev/zero").exists():
        pytest.skip("needs /dev/zero")
    with pytest.raises(NotRegularFileError, match="is a device"):
        read_capped("/dev/zero", LIMIT, what="a test file")  # would never end


def test_a_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_capped(tmp_path / "nowhere", LIMIT, what="a test file")
    with pytest.raises(FileNotFoundError):
        read_capped_text(tmp_path / "nowhere", LIMIT, what="a test file")


def test_text_is_strict_utf8(tmp_path: Path) -> None:
    assert read_capped_text(_file(tmp_path, "grüße\n".encode()), LIMIT, what="a test file") == "grüße\n"
    path = _file(tmp_path, b"ok\n\xff\xfe")
    with pytest.raises(UnicodeDecodeError) as e:  # what callers catch today
        read_capped_text(path, LIMIT, what="a test file")
    assert isinstance(e.value, NotTextError)
    assert (e.value.start, e.value.reason) == (3, "invalid start byte")
    assert e.value.detail == "'utf-8' codec can't decode byte 0xff in position 3: invalid start byte"
    assert str(e.value) == f"{path} is not UTF-8 text ({e.value.detail}); save it as UTF-8."


def test_a_byte_order_mark_is_kept_or_dropped_as_asked(tmp_path: Path) -> None:
    path = _file(tmp_path, b"\xef\xbb\xbfa,b\n")
    assert read_capped_text(path, LIMIT, what="a CSV") == "\ufeffa,b\n"
    assert read_capped_text(path, LIMIT, what="a CSV", encoding="utf-8-sig") == "a,b\n"


def test_text_over_the_limit_is_too_large_not_undecodable(tmp_path: Path) -> None:
    with pytest.raises(TooLargeError):
        read_capped_text(_file(tmp_path, b"\xff" * (LIMIT + 1)), LIMIT, what="a test file")


def test_the_errors_survive_a_process_pool(tmp_path: Path) -> None:
    too_large = TooLargeError(tmp_path / "f", LIMIT, "a test file", 7)
    again = pickle.loads(pickle.dumps(too_large))
    assert (str(again), again.size) == (str(too_large), 7)
    with pytest.raises(NotTextError) as e:
        read_capped_text(_file(tmp_path, b"\xff"), LIMIT, what="a test file")
    again_text = pickle.loads(pickle.dumps(e.value))
    assert (type(again_text), str(again_text)) == (NotTextError, str(e.value))


@pytest.mark.parametrize(
    ("n", "shown"),
    [
        (1, "1 byte"),
        (1536, "1536 bytes"),
        (64 * 1024, "64 KiB"),
        (1024 * 1024, "1 MiB"),
        (3 * 2**30, "3 GiB"),
    ],
)
def test_limits_are_shown_exactly_in_binary_units(n: int, shown: str) -> None:
    assert human_bytes(n) == shown


# ----------------------------------------------------------------------------- logs, line by line


class _CountingReader(io.BytesIO):
    """Records the most bytes one `readline` returned, to show what a reader held at once."""

    most = 0

    def readline(self, size: int | None = -1, /) -> bytes:
        line = super().readline(size)
        self.most = max(self.most, len(line))
        return line


def test_lines_within_the_limit_come_whole_with_their_numbers() -> None:
    data = b"a\n" + b"x" * 8 + b"\n\nlast, no newline"
    got = list(capped_lines(io.BytesIO(data), 16))
    assert got == [(1, b"a\n"), (2, b"x" * 8 + b"\n"), (3, b"\n"), (4, b"last, no newline")]


def test_the_limit_counts_the_line_without_its_newline() -> None:
    exact, over = b"y" * 8 + b"\n", b"z" * 9 + b"\n"
    got = list(capped_lines(io.BytesIO(exact + over + exact), 8))
    assert got == [(1, exact), (2, LongLine(10)), (3, exact)]
    assert list(capped_lines(io.BytesIO(b"q" * 9), 8)) == [(1, LongLine(9))]  # the last, unended


def test_a_long_line_is_skipped_without_being_held_and_the_next_is_read() -> None:
    # A crash can leave megabytes of NULs without a newline in a log: the reader holds at most
    # the limit plus one byte of it, or the skipping block, and goes on after it.
    junk = b"\0" * (3 << 20)
    f = _CountingReader(b"ok\n" + junk + b"\nafter\n")
    got = list(capped_lines(f, 64))
    assert got == [(1, b"ok\n"), (2, LongLine(len(junk) + 1)), (3, b"after\n")]
    assert f.most <= 1 << 20


def _log(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "x.log"
    path.write_bytes(data)
    return path


def test_the_tail_of_a_log_is_its_last_lines(tmp_path: Path) -> None:
    path = _log(tmp_path, b"".join(b"line %d\n" % i for i in range(100)))
    assert tail_lines(path, 3) == ["line 97", "line 98", "line 99"]
    assert tail_lines(path, 1000) == [f"line {i}" for i in range(100)]
    assert tail_lines(path, 0) == []
    assert tail_lines(_log(tmp_path, b""), 5) == []


def test_the_tail_reads_only_the_end_and_drops_the_line_the_window_cut(tmp_path: Path) -> None:
    # The last line is 5 bytes: a 13-byte window starts inside the line before it.
    path = _log(tmp_path, b"0123456789\n" * 1000 + b"end\xff\n")
    assert tail_lines(path, 10, max_bytes=13) == ["end\ufffd"]  # not "3456789"; bad UTF-8 replaced
    assert tail_lines(path, 2, max_bytes=1 << 20) == ["0123456789", "end\ufffd"]


def test_the_tail_of_a_fifo_is_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "control-plane.log"
    os.mkfifo(fifo)
    got = in_thread(lambda: tail_lines(fifo, 15))
    assert isinstance(got, NotRegularFileError), got


def test_json_objects_yields_the_objects_and_skips_every_other_line() -> None:
    data = b"\n".join(
        [
            b'{"a": 1}',
            b"[1, 2]",  # not an object
            b'{"torn": ',
            b'{"bad": "\xff"}',  # not UTF-8
            b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's recursion limit
            b'{"b": 2}',
        ]
    )
    assert list(json_objects(io.BytesIO(data), 100_000 * 2)) == [{"a": 1}, {"b": 2}]
    long = b'{"long": "' + b"x" * 200 + b'"}\n{"c": 3}'
    assert list(json_objects(io.BytesIO(long), 64)) == [{"c": 3}]  # the line past the limit skipped
