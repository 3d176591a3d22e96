"""Queue jobs reach only the files their team may read: every path in a submitted spec must
lie, with symbolic links and '..' resolved, under the team's allowed roots (cluster.toml),
checked at submit (an HTTP 403 that names the field and the roots, and says nothing about
whether the path exists) and again when the job is launched. The real control plane over
HTTP on loopback, the real store and the local executor."""

from __future__ import annotations

import shutil
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _cpkit import CP, cluster_config, control_plane
from _cpkit import train_doc as _train
from _dbkit import fresh_database
from visionloop.core.errors import ConfigError
from visionloop.core.settings import load_settings
from visionloop.sched.config import parse_cluster_config

ONE_GPU = [{"node": "local", "type": "fake", "count": 1, "price_class": "owned"}]
OUTSIDE = "is outside the allowed roots"


_DIGITS: list[Path] = []


@pytest.fixture(autouse=True)
def _real_dataset(digits_dataset: Path) -> None:
    # Submit checks a dataset's manifest and shard indexes, so each folder is a real one.
    _DIGITS[:] = [digits_dataset]


def _dataset(folder: Path) -> Path:
    """A copy of the real digits dataset at `folder`."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(_DIGITS[0], folder)
    return folder


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, Path]:
    return {
        "vision": (tmp_path / "vision").resolve(),
        "research": (tmp_path / "research").resolve(),
        "secret": (tmp_path / "secret").resolve(),
    }


@pytest.fixture
def cp(tmp_path: Path, roots: dict[str, Path]) -> Iterator[CP]:
    teams = [
        {"name": "vision", "nominal_gpus": 1, "allowed_roots": [str(roots["vision"])]},
        {"name": "research", "nominal_gpus": 1, "allowed_roots": [str(roots["research"])]},
    ]
    cfg = cluster_config(inventory=ONE_GPU, teams=teams)
    with fresh_database("sqlite", tmp_path) as url, control_plane(url, cfg, run_scheduler=False) as plane:
        yield plane


def _post(cp: CP, token: str | None, spec: dict[str, Any], **fields: Any) -> tuple[int, str]:
    with cp.client(token) as c:
        r = c.post("/v1/jobs", json={"spec": spec, **fields})
    body = r.json()
    return r.status_code, str(body.get("detail", body))


def test_a_path_outside_the_roots_gets_the_same_403_whether_it_exists_or_not(
    cp: CP, roots: dict[str, Path]
) -> None:
    token = cp.team_token("vision")
    there = _dataset(roots["secret"] / "ds")
    missing = roots["secret"] / "nothing-here"
    answers = [_post(cp, token, _train(p)) for p in (there, missing)]
    assert [status for status, _ in answers] == [403, 403]
    (_, said_there), (_, said_missing) = answers
    assert OUTSIDE in said_there and "data.dataset" in said_there and str(roots["vision"]) in said_there
    # Word for word the same once the path the user gave is taken out: nothing says it exists.
    assert said_there.replace(str(there), "P") == said_missing.replace(str(missing), "P")
    with cp.client() as c:
        assert c.get("/v1/jobs").json() == []
    # Inside the roots, the usual checks apply (and may say what is there).
    status, said = _post(cp, token, _train(roots["vision"] / "nothing-here"))
    assert status == 422 and "not a dataset folder" in said


def test_symbolic_links_and_dot_dot_are_resolved_before_the_check(cp: CP, roots: dict[str, Path]) -> None:
    token = cp.team_token("vision")
    secret = _dataset(roots["secret"] / "ds")
    roots["vision"].mkdir(parents=True)
    (roots["vision"] / "link").symlink_to(secret)
    (roots["vision"] / "dirlink").symlink_to(roots["secret"])
    for path in (
        roots["vision"] / "link",
        roots["vision"] / "dirlink" / "ds",
        roots["vision"] / ".." / "secret" / "ds",
    ):
        status, said = _post(cp, token, _train(path))
        assert status == 403 and OUTSIDE in said, (path, said)
        assert str(secret) not in said  # what a link resolves to is never told
    # A link that stays inside the roots is fine.
    inside = _dataset(roots["vision"] / "real")
    (roots["vision"] / "alias").symlink_to(inside)
    status, said = _post(cp, token, _train(roots["vision"] / "alias"))
    assert status == 201, said


def test_every_path_in_the_spec_is_checked_pretrained_weights_too(cp: CP, roots: dict[str, Path]) -> None:
    token = cp.team_token("vision")
    ds = _dataset(roots["vision"] / "ds")
    outside = _train(ds)
    outside["model"]["pretrained"] = str(roots["secret"] / "w.safetensors")
    status, said = _post(cp, token, outside)
    assert status == 403 and OUTSIDE in said and "model.pretrained" in said
    relative = _train(ds)
    relative["model"]["pretrained"] = "../../secret/w.safetensors"
    status, said = _post(cp, token, relative)
    assert status == 422 and "model.pretrained" in said and "relative" in said
    inside = _train(ds)
    inside["model"]["pretrained"] = str(roots["vision"] / "w.safetensors")
    status, said = _post(cp, token, inside)
    assert status == 201, said


def test_each_team_has_its_own_roots_and_admins_are_bound_by_the_teams(
    cp: CP, roots: dict[str, Path]
) -> None:
    research_ds = _dataset(roots["research"] / "ds")
    status, said = _post(cp, cp.team_token("vision"), _train(research_ds))
    assert status == 403 and "team 'vision'" in said
    # An admin submitting for vision gets vision's roots; for research, research's.
    status, said = _post(cp, None, _train(research_ds), team="vision")
    assert status == 403 and OUTSIDE in said
    status, said = _post(cp, None, _train(research_ds), team="research")
    assert status == 201, said
    status, said = _post(cp, cp.team_token("research"), _train(research_ds))
    assert status == 201, said


def test_without_configured_roots_jobs_read_the_homes_datasets_and_weights(tmp_path: Path) -> None:
    settings = load_settings().ensure()
    cfg = parse_cluster_config({"inventory": ONE_GPU})
    home_ds = _dataset(settings.datasets_dir / "digits")
    elsewhere = _dataset(tmp_path / "elsewhere")
    with fresh_database("sqlite", tmp_path) as url, control_plane(url, cfg, run_scheduler=False) as plane:
        status, said = _post(plane, None, _train(elsewhere))
        assert status == 403 and str(settings.datasets_dir) in said and str(settings.weights_dir) in said
        spec = _train(home_ds)
        spec["model"]["pretrained"] = str(settings.weights_dir / "w.safetensors")
        status, said = _post(plane, None, spec)
        assert status == 201, said


def test_a_path_repointed_outside_after_submit_is_refused_at_launch(cp: CP, roots: dict[str, Path]) -> None:
    ok = _dataset(roots["vision"] / "ds-v1")
    secret = _dataset(roots["secret"] / "ds")
    current = roots["vision"] / "current"
    current.symlink_to(ok)
    status, said = _post(cp, cp.team_token("vision"), _train(current), gpus=0)
    assert status == 201, said
    jobs = cp.plane.store.list_jobs()
    assert len(jobs) == 1
    job_id = jobs[0].id
    current.unlink()
    current.symlink_to(secret)  # re-pointed while the job waited in the queue
    cp.plane.cycle()
    with cp.client() as c:
        show = c.get(f"/v1/jobs/{job_id}").json()
    assert show["job"]["state"] == "failed", show
    assert show["attempts"] == []  # never launched
    reason = show["transitions"][-1]["reason"]
    assert "not started" in reason and OUTSIDE in reason and "data.dataset" in reason
    assert str(secret) not in reason


# ------------------------------------------------------------------ the cluster config


def test_roots_and_the_env_allow_list_are_read_from_cluster_toml() -> None:
    cfg = parse_cluster_config(
        tomllib.loads(
            """
            [jobs]
            allowed_roots = ["/data/shared", "~/weights"]
            env_allow = ["HF_HOME", "WANDB_MODE", "HF_HOME"]
            [[teams]]
            name = "vision"
            allowed_roots = ["/data/vision"]
            [[teams]]
            name = "research"
            """
        )
    )
    assert cfg.roots_for("vision") == (Path("/data/vision"),)
    assert cfg.roots_for("research") == (Path("/data/shared"), Path("~/weights").expanduser())
    assert cfg.roots_for("nobody-configured") == cfg.allowed_roots
    assert cfg.env_allow == ("HF_HOME", "WANDB_MODE")
    assert parse_cluster_config({}).roots_for("default") is None  # the home's datasets/ and weights/


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"jobs": {"allowed_roots": "/data"}}, "jobs.allowed_roots must be a non-empty list"),
        ({"jobs": {"allowed_roots": []}}, "jobs.allowed_roots must be a non-empty list"),
        ({"jobs": {"allowed_roots": ["data/x"]}}, "data/x must be absolute"),
        ({"jobs": {"env_allow": ["NOT A NAME"]}}, "jobs.env_allow must be a list of environment variable"),
        ({"jobs": {"allowed": ["/x"]}}, "unknown keys ['allowed']"),
        ({"jobs": "x"}, "[jobs] must be a table"),
        ({"teams": [{"name": "v", "allowed_roots": ["rel"]}]}, "teams.allowed_roots: rel must be absolute"),
    ],
)
def test_bad_roots_or_env_allow_say_what_to_write(doc: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_cluster_config(doc, Path("/etc/vl/cluster.toml"))
    assert words in str(e.value) and "/etc/vl/cluster.toml" in str(e.value)
