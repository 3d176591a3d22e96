"""The admin and cancel commands the way a user runs them: `admin token create`, `admin team
set`, `admin gpus`, and `jobs cancel` on a queued job, a running one and another team's.

One `visionloop up --detach` for the module (its own home, one fake owned GPU, two teams);
every command runs as a subprocess against it, with the home and token passed explicitly.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _cpkit import FAST, free_port
from _trainkit import cli, spec_doc, write_spec

CLUSTER_TOML = """
[scheduler]
{timings}

[jobs]
allowed_roots = {roots}

[[teams]]
name = "vision"
nominal_gpus = 1

[[teams]]
name = "research"
nominal_gpus = 1

[[inventory]]
node = "local"
type = "fake"
count = 1
price_class = "owned"
"""


class Home:
    """The module's control plane: its home, and the CLI run against it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def run(self, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {"VISIONLOOP_HOME": str(self.path)}
        if token is not None:
            env["VISIONLOOP_TOKEN"] = token
        # Without a token the CLI uses the admin token `up` wrote in the home.
        p = cli(*args, env=env)
        assert "Traceback" not in p.stderr, p.stderr
        return p

    def ok(self, *args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
        p = self.run(*args, token=token)
        assert p.returncode == 0, (
            f"visionloop {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}"
        )
        return p

    def refused(self, *args: str, token: str | None = None) -> str:
        p = self.run(*args, token=token)
        assert p.returncode != 0, f"visionloop {' '.join(args)} should have failed:\n{p.stdout}\n{p.stderr}"
        return p.stderr

    def show(self, job_id: int) -> dict[str, Any]:
        return dict(json.loads(self.ok("jobs", "show", str(job_id), "--json").stdout))

    def wait(self, job_id: int, pred: Any, timeout: float = 240) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        show: dict[str, Any] = {}
        while time.monotonic() < deadline:
            show = self.show(job_id)
            if pred(show["job"]):
                return show
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} never got there; last seen:\n{json.dumps(show, indent=1)[:4000]}")

    def cluster(self) -> dict[str, Any]:
        return dict(json.loads(self.ok("admin", "gpus", "--json").stdout))


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Home]:
    path = tmp_path_factory.mktemp("admin-cli-home")
    timings = "\n".join(f"{k} = {v}" for k, v in FAST.items())
    # Jobs may read under pytest's base temp folder, where the digits dataset is.
    roots = json.dumps([str(path.parent)])
    (path / "cluster.toml").write_text(CLUSTER_TOML.format(timings=timings, roots=roots))
    h = Home(path)
    h.ok("up", "--detach", "--port", str(free_port()))
    try:
        yield h
    finally:
        h.run("down")
        # Jobs outlive the control plane by design; the tests must not leave any behind.
        for state in (path / "jobs").glob("job-*/attempt-*/shim.json"):
            with contextlib.suppress(ProcessLookupError, KeyError, ValueError, PermissionError):
                os.killpg(json.loads(state.read_text())["child_pid"], signal.SIGKILL)


def _token(home: Home, *args: str) -> str:
    p = home.ok("admin", "token", "create", *args)
    (token,) = p.stdout.split()  # the token alone on stdout, so it can be captured
    assert token.startswith("vl_") and len(token) > 30
    return token


# --------------------------------------------------------------------------- tokens


def test_token_create_prints_a_token_that_authenticates_as_its_team_or_admin(home: Home) -> None:
    vision = _token(home, "--team", "vision", "--label", "alice")
    p = home.ok("admin", "token", "create", "--team", "vision")
    assert p.stdout.strip() != vision  # a new secret each time
    assert "token for team vision" in p.stderr

    # A team token authenticates, as that team: it lists jobs but may not administer.
    assert json.loads(home.ok("jobs", "list", "--json", token=vision).stdout) == []
    assert "admin" in home.refused("admin", "team", "set", "vision", "--nominal", "9", token=vision)
    assert "admin" in home.refused("admin", "token", "create", "--team", "research", token=vision)
    assert "your token belongs to team 'vision'" in home.refused(
        "jobs", "list", "--team", "research", token=vision
    )

    # An admin token made from the CLI administers.
    admin = _token(home, "--admin", "--label", "ops")
    home.ok("admin", "team", "set", "ops-made", "--nominal", "2", token=admin)
    made = _token(home, "--team", "ops-made")
    assert json.loads(home.ok("jobs", "list", "--json", token=made).stdout) == []

    assert "unknown or revoked token" in home.refused("jobs", "list", token="vl_not-a-real-token")
    assert "unknown team 'nobody'" in home.refused("admin", "token", "create", "--team", "nobody")
    assert "not both" in home.refused("admin", "token", "create")
    assert "not both" in home.refused("admin", "token", "create", "--team", "vision", "--admin")


# --------------------------------------------------------------------------- teams


def test_team_set_creates_and_changes_a_team_visible_in_the_cluster(home: Home) -> None:
    p = home.ok("admin", "team", "set", "newteam", "--nominal", "3", "--borrow", "2", "--weight", "0.5")
    assert "team newteam: nominal 3, borrow 2, weight 0.5" in p.stderr
    data = home.cluster()
    (team,) = [t for t in data["teams"] if t["name"] == "newteam"]
    assert (team["nominal_gpus"], team["borrow_limit"], team["weight"]) == (3, 2, 0.5)
    gpus = [(g["id"], g["node"], g["type"], g["price_class"], g["up"]) for g in data["gpus"]]
    assert gpus == [("local/0", "local", "fake", "owned", True)]
    # The configured teams are there as configured.
    quotas = {t["name"]: (t["nominal_gpus"], t["borrow_limit"], t["weight"]) for t in data["teams"]}
    assert quotas["vision"] == quotas["research"] == (1, 0, 1.0)

    home.ok("admin", "team", "set", "newteam", "--nominal", "1")
    (changed,) = [t for t in home.cluster()["teams"] if t["name"] == "newteam"]
    assert (changed["nominal_gpus"], changed["borrow_limit"], changed["weight"]) == (1, 0, 1.0)
    assert changed["created_at"] == team["created_at"]

    assert "team name" in home.refused("admin", "team", "set", "bad name", "--nominal", "1")
    assert "nominal_gpus" in home.refused("admin", "team", "set", "okname", "--nominal", "-1")
    names = {t["name"] for t in home.cluster()["teams"]}
    assert "bad name" not in names and "okname" not in names


# --------------------------------------------------------------------------- cancel


def test_jobs_cancel_a_queued_and_a_running_job_but_not_another_teams(
    home: Home, tmp_path: Path, digits_dataset: Path
) -> None:
    vision = _token(home, "--team", "vision")
    research = _token(home, "--team", "research")
    spec = write_spec(
        tmp_path / "long.yaml",
        {"train": spec_doc(digits_dataset, epochs=None, steps=1000, tracking__enabled=False)},
    )
    running = int(home.ok("submit", str(spec), token=vision).stdout.strip())
    home.wait(running, lambda j: j["state"] == "running")
    # The only GPU is taken: the next one waits in the queue.
    queued = int(home.ok("submit", str(spec), token=vision).stdout.strip())
    assert home.show(queued)["job"]["state"] == "queued"

    # Another team's job is "not found", exactly like a missing one, and is left alone.
    assert f"no job {running} visible to you" in home.refused("jobs", "cancel", str(running), token=research)
    assert f"no job {queued} visible to you" in home.refused("jobs", "cancel", str(queued), token=research)
    assert "no job 424242" in home.refused("jobs", "cancel", "424242", token=vision)
    assert home.show(running)["job"]["state"] == "running"
    assert home.show(queued)["job"]["state"] == "queued"

    # A queued job is cancelled at once and never runs.
    assert f"job {queued}: cancelled" in home.ok("jobs", "cancel", str(queued), token=vision).stderr
    show = home.show(queued)
    assert show["job"]["state"] == "cancelled" and show["attempts"] == []
    assert [t["to_state"] for t in show["transitions"]] == ["queued", "cancelled"]
    assert show["transitions"][-1]["reason"] == "cancelled by team vision"

    # A running one is asked to stop, then is cancelled once its process has ended.
    assert f"job {running}: cancelling" in home.ok("jobs", "cancel", str(running), token=vision).stderr
    show = home.wait(running, lambda j: j["state"] not in ("running", "cancelling"))
    assert show["job"]["state"] == "cancelled"
    assert [t["to_state"] for t in show["transitions"]] == ["queued", "running", "cancelling", "cancelled"]
    (attempt,) = show["attempts"]
    assert attempt["outcome"] == "cancelled" and attempt["ended_at"] is not None
    # Cancelling a cancelled job again changes nothing.
    assert f"job {running}: cancelled" in home.ok("jobs", "cancel", str(running), token=vision).stderr
    assert len(home.show(running)["transitions"]) == 4
