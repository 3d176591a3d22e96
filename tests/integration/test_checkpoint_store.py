"""Checkpoints copied to an S3-compatible object store (a real SeaweedFS on loopback): the
store keeps what the run keeps, a run resumes from it on a machine without its checkpoints,
a damaged copy is set aside, and an unreachable store never stops training nor lets a run
start over behind its newer checkpoints."""

from __future__ import annotations

import logging
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _s3kit import S3Server, credentials, new_bucket, start_server
from _trainkit import cli, spec_doc, write_spec
from visionloop.core.errors import CheckpointError
from visionloop.core.objectstore import ObjectStore, parse_store_uri
from visionloop.train import checkpoint as ckpt_mod
from visionloop.train.checkpoint import CheckpointManager, checkpoint_name, load_verified
from visionloop.train.checkpoint_store import CheckpointStore, run_key


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    yield from start_server()


@pytest.fixture
def bucket(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    credentials(monkeypatch)
    return new_bucket(s3)


def state(step: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(32, 16, generator=g)}, "position": {"step": step}}


def store_for(s3: S3Server, bucket: str, key: str = "runs/r1", **kw: float) -> CheckpointStore:
    store = ObjectStore(parse_store_uri(f"s3://{bucket}/team-a"), endpoint_url=s3.endpoint, **kw)  # type: ignore[arg-type]
    return CheckpointStore(store, key)


def uploads(store: CheckpointStore) -> list[str]:
    """The names `store` uploads from now on (each still goes to the server)."""
    sent: list[str] = []
    put = store.store.put

    def recording(local: Path, key: str) -> None:
        put(local, key)
        sent.append(key.rsplit("/", 1)[-1])

    store.store.put = recording  # type: ignore[method-assign]
    return sent


def manager(directory: Path, store: CheckpointStore | None, keep_last: int = 2) -> CheckpointManager:
    return CheckpointManager(directory, keep_last=keep_last, keep_best=0, store=store)


def objects(s3: S3Server, bucket: str, key: str = "runs/r1") -> dict[str, int]:
    return store_for(s3, bucket, key).store.list(f"{key}/checkpoints")


def test_the_store_keeps_exactly_what_the_run_keeps_byte_for_byte(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    m = manager(tmp_path / "ckpt", store_for(s3, bucket))
    for step in (1, 2, 3, 4):
        m.save(state(step), step=step, block=True)
    m.close()
    local = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert local == [checkpoint_name(3), checkpoint_name(4)]
    assert sorted(objects(s3, bucket)) == local
    fs = store_for(s3, bucket).store.fs
    for name in local:
        assert (
            fs.cat_file(f"{bucket}/team-a/runs/r1/checkpoints/{name}")
            == (tmp_path / "ckpt" / name).read_bytes()
        )


def test_a_run_resumes_from_the_store_on_a_machine_without_its_checkpoints(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    first = manager(tmp_path / "a", store_for(s3, bucket))
    for step in (1, 2):
        first.save(state(step), step=step, block=True)
    first.close()

    store = store_for(s3, bucket)
    sent = uploads(store)
    fresh = manager(tmp_path / "b", store)  # another machine: nothing on its disk
    found = fresh.load_latest()
    assert found is not None
    info, loaded = found
    assert info.step == 2 and torch.equal(loaded["model"]["w"], state(2)["model"]["w"])  # type: ignore[index]
    assert (tmp_path / "b" / checkpoint_name(2)).read_bytes() == (
        tmp_path / "a" / checkpoint_name(2)
    ).read_bytes()
    assert store.fetched == {checkpoint_name(2)}  # only what the search needed
    # Going on from there: the store keeps steps 2 and 3, and step 2 is not uploaded again.
    fresh.save(state(3), step=3, block=True)
    fresh.close()
    assert sorted(objects(s3, bucket)) == [checkpoint_name(2), checkpoint_name(3)]
    assert sent == [checkpoint_name(3)]


def test_a_checkpoint_rewritten_under_the_same_name_is_uploaded_again(
    s3: S3Server, bucket: str, tmp_path: Path
) -> None:
    """A run resumed from an older checkpoint writes the later steps again, with other
    contents and the same size: the name and size alone would leave the old copy there."""
    m = manager(tmp_path / "ckpt", store_for(s3, bucket), keep_last=3)
    m.save(state(1), step=1, block=True)
    m.save(state(2), step=2, block=True)
    m.close()
    # Step 2 again, from other weights, at exactly the size of the first (the trailer's
    # timestamp may change its length by a byte: written until it does not).
    target = tmp_path / "ckpt" / checkpoint_name(2)
    other = {
        "model": {"w": torch.randn(32, 16, generator=torch.Generator().manual_seed(99))},
        "position": {"step": 2},
    }
    for attempt in range(50):
        scratch = manager(tmp_path / f"scratch{attempt}", None)
        scratch.save(other, step=2, block=True)
        scratch.close()
        rewritten = tmp_path / f"scratch{attempt}" / checkpoint_name(2)
        if rewritten.stat().st_size == target.stat().st_size:
            break
    assert rewritten.stat().st_size == target.stat().st_size
    assert rewritten.read_bytes() != target.read_bytes()
    shutil.copyfile(rewritten, target)
    store = store_for(s3, bucket)
    sent = uploads(store)
    again = manager(tmp_path / "ckpt", store, keep_last=3)  # a new process
    again.save(state(3), step=3, block=True)
    again.close()
    fs = store.store.fs
    copy = fs.cat_file(f"{bucket}/team-a/runs/r1/checkpoints/{checkpoint_name(2)}")
    assert copy == (tmp_path / "ckpt" / checkpoint_name(2)).read_bytes()
    # Step 1's copy has the same trailer (checksum) as the local file: not sent again.
    assert sent == [checkpoint_name(2), checkpoint_name(3)]


def test_a_damaged_copy_is_set_aside_and_the_one_before_it_used(
    s3: S3Server, bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    m = manager(tmp_path / "a", store_for(s3, bucket))
    m.save(state(1), step=1, block=True)
    m.save(state(2), step=2, block=True)
    m.close()
    fs = store_for(s3, bucket).store.fs
    path = f"{bucket}/team-a/runs/r1/checkpoints/{checkpoint_name(2)}"
    good = fs.cat_file(path)
    fs.pipe_file(path, good[:-100] + bytes(100))  # the end (trailer) garbled

    fresh = manager(tmp_path / "b", store_for(s3, bucket))
    with caplog.at_level(logging.WARNING):
        found = fresh.load_latest()
    assert found is not None and found[0].step == 1
    assert (tmp_path / "b" / f"{checkpoint_name(2)}.corrupt").exists()
    assert "unusable" in caplog.text and checkpoint_name(2) in caplog.text
    # Searched again, the damaged copy is not downloaded a second time.
    again = store_for(s3, bucket)
    assert manager(tmp_path / "b", again).load_latest() is not None and again.fetched == set()


def test_an_unreachable_store_never_stops_training_and_the_next_checkpoint_catches_up(
    s3: S3Server, bucket: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The server stopped (SIGSTOP: connections hang, as to a store across a dead link)."""
    pid = _server_pid(s3)
    store = store_for(s3, bucket, timeout_s=1.0, attempts=1)
    m = manager(tmp_path / "ckpt", store)
    m.save(state(1), step=1, block=True)
    os.kill(pid, signal.SIGSTOP)
    try:
        with caplog.at_level(logging.WARNING):
            m.save(state(2), step=2, block=True)  # returns: the checkpoint is on local disk
        assert store.failures == 1
        assert (
            "could not copy checkpoints to s3://" in caplog.text
            and "next checkpoint tries again" in caplog.text
        )
        assert load_verified(tmp_path / "ckpt" / checkpoint_name(2))["position"] == {"step": 2}
    finally:
        os.kill(pid, signal.SIGCONT)
    m.save(state(3), step=3, block=True)
    m.close()
    assert sorted(objects(s3, bucket)) == [checkpoint_name(2), checkpoint_name(3)]
    assert store.failures == 1


def test_a_store_that_cannot_be_searched_stops_the_resume_and_loses_nothing(
    tmp_path: Path, bucket: str
) -> None:
    """Starting from an older checkpoint, or from scratch, would replace the store's newer
    ones at the next checkpoint: the trainer says so and stops instead."""
    local = tmp_path / "ckpt"
    manager(local, None).save(state(1), step=1, block=True)
    dead = ObjectStore(
        parse_store_uri(f"s3://{bucket}/x"), endpoint_url="http://127.0.0.1:9", timeout_s=1.0, attempts=1
    )
    with pytest.raises(CheckpointError) as e:
        manager(local, CheckpointStore(dead, "runs/r1")).load_latest()
    assert "cannot look for this run's checkpoints in s3://" in str(e.value)
    assert "unset checkpoint_store" in str(e.value) and "127.0.0.1:9" in str(e.value)
    assert [p.name for p in local.iterdir()] == [checkpoint_name(1)]


def test_a_copy_larger_than_this_machines_memory_is_refused_before_it_is_downloaded(
    s3: S3Server, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = manager(tmp_path / "a", store_for(s3, bucket))
    m.save({"w": torch.zeros(1 << 20)}, step=1, block=True)  # 4 MiB
    m.close()
    monkeypatch.setattr(ckpt_mod, "memory_bytes", lambda: 1 << 20)  # a small machine
    store = store_for(s3, bucket)
    fetched: list[str] = []
    get_file = store.store.fs.get_file

    def recording(remote: str, *args: object, **kw: object) -> object:
        fetched.append(remote)
        return get_file(remote, *args, **kw)

    store.store.fs.get_file = recording
    with pytest.raises(CheckpointError, match="more than this machine's memory"):
        manager(tmp_path / "b", store).load_latest()
    assert fetched == [] and not any((tmp_path / "b").iterdir())  # refused before any byte came


def test_objects_that_are_not_checkpoints_are_ignored(s3: S3Server, bucket: str, tmp_path: Path) -> None:
    """What else lies in the run's folder of the store (by hand, by another tool) is neither
    downloaded nor deleted."""
    fs = store_for(s3, bucket).store.fs
    folder = f"{bucket}/team-a/runs/r1/checkpoints"
    for name in ("notes.txt", "step-12.ckpt", "step-000000009.ckpt.bak"):
        fs.pipe_file(f"{folder}/{name}", b"x")
    m = manager(tmp_path / "a", store_for(s3, bucket))
    assert m.load_latest() is None
    m.save(state(1), step=1, block=True)
    m.close()
    assert sorted(objects(s3, bucket)) == sorted(
        [checkpoint_name(1), "notes.txt", "step-12.ckpt", "step-000000009.ckpt.bak"]
    )


def test_run_keys_are_the_run_folder_under_the_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert run_key(home / "runs" / "job-12", home) == "runs/job-12"
    assert run_key(Path("/tmp/x y/r:1"), home) == "abs/tmp/x_y/r_1"


def test_a_paused_run_whose_folder_is_gone_resumes_from_s3_and_ends_bitwise_identical(
    s3: S3Server, bucket: str, tmp_path: Path, digits_dataset: Path
) -> None:
    """`visionloop train` as a user runs it: paused after epoch 1, its whole run folder lost
    (a spot instance's disk), run again: it downloads the checkpoint and ends where a run
    never interrupted ends, tensor for tensor."""
    spec = write_spec(tmp_path / "spec.yaml", spec_doc(digits_dataset, epochs=2))
    straight = tmp_path / "straight"
    p = cli("train", str(spec), "--run-dir", str(straight), "--no-track", timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr

    env = store_env(s3, bucket)
    run = tmp_path / "run"
    p = cli(
        "train", str(spec), "--run-dir", str(run), "--no-track", "--until-epoch", "1", env=env, timeout=300
    )
    assert p.returncode == 76, p.stdout + p.stderr
    said = " ".join((p.stdout + p.stderr).split())  # as the terminal wrapped it
    assert f"checkpoints are copied to s3://{bucket}/team-a/abs/" in said
    shutil.rmtree(run)
    p = cli("train", str(spec), "--run-dir", str(run), "--no-track", env=env, timeout=300)
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 0, out
    assert f"downloaded from s3://{bucket}/team-a/abs/" in out and "resuming from step-000000022.ckpt" in out
    a, b = load_file(str(straight / "final.safetensors")), load_file(str(run / "final.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def store_env(s3: S3Server, bucket: str) -> dict[str, str]:
    """What `visionloop train` needs to copy its checkpoints to the test server."""
    return {
        "VISIONLOOP_CHECKPOINT_STORE": f"s3://{bucket}/team-a",
        "VISIONLOOP_S3_ENDPOINT_URL": s3.endpoint,
        "AWS_ACCESS_KEY_ID": "vl",
        "AWS_SECRET_ACCESS_KEY": "vl-secret",
    }


def _server_pid(s3: S3Server) -> int:
    """The weed process serving `s3` (its S3 port is in its command line)."""
    port = s3.endpoint.rsplit(":", 1)[1]
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"weed") and f"-s3.port={port}".encode() in cmd:
            return int(proc.name)
    raise AssertionError(f"no weed process for {s3.endpoint}")


def test_a_folder_store_keeps_and_restores_the_same_way(tmp_path: Path) -> None:
    """file:// (a network share): uploads land whole under their name (a temporary name
    first), and a fresh machine resumes from them."""
    shared = tmp_path / "nas"
    store = CheckpointStore(ObjectStore(parse_store_uri(f"file://{shared}")), "runs/r1")
    m = manager(tmp_path / "a", store)
    for step in (1, 2, 3):
        m.save(state(step), step=step, block=True)
    m.close()
    folder = shared / "runs" / "r1" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [checkpoint_name(2), checkpoint_name(3)]
    assert (folder / checkpoint_name(3)).read_bytes() == (tmp_path / "a" / checkpoint_name(3)).read_bytes()
    found = manager(
        tmp_path / "b", CheckpointStore(ObjectStore(parse_store_uri(f"file://{shared}")), "runs/r1")
    ).load_latest()
    assert found is not None and found[0].step == 3
    assert torch.equal(found[1]["model"]["w"], state(3)["model"]["w"])  # type: ignore[index]


def test_a_lost_run_folder_with_a_changed_spec_starts_afresh_and_leaves_the_old_copies(
    s3: S3Server, bucket: str, tmp_path: Path, digits_dataset: Path
) -> None:
    """Without its folder the run has no record of its spec: the store's copies are keyed
    by the spec's fingerprint, so another spec at the same path never resumes from them,
    nor deletes them."""
    env = store_env(s3, bucket)
    run = tmp_path / "run"
    first = write_spec(tmp_path / "a.yaml", spec_doc(digits_dataset, epochs=2))
    p = cli(
        "train", str(first), "--run-dir", str(run), "--no-track", "--until-epoch", "1", env=env, timeout=300
    )
    assert p.returncode == 76, p.stdout + p.stderr
    fs = store_for(s3, bucket).store.fs
    before = sorted(fs.find(f"{bucket}/team-a"))
    # keep_last 2: the periodic checkpoint at step 20 and the pause's at 22.
    assert [b.rsplit("/", 2)[1:] for b in before] == [
        ["checkpoints", "step-000000020.ckpt"],
        ["checkpoints", "step-000000022.ckpt"],
    ]

    shutil.rmtree(run)
    other = write_spec(tmp_path / "b.yaml", spec_doc(digits_dataset, epochs=2, optimizer__lr=0.001))
    p = cli(
        "train", str(other), "--run-dir", str(run), "--no-track", "--until-epoch", "1", env=env, timeout=300
    )
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 76, out
    assert "resuming" not in out
    after = sorted(fs.find(f"{bucket}/team-a"))
    assert set(before) < set(after) and len(after) == 4
    new = sorted(set(after) - set(before))
    assert {a.rsplit("/", 3)[0] for a in after} == {before[0].rsplit("/", 3)[0]}  # the same run key...
    assert {a.rsplit("/", 3)[1] for a in new} != {b.rsplit("/", 3)[1] for b in before}  # ...another spec hash
