"""Configuration files an admin writes (cluster.toml, visionloop.toml, the price and device
catalogs, alerts.toml), fed what a careless admin or an attacker would: each gets a clear
ConfigError naming the file and the key, never a crash, a hang, a memory blow-up or a silent
fall back to the defaults."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from visionloop.alerts.rules import load_config
from visionloop.core.errors import ConfigError
from visionloop.core.settings import load_settings
from visionloop.sched.config import load_cluster_config
from visionloop.sched.prices import load_catalog
from visionloop.size.api import device_catalog
from visionloop.size.catalog import load_devices

BIG = "9" * 400  # a TOML integer: fine to parse, too large for a float
DEEP = "x = " + "[" * 3000 + "]" * 3000  # tomllib recurses once per level


def _cluster(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def _cluster_error(tmp_path: Path, text: str | bytes) -> str:
    path = _cluster(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_cluster_config(path)
    return str(e.value)


# --------------------------------------------------------------------------- cluster.toml


@pytest.mark.parametrize(
    ("text", "says"),
    [
        # Before: UnicodeDecodeError, RecursionError and OverflowError tracebacks.
        (b"[scheduler]\ncycle_s = 2\n# \xff\xfe\n", "is not UTF-8 text ("),
        (DEEP, "is not valid TOML: it nests too deeply. Fix it, or remove it for the defaults."),
        ("[scheduler]\ncycle_s = " + "9" * 5000, "Exceeds the limit (4300 digits)"),
        (
            f"[scheduler]\ncycle_s = {BIG}",
            "cycle_s must be a finite number >= 0.05, got " + "9" * 77 + "... (e.g. cycle_s = 2.0).",
        ),
        (
            f'[[teams]]\nname = "a"\nweight = {BIG}',
            "weight must be a finite number >= 0.001, got " + "9" * 77 + "... (e.g. weight = 1.0).",
        ),
        # Before: accepted; Event.wait(1e300) then raised OverflowError in the control plane.
        ("[scheduler]\ncycle_s = 1e300", "cycle_s must be at most 1e+09, got 1e+300 (e.g. cycle_s = 2.0)."),
        (
            '[executor]\nkind = "ray"\nrequest_timeout_s = 1e300',
            "request_timeout_s must be at most 1e+09, got 1e+300 (e.g. request_timeout_s = 30.0).",
        ),
        # Before: accepted (fair-share sums of two such weights are inf).
        (
            '[[teams]]\nname = "a"\nweight = 1e308',
            "weight must be at most 1e+06, got 1e+308 (e.g. weight = 1.0).",
        ),
        # Before: accepted, then overflowed the job store's INTEGER columns.
        (
            f'[[teams]]\nname = "a"\nnominal_gpus = {"9" * 30}',
            f"nominal_gpus must be at most 100000, got {'9' * 30} (e.g. nominal_gpus = 2).",
        ),
        ('[[teams]]\nname = "a"\nborrow_limit = -1', "borrow_limit must be a whole number >= 0, got -1"),
        (f"[priorities]\nlow = {'9' * 30}", f"low must be at most 1000000, got {'9' * 30} (e.g. low = 50)."),
        # Before: a string was read as its characters ("unknown keys ['x']"); "" and [] crashed.
        ('scheduler = ""', "[scheduler] must be a table, got ''; e.g.\n[scheduler]\ncycle_s = 2.0"),
        ("scheduler = []", "[scheduler] must be a table, got []; e.g.\n[scheduler]\ncycle_s = 2.0"),
        # Before: "[[teams]] entries must be tables with a name" for a table that is one.
        (
            '[teams]\nname = "a"',
            "teams must be a list of [[teams]] tables (two brackets), got {'name': 'a'}; "
            'e.g.\n[[teams]]\nname = "detection"',
        ),
        (
            'inventory = "abc"',
            "inventory must be a list of [[inventory]] tables (two brackets), got 'abc'; "
            "e.g.\n[[inventory]]\ncount = 2",
        ),
        # Before: accepted; "é" composed passed and decomposed failed, look-alikes were two teams.
        (
            '[[teams]]\nname = "dé²"',
            "teams.name must be a name of 1 to 64 ASCII letters, digits, '-', '_' or '.', got 'dé²' "
            '(e.g. name = "detection").',
        ),
        (
            '[[inventory]]\nnode = "gpu\\u0000"',
            "inventory.node must be a name of 1 to 64 ASCII letters, digits, '-', '_' or '.', got 'gpu\\x00' "
            '(e.g. node = "gpu-1").',
        ),
        (
            '[[teams]]\nname = "' + "a" * 5000 + '"',
            "teams.name must be a name of 1 to 64 ASCII letters, digits, '-', '_' or '.', got '"
            + "a" * 76
            + '... (e.g. name = "detection").',
        ),
        # Before: "a team is listed twice", without saying which.
        (
            '[[teams]]\nname = "b"\n[[teams]]\nname = "a"\n[[teams]]\nname = "a"\n[[teams]]\nname = "b"',
            "[[teams]]: ['a', 'b'] listed more than once; merge each into one [[teams]] table.",
        ),
        # Before: "" became the config's own folder; a NUL crashed the first job path check.
        (
            'prices = ""',
            "prices must be the path of a TOML file, got '' (e.g. prices = \"prices.toml\"); "
            "remove the key for the shipped catalog.",
        ),
        (
            '[jobs]\nallowed_roots = ["/data\\u0000x"]',
            "jobs.allowed_roots must be a non-empty list of folders, got ['/data\\x00x'] "
            '(e.g. allowed_roots = ["/data/detection"]).',
        ),
        (
            "[jobs]\nmax_queued_per_team = -1",
            "jobs.max_queued_per_team must be a whole number >= 0, got -1 (e.g. max_queued_per_team = 2000).",
        ),
        (
            "[jobs]\nmax_queued_per_team = true",
            "jobs.max_queued_per_team must be a whole number >= 0, got True",
        ),
        (
            "[jobs]\nmax_queued_per_team = 100000000",
            "jobs.max_queued_per_team must be at most 10000000, got 100000000",
        ),
        # Before: accepted, failing at the first request.
        (
            '[executor]\nkind = "ray"\naddress = "http://head:99999"',
            "executor.address must be the Ray dashboard's URL, got 'http://head:99999'; e.g.",
        ),
        (
            '[executor]\nkind = "ray"\naddress = "http://he ad:8265"',
            "executor.address must be the Ray dashboard's URL, got 'http://he ad:8265'; e.g.",
        ),
    ],
)
def test_a_hostile_cluster_config_is_refused_naming_the_key(
    tmp_path: Path, text: str | bytes, says: str
) -> None:
    message = _cluster_error(tmp_path, text)
    assert says in message
    assert str(tmp_path / "cluster.toml") in message


def test_an_inventory_past_the_limit_is_refused_before_its_gpus_are_built(tmp_path: Path) -> None:
    # Before: `count = 1000000000` built a billion Gpu objects (memory, then every cycle).
    one = _cluster_error(tmp_path, '[[inventory]]\nnode = "a"\ncount = 100001')
    assert one.endswith("count must be at most 100000, got 100001 (e.g. count = 4).")
    total = _cluster_error(
        tmp_path, '[[inventory]]\nnode = "a"\ncount = 60000\n[[inventory]]\nnode = "b"\ncount = 60000'
    )
    assert total.endswith(
        "[[inventory]] lists more than 100000 GPUs (the limit of one inventory); check each entry's "
        "count, e.g. count = 4."
    )
    # The limit itself is fine, and ids stay unique across entries on one node.
    config = load_cluster_config(
        _cluster(tmp_path, '[[inventory]]\nnode = "a"\ncount = 2\n[[inventory]]\nnode = "a"\ncount = 1')
    )
    assert config.inventory is not None
    assert [g.id for g in config.inventory] == ["a/0", "a/1", "a/2"]


def test_a_cluster_config_that_is_not_a_regular_file_is_refused_not_taken_for_missing(tmp_path: Path) -> None:
    # Before: is_file() was False for these, so `up` started the one-machine default (all GPUs
    # to one team) without a word.
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError) as e:
        load_cluster_config(fifo)
    assert str(e.value) == (
        f"cluster config {fifo} is a FIFO (named pipe), not a regular file. "
        "Fix it, or remove it for the defaults."
    )
    folder = tmp_path / "dir.toml"
    folder.mkdir()
    with pytest.raises(ConfigError, match="is a folder, not a regular file"):
        load_cluster_config(folder)
    link = tmp_path / "zero.toml"
    link.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="is a device, not a regular file"):
        load_cluster_config(link)
    # A missing file is still the default.
    assert load_cluster_config(tmp_path / "missing.toml").inventory is None


def test_a_huge_cluster_config_is_refused_unread(tmp_path: Path) -> None:
    # Before: read whole into memory (one enormous line included).
    message = _cluster_error(tmp_path, 'prices = "' + "a" * (1024 * 1024 + 10) + '"')
    assert message == (
        f"cluster config {tmp_path / 'cluster.toml'} is larger than 1024 KiB, too large to be one; check "
        "that --config names the right file. Fix it, or remove it for the defaults."
    )


def test_up_refuses_a_config_path_that_does_not_exist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from visionloop.api import server
    from visionloop.cli.queue import up

    class StartedError(Exception):
        pass

    def started(*args: object) -> None:
        raise StartedError(args[1])  # the config path

    # Without the check, `up` goes on to serve: fail here instead of binding a port.
    monkeypatch.setattr(server, "serve", started)
    monkeypatch.setattr(server, "detach", started)
    # Before: a mistyped --config started the control plane on the defaults.
    missing = tmp_path / "clustre.toml"
    with pytest.raises(ConfigError) as e:
        up(host="127.0.0.1", port=1, config=missing, db=None, db_url_file=None, detach=False)
    assert str(e.value) == (
        f"no cluster config at {missing}; check the path given to --config, or leave it out for "
        "<home>/cluster.toml (the one-machine default when that is missing)."
    )
    # The home's own cluster.toml may be missing, named or not (a detached `up` names it): the
    # one-machine default, as before.
    home_config = load_settings().home / "cluster.toml"
    for given in (None, home_config):
        with pytest.raises(StartedError) as started_with:
            up(host="127.0.0.1", port=1, config=given, db=None, db_url_file=None, detach=False)
        assert started_with.value.args == (home_config.resolve(),)


# --------------------------------------------------------------------------- visionloop.toml


def _settings_error(tmp_path: Path, text: str | bytes) -> str:
    (tmp_path / "visionloop.toml").write_bytes(text.encode() if isinstance(text, str) else text)
    with pytest.raises(ConfigError) as e:
        load_settings(tmp_path)
    return str(e.value)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (b"home = '/tmp/x'\n# \xff\n", "visionloop.toml is not UTF-8 text ("),
        (DEEP, "visionloop.toml is not valid TOML: it nests too deeply. Fix the file or remove it."),
        # Before: ValueError "embedded null byte" from every command.
        (
            'home = "/tmp/a\\u0000b"',
            "visionloop.toml: home must be non-empty strings of printable characters, "
            'e.g. home = "/data/vl".',
        ),
        ("#" * (64 * 1024 + 1), "visionloop.toml is larger than 64 KiB, too large for settings."),
    ],
)
def test_a_hostile_settings_file_is_refused(tmp_path: Path, text: str | bytes, says: str) -> None:
    assert says in _settings_error(tmp_path, text)


def test_a_settings_file_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    # Before: silently skipped (is_file() is False), so its home and tracking URI were lost.
    os.mkfifo(tmp_path / "visionloop.toml")
    with pytest.raises(ConfigError) as e:
        load_settings(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / 'visionloop.toml'} is a FIFO (named pipe), not a regular file. "
        "Fix the file or remove it."
    )


def test_visionloop_home_that_is_not_a_folder_is_refused_naming_the_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: accepted; every command then failed with "Not a directory: .../runs".
    a_file = tmp_path / "file"
    a_file.write_text("x")
    monkeypatch.setenv("VISIONLOOP_HOME", str(a_file))
    with pytest.raises(ConfigError) as e:
        load_settings(tmp_path)
    assert str(e.value) == (
        f"VISIONLOOP_HOME={a_file}: {a_file} is not a folder; the visionloop home must be one. Point it "
        "at a folder, e.g. VISIONLOOP_HOME=~/.visionloop (it is created if missing)."
    )
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setenv("VISIONLOOP_HOME", str(fifo))
    with pytest.raises(ConfigError, match="is not a folder; the visionloop home must be one"):
        load_settings(tmp_path)
    # Before: RuntimeError "Symlink loop" from resolve().
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    monkeypatch.setenv("VISIONLOOP_HOME", str(loop))
    with pytest.raises(ConfigError) as e:
        load_settings(tmp_path)
    assert str(e.value).startswith(f"VISIONLOOP_HOME={loop}: cannot use it as the visionloop home (")
    assert str(e.value).endswith("e.g. VISIONLOOP_HOME=~/.visionloop (it is created if missing).")


def test_a_home_in_the_settings_file_that_is_a_file_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VISIONLOOP_HOME")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    message = _settings_error(tmp_path, f'home = "{a_file}"')
    assert message == (
        f"home in {tmp_path / 'visionloop.toml'}: {a_file} is not a folder; the visionloop home must be "
        'one. Point it at a folder, e.g. home = "/data/vl" (it is created if missing).'
    )


# --------------------------------------------------------------------------- catalogs


def _file(tmp_path: Path, text: str, name: str = "x.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (DEEP, "is not valid TOML (it nests too deeply); a valid entry:"),
        ("[gpus.a]\nowned = " + "9" * 5000, "is not valid TOML (Exceeds the limit (4300 digits)"),
        # Before: OverflowError from math.isfinite.
        (
            f"[gpus.a]\nowned = {BIG}\non_demand = 1\nspot = 1",
            '[gpus."a"]: owned = ' + "9" * 77 + "... is not a price; give USD per GPU-hour as a number "
            "from 0 to 10000, e.g.",
        ),
        # Before: accepted; the bill overflowed to inf.
        (
            "[gpus.a]\nowned = 1e300\non_demand = 1\nspot = 1",
            "owned = 1e+300 is not a price; give USD per GPU-hour as a number from 0 to 10000",
        ),
    ],
)
def test_a_hostile_price_catalog_is_refused(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_catalog(_file(tmp_path, text))
    assert says in str(e.value)


_DEVICE = '[devices.a]\nsource = "s"\nfp16_tflops = 1\nmemory_gib = 1\nbandwidth_gbs = 1\n'


@pytest.mark.parametrize(
    ("text", "says"),
    [
        (DEEP, "is not valid TOML (it nests too deeply); a valid entry:"),
        # Before: OverflowError from math.isfinite.
        (
            _DEVICE + f"fp32_tflops = {BIG}",
            "fp32_tflops = " + "9" * 77 + "... is not a figure; give a number > 0 and at most 1e+09",
        ),
        (
            f"sustained_fraction = {BIG}\n" + _DEVICE + "fp32_tflops = 1",
            "sustained_fraction = " + "9" * 77 + "... must be a number in (0, 1]",
        ),
        # Before: accepted; x 1e12 is inf, a device "done" in zero seconds.
        (
            _DEVICE + "fp32_tflops = 1e300",
            "fp32_tflops = 1e+300 is not a figure; give a number > 0 and at most 1e+09",
        ),
    ],
)
def test_a_hostile_device_catalog_is_refused(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_devices(_file(tmp_path, text))
    assert says in str(e.value)


def test_a_devices_toml_in_the_home_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    # Before: silently replaced by the shipped catalog (other figures, other recommendations).
    settings = load_settings(tmp_path)
    settings.home.mkdir(parents=True, exist_ok=True)
    os.mkfifo(settings.home / "devices.toml")
    with pytest.raises(ConfigError) as e:
        device_catalog(None, settings)
    assert str(e.value) == (
        f"device catalog {settings.home / 'devices.toml'} is a FIFO (named pipe), not a regular file; "
        "give the path of a TOML file, or leave --catalog out."
    )


# --------------------------------------------------------------------------- alerts.toml


@pytest.mark.parametrize(
    ("name", "text", "says"),
    [
        # Before: OverflowError from math.isfinite.
        (
            "a.toml",
            f"[rules.queue_wait]\nmax_minutes = {BIG}",
            "rules.queue_wait.max_minutes must be a number >= 0, got " + "9" * 77 + "....",
        ),
        (
            "a.toml",
            f"[rules.drift]\nwindows = {BIG}",
            "rules.drift.windows must be an integer from 1 to 1000, got " + "9" * 77 + "....",
        ),
        # Before: TypeError from difflib on a number key.
        ("a.yaml", "rules:\n  1: {}", "there is no rule [rules.1]. The rules are: drift,"),
        # Before: the whole list came back in the message.
        (
            "a.yaml",
            "rules: " + str(list(range(20000))),
            "rules must be a table, e.g. [rules], got [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, "
            "16, 17, 18, 19, 20, 21....",
        ),
        ("a.toml", DEEP, "is not valid TOML: it nests too deeply. Fix it, or remove it for the defaults."),
        # Before: accepted; exists() is False for it, so GPU time was priced by the default config.
        (
            "a.toml",
            '[sources]\ncluster_config = "c\\u0000.toml"',
            "sources.cluster_config must be a non-empty string of printable characters. Write e.g. "
            'cluster_config = "/etc/visionloop/cluster.toml"',
        ),
    ],
)
def test_a_hostile_alert_config_is_refused(tmp_path: Path, name: str, text: str, says: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(_file(tmp_path, text, name), tmp_path)
    assert says in str(e.value)
    assert len(str(e.value)) < 1000


def test_an_alert_config_that_is_a_fifo_is_refused(tmp_path: Path) -> None:
    # Before: the home's was silently skipped (every rule at its default), and --config said
    # "no alert config at ...; write one with `alerts init`".
    os.mkfifo(tmp_path / "alerts.toml")
    for given in (None, tmp_path / "alerts.toml"):
        with pytest.raises(ConfigError) as e:
            load_config(given, tmp_path)
        assert str(e.value) == (
            f"cannot read the alert config {tmp_path / 'alerts.toml'}: is a FIFO (named pipe), not a "
            "regular file; remove it or replace it."
        )


def test_the_queue_limit_defaults_to_two_thousand_and_zero_means_none() -> None:
    from visionloop.sched.config import parse_cluster_config

    assert parse_cluster_config({}).max_queued_per_team == 2000
    assert parse_cluster_config({"jobs": {"max_queued_per_team": 5}}).max_queued_per_team == 5
    assert parse_cluster_config({"jobs": {"max_queued_per_team": 0}}).max_queued_per_team is None
