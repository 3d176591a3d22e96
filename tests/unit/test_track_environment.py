"""Environment tags, with git state read from real temporary repositories."""

from __future__ import annotations

import platform
import socket
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest

from visionloop.track.environment import environment_tags, git_tags
from visionloop.track.nvml import Nvml


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    # Never let git walk up out of the temporary directory into a surrounding repository.
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    r = tmp_path / "repo"
    r.mkdir()
    git(r, "init", "-q", "-b", "exp/augment")
    git(r, "config", "user.email", "t@example.com")
    git(r, "config", "user.name", "t")
    (r / "train.py").write_text("print('hi')\n")
    git(r, "add", "train.py")
    git(r, "commit", "-q", "-m", "first")
    return r


def test_clean_repository(repo: Path) -> None:
    tags = git_tags(repo / ".")
    head = git(repo, "rev-parse", "HEAD")
    assert tags["visionloop.git.commit"] == head
    assert tags["mlflow.source.git.commit"] == head  # what the MLflow UI shows
    assert tags["visionloop.git.branch"] == "exp/augment"
    assert tags["visionloop.git.dirty"] == "false"


def test_untracked_files_do_not_make_it_dirty_but_edits_do(repo: Path) -> None:
    (repo / "outputs.log").write_text("x\n")
    assert git_tags(repo)["visionloop.git.dirty"] == "false"
    (repo / "train.py").write_text("print('changed')\n")
    assert git_tags(repo)["visionloop.git.dirty"] == "true"


def test_detached_head_has_no_branch(repo: Path) -> None:
    git(repo, "checkout", "-q", "--detach")
    tags = git_tags(repo)
    assert "visionloop.git.branch" not in tags
    assert tags["visionloop.git.commit"] == git(repo, "rev-parse", "HEAD")


def test_outside_a_repository_there_are_no_git_tags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    plain = tmp_path / "plain"
    plain.mkdir()
    assert git_tags(plain) == {}
    empty = tmp_path / "empty"
    empty.mkdir()
    git(empty, "init", "-q")  # a repository without commits has nothing to record yet
    assert git_tags(empty) == {}


def test_environment_tags_hold_versions_machine_and_gpus(repo: Path) -> None:
    tags = environment_tags(repo)
    assert tags["visionloop.git.commit"] == git(repo, "rev-parse", "HEAD")
    assert tags["visionloop.env.python"] == platform.python_version()
    for pkg in ("mlflow", "torch", "torchvision", "litdata", "numpy", "pillow", "visionloop"):
        assert tags[f"visionloop.env.{pkg}"] == version(pkg)
    assert tags["visionloop.env.hostname"] == socket.gethostname()
    assert tags["visionloop.env.platform"] == platform.platform()
    import torch

    assert tags.get("visionloop.env.cuda") == (str(torch.version.cuda) if torch.version.cuda else None)
    with Nvml() as nv:
        names = [g.name for g in nv.gpus]
    if names:
        assert tags["visionloop.env.gpu_count"] == str(len(names))
        assert tags["visionloop.env.gpus"] == ", ".join(names)
    else:
        assert "visionloop.env.gpus" not in tags


def test_cuda_visible_devices_hides_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with Nvml() as nv:
        assert nv.gpus == []
    assert "visionloop.env.gpus" not in environment_tags()
