"""`visionloop up --detach` when the control plane it starts exits at once: the error shows the
end of `<home>/control-plane.log`, which every start appends to, without reading it whole."""

from __future__ import annotations

import os
import socket
import tracemalloc
from pathlib import Path

import pytest

from visionloop.api.server import detach
from visionloop.core.errors import VisionloopError
from visionloop.core.settings import Settings


@pytest.mark.timeout(180)
def test_a_failed_start_shows_the_end_of_a_long_log_without_reading_it_whole(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    log = home / "control-plane.log"
    # Months of earlier starts, and a crash's NULs without a newline, before this start's lines.
    with open(log, "wb") as f:
        f.write(b"an old start\n" * 200_000)
        f.write(b"\0" * (16 << 20))
    os.chmod(log, 0o600)
    config = tmp_path / "cluster.toml"
    config.write_text("[cluster\n")  # not TOML: the child `up` refuses it and exits
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(home=home, tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    tracemalloc.start()
    try:
        with pytest.raises(VisionloopError) as e:
            detach(settings, config, None, "127.0.0.1", port, wait_s=120)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(e.value)
    assert message.startswith("the control plane exited with 1:\n"), message
    assert str(config) in message, message  # the child's own error, from the log's end
    assert "an old start" not in message and "\0" not in message, message
    assert peak < 8 << 20, f"{peak} bytes held"
