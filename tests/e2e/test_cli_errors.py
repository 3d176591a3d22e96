"""An error the CLI prints reaches the user whole: messages quote TOML and YAML, whose
brackets Rich would otherwise read as markup and silently drop."""

from __future__ import annotations

from pathlib import Path

from _cpkit import free_port
from _trainkit import cli


def test_an_error_quoting_a_toml_section_is_printed_intact(vl_home: Path) -> None:
    (vl_home / "cluster.toml").write_text('[executor]\nkind = "ray"\nbogus = 1\n')
    r = cli("up", "--port", str(free_port()), timeout=120)
    assert r.returncode != 0
    text = " ".join(r.stderr.split())
    assert "[executor] has unknown keys ['bogus']" in text, text
