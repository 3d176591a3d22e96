"""The control plane on Ray, chosen by configuration alone (`[executor] kind = "ray"`):
the config's validation, what `build_plane` builds and refuses, how the cycle copes with an
executor that cannot answer or could not start a job, and, end to end on the session's real
two-node Ray cluster (tests/_raysession.py), the real trainer preempted by a higher-priority
job through SIGTERM → checkpoint → exit 75 → requeue → resume.

Both Ray nodes run on this machine, so the dataset, VISIONLOOP_HOME and run dirs are valid
for them as they are.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import textwrap
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _cpflows import preempt_and_resume
from _cpkit import TEAMS, cluster_config, control_plane
from _cpkit import train_doc as _train
from _dbkit import fresh_database
from _raykit import RayCluster
from visionloop.api.server import build_plane
from visionloop.core.errors import ConfigError, ExecutorError, ExecutorUnavailableError
from visionloop.core.settings import load_settings
from visionloop.sched import config as config_module
from visionloop.sched.config import parse_cluster_config
from visionloop.sched.config_executor import DEFAULT_RAY_ADDRESS
from visionloop.sched.executors.base import AttemptStatus, Handle, LaunchRequest
from visionloop.sched.executors.ray import RayExecutor
from visionloop.sched.service import ControlPlane, Principal
from visionloop.sched.store import GONE_REASON, Store
from visionloop.sched.view import Gpu

pytest_plugins = ["_raysession"]  # the session's Ray cluster: `ray_cluster`

ADMIN = Principal(team=None, admin=True)


# -- the [executor] section ----------------------------------------------------------------------


def _docstring_example() -> str:
    doc = config_module.__doc__ or ""
    start = doc.index("priority classes.\n\n") + len("priority classes.\n\n")
    return textwrap.dedent(doc[start : doc.index("\n\nWith `kind")])


def test_the_documented_example_parses_and_its_ray_and_slurm_variants_refuse_an_inventory() -> None:
    cfg = parse_cluster_config(tomllib.loads(_docstring_example()))
    assert cfg.executor.kind == "local" and cfg.inventory is not None and len(cfg.inventory) == 4
    assert cfg.prices == Path("prices.toml") and [t.name for t in cfg.teams] == ["detection"]
    for kind in ("ray", "slurm"):
        other = (
            _docstring_example()
            .replace('kind = "local"', "")
            .replace(f'# kind = "{kind}"', f'kind = "{kind}"')
        )
        with pytest.raises(ConfigError, match=rf'\[\[inventory\]\] lists GPUs .* executor.kind is "{kind}"'):
            parse_cluster_config(tomllib.loads(other))


def test_the_executor_defaults_to_local_and_ray_to_the_local_dashboard() -> None:
    assert parse_cluster_config({}).executor.kind == "local"
    ray = parse_cluster_config({"executor": {"kind": "ray"}}).executor
    assert (ray.kind, ray.address, ray.prefix) == ("ray", DEFAULT_RAY_ADDRESS, "vl")
    ray = parse_cluster_config(
        {
            "executor": {
                "kind": "ray",
                "address": "https://head:8265/",
                "prefix": "vl-cv",
                "request_timeout_s": 5,
            }
        }
    ).executor
    assert (ray.address, ray.prefix, ray.request_timeout_s) == ("https://head:8265", "vl-cv", 5.0)


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"executor": "ray"}, "must be a table"),
        ({"executor": {"kind": "k8s"}}, 'executor.kind must be "local", "ray" or "slurm"'),
        ({"executor": {"kind": "ray", "adress": "http://h:8265"}}, "unknown keys ['adress']"),
        ({"executor": {"address": "http://h:8265"}}, 'only apply to kind = "ray"'),
        ({"executor": {"kind": "ray", "address": "ray://head:10001"}}, "Ray Client"),
        ({"executor": {"kind": "ray", "address": "head:6379"}}, "not the GCS port 6379"),
        ({"executor": {"kind": "ray", "prefix": "Team_A"}}, "executor.prefix must be lower-case"),
        (
            {"executor": {"kind": "ray", "request_timeout_s": 0}},
            "request_timeout_s must be a finite number >= 1",
        ),
        ({"executor": {"kind": "ray"}, "inventory": [{"count": 1}]}, "Remove [[inventory]]"),
        ({"inventory": [{"count": 1, "prices": "p.toml"}]}, "belongs to that table"),
    ],
)
def test_a_bad_executor_section_says_what_to_write(doc: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_cluster_config(doc, Path("/etc/vl/cluster.toml"))
    assert words in str(e.value) and "/etc/vl/cluster.toml" in str(e.value)


def test_build_plane_refuses_another_executor_while_jobs_run(tmp_path: Path, digits_dataset: Path) -> None:
    settings = load_settings().ensure()
    db_url = f"sqlite:///{tmp_path / 'state.db'}"
    local = cluster_config(inventory=[{"node": "local", "count": 1}])
    plane = build_plane(settings, local, db_url)
    try:
        job = plane.submit(ADMIN, _train(digits_dataset))
        # Placed, as by a cycle (without launching anything).
        plane.store.start_attempt(job.id, "local", plane.store.list_gpus(), now=time.time())
    finally:
        plane.store.close()
    ray = cluster_config(executor={"kind": "ray", "address": "http://127.0.0.1:9"})
    with pytest.raises(ConfigError, match=rf"'local': job\(s\) {job.id}\b.*kind set back"):
        build_plane(settings, ray, db_url)
    build_plane(settings, local, db_url).store.close()  # the same executor starts fine


def test_build_plane_with_an_unreachable_ray_says_so() -> None:
    cfg = cluster_config(executor={"kind": "ray", "address": "http://127.0.0.1:9", "request_timeout_s": 2})
    with pytest.raises(
        ExecutorError, match=re.escape("cannot reach the Ray dashboard at http://127.0.0.1:9:")
    ):
        build_plane(load_settings().ensure(), cfg, None)


# -- the cycle with an executor that cannot answer -----------------------------------------------


class ScriptedExecutor:
    """An executor whose attempts report what the test says (by job id): running by
    default, an AttemptStatus, or an ExecutorError raised from `poll`."""

    name = "scripted"

    def __init__(self) -> None:
        self.script: dict[int, AttemptStatus | ExecutorError] = {}
        self.launched: list[int] = []
        self.launch_error: ExecutorError | None = None  # raised by `launch` while set
        self.launch_tries = 0
        self.gpus = [Gpu("n-1/0", "n-1", "fake"), Gpu("n-1/1", "n-1", "fake")]  # what capacity() says

    def capacity(self) -> list[Gpu]:
        return list(self.gpus)

    def launch(self, request: LaunchRequest) -> Handle:
        self.launch_tries += 1
        if self.launch_error is not None:
            raise self.launch_error
        self.launched.append(request.job_id)
        return {"job": request.job_id, "attempt_dir": str(request.attempt_dir)}

    def poll(self, handle: Handle) -> AttemptStatus:
        answer = self.script.get(int(handle["job"]), AttemptStatus("running"))
        if isinstance(answer, ExecutorError):
            raise answer
        return answer

    def terminate(self, handle: Handle) -> None:
        pass

    def kill(self, handle: Handle) -> None:
        pass

    def log_path(self, handle: Handle) -> Path | None:
        return None  # like Ray's: the log is elsewhere

    def read_log(self, handle: Handle, offset: int = 0) -> Iterator[bytes]:
        yield b"".join(f"line {i}\n".encode() for i in range(1, 31))[offset:]


def test_an_executor_that_cannot_answer_stalls_only_its_own_attempt(
    tmp_path: Path, digits_dataset: Path, caplog: pytest.LogCaptureFixture
) -> None:
    settings = load_settings().ensure()
    store = Store.open(f"sqlite:///{tmp_path / 'state.db'}")
    executor = ScriptedExecutor()
    plane = ControlPlane(store, executor, cluster_config(), settings)
    try:
        a, b, c = (
            plane.submit(ADMIN, {"train": _train(digits_dataset), "max_restarts": 0}) for _ in range(3)
        )
        plane.cycle()
        assert executor.launched == [a.id, b.id]  # two GPUs: c waits
        executor.script[a.id] = ExecutorError("cannot reach the Ray dashboard at http://head:8265")
        executor.script[b.id] = AttemptStatus(
            "exited", exit_code=126, detail="Ray could not start it: runtime env setup failed"
        )
        with caplog.at_level(logging.WARNING, logger="visionloop.sched.service"):
            plane.cycle()
        # a: unknown this cycle, so left as it was (running, holding its GPU), and said so.
        assert store.get_job(a.id).state == "running"
        assert f"job {a.id} attempt 1: the executor did not answer" in caplog.text
        # b: failed, with what Ray said and the last log lines (read through the executor);
        # c took its GPU in the same cycle.
        assert store.get_job(b.id).state == "failed"
        reason = store.transitions(b.id)[-1].reason
        assert "exit 126 (Ray could not start it: runtime env setup failed)" in reason, reason
        assert "Last log lines:\nline 11\n" in reason and reason.endswith("line 30"), reason
        assert executor.launched == [a.id, b.id, c.id]
        executor.script[a.id] = AttemptStatus("exited", exit_code=0)
        plane.cycle()
        assert store.get_job(a.id).state == "succeeded"
    finally:
        store.close()


class RemoteLogExecutor(ScriptedExecutor):
    """A ScriptedExecutor whose attempts' logs, like Ray's, come whole with every read."""

    def __init__(self) -> None:
        super().__init__()
        self.log = b""
        self.reads = 0

    def read_log(self, handle: Handle, offset: int = 0) -> Iterator[bytes]:
        self.reads += 1
        yield self.log[offset:]


def _progress_line(step: int, at: float) -> bytes:
    return f'@@visionloop-progress {{"event":"checkpoint","step":{step},"at":{at}}}\n'.encode()


def test_a_log_read_whole_each_time_is_read_for_progress_less_often_the_longer_it_is(
    tmp_path: Path, digits_dataset: Path
) -> None:
    from visionloop.sched.progress import REMOTE_EVERY_S

    settings = load_settings().ensure()
    store = Store.open(f"sqlite:///{tmp_path / 'state.db'}")
    executor = RemoteLogExecutor()
    now = [1000.0]
    plane = ControlPlane(store, executor, cluster_config(), settings, clock=lambda: now[0])
    try:
        job = plane.submit(ADMIN, {"train": _train(digits_dataset)}).id
        executor.log = _progress_line(5, 1000.5)
        plane.cycle()  # launches it
        now[0] += 1
        plane.cycle()  # reads the log: step 5
        assert [(c.step, c.at) for c in store.checkpoints(job)] == [(5, 1000.5)]
        # A short log is cheap to fetch: read again at the next cycle.
        executor.log += _progress_line(6, 1000.8)
        now[0] += 0.2
        plane.cycle()
        assert [c.step for c in store.checkpoints(job)] == [5, 6]
        # A long log (3 MiB) takes a while to fetch whole each time.
        noise = b"x" * 79 + b"\n"
        executor.log += noise * (3 * 2**20 // len(noise)) + _progress_line(10, 1001.1)
        now[0] += 0.2
        plane.cycle()
        assert [c.step for c in store.checkpoints(job)] == [5, 6, 10]
        reads = executor.reads
        executor.log += b"noise\n" + _progress_line(20, 1001.5)
        for _ in range(3):  # well within REMOTE_EVERY_S: the log is not fetched again
            now[0] += REMOTE_EVERY_S / 4
            plane.cycle()
        assert executor.reads == reads and [c.step for c in store.checkpoints(job)] == [5, 6, 10]
        now[0] += REMOTE_EVERY_S / 4
        plane.cycle()
        assert executor.reads == reads + 1 and [c.step for c in store.checkpoints(job)] == [5, 6, 10, 20]
        # The attempt ends: what it wrote last is read at once, whatever the interval.
        executor.log += _progress_line(30, now[0] + 0.5)
        executor.script[job] = AttemptStatus("exited", exit_code=0)
        now[0] += 1
        plane.cycle()
        assert store.get_job(job).state == "succeeded"
        assert [c.step for c in store.checkpoints(job)] == [5, 6, 10, 20, 30]
    finally:
        store.close()


# -- end to end on the Ray cluster -----------------------------------------------------------------


def test_on_ray_a_higher_priority_job_preempts_through_a_checkpoint_and_the_victim_resumes(
    ray_cluster: RayCluster, digits_dataset: Path, tmp_path: Path
) -> None:
    cfg = cluster_config(
        executor={"kind": "ray", "address": ray_cluster.address, "prefix": f"vlcp{os.getpid()}"},
        teams=TEAMS,
        scheduler={"cycle_s": 0.5},
    )
    with fresh_database("sqlite", tmp_path) as db_url, control_plane(db_url, cfg) as cp:
        assert isinstance(cp.plane.executor, RayExecutor)
        # The inventory is the Ray cluster's: 2 spot L4 on the head, 2 on-demand A100 on the worker.
        gpus = cp.plane.store.list_gpus()
        assert sorted((g.type, g.price_class) for g in gpus) == [
            ("A100-80GB", "on_demand"),
            ("A100-80GB", "on_demand"),
            ("L4", "spot"),
            ("L4", "spot"),
        ]
        # Jobs that must not run on spot, and one on-demand GPU out of service: they compete.
        on_demand = sorted(g.id for g in gpus if not g.spot)
        cp.plane.spot_interrupt(on_demand[1], reason="held back by the test")
        # Each test Ray node has 1 CPU: ask for less, or Ray never starts the job.
        job = {"resources": {"gpus": 1, "cpus": 0.4, "memory_gb": 0.5}, "spot": "never"}
        low, high = preempt_and_resume(cp, digits_dataset, job)
        for attempt in (*low["attempts"], *high["attempts"]):
            assert attempt["executor"] == "ray" and attempt["handle"]["submission_id"].startswith("vlcp")
            assert [a["gpu_id"] for a in attempt["allocations"]] == [on_demand[0]]


def test_the_inventory_follows_ray_nodes_that_join_and_leave(ray_cluster: RayCluster, tmp_path: Path) -> None:
    """The scheduler re-reads the cluster's capacity every `inventory_sync_s`: a node that
    joins brings its GPUs (type and price class from its labels), one that leaves has its
    GPUs marked down with the reason, and the rest of the inventory is untouched."""
    cfg = cluster_config(
        executor={"kind": "ray", "address": ray_cluster.address, "prefix": f"vlinv{os.getpid()}"},
        teams=TEAMS,
        scheduler={"cycle_s": 0.2, "inventory_sync_s": 0.5},
    )
    with fresh_database("sqlite", tmp_path) as db_url, control_plane(db_url, cfg) as cp:
        store = cp.plane.store
        original = {g.id: (g.type, g.price_class, g.up) for g in store.list_gpus()}
        assert len(original) == 4

        def wait_for(what: str, ok: Any, timeout: float = 90.0) -> list[Any]:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                gpus = store.list_gpus()
                if ok(gpus):
                    return gpus
                time.sleep(0.2)
            raise AssertionError(f"{what} within {timeout:.0f} s; inventory: {store.list_gpus()}")

        worker = ray_cluster.add_worker(
            "visionloop.io/gpu-type=H100-80GB,visionloop.io/price-class=owned", num_gpus=2
        )
        try:
            gpus = wait_for("the new node's GPUs appear", lambda gs: len(gs) == 6)
            new = [g for g in gpus if g.id not in original]
            assert sorted((g.type, g.price_class, g.up) for g in new) == [("H100-80GB", "owned", True)] * 2
            assert len({g.node for g in new}) == 1
            assert {g.id: (g.type, g.price_class, g.up) for g in gpus if g.id in original} == original
        finally:
            ray_cluster.remove_worker(worker)
        gone = {g.id for g in new}
        gpus = wait_for("its GPUs are marked down", lambda gs: all(not g.up for g in gs if g.id in gone))
        assert {g.id: g.down_reason for g in gpus if g.id in gone} == dict.fromkeys(gone, GONE_REASON)
        assert {g.id: (g.type, g.price_class, g.up) for g in gpus if g.id in original} == original


@contextlib.contextmanager
def _scripted_plane(
    tmp_path: Path, **scheduler: Any
) -> Iterator[tuple[ControlPlane, ScriptedExecutor, list[float]]]:
    """A control plane on a real SQLite store and the scripted executor, with a clock the
    test moves by hand (`clock[0] += s`)."""
    store = Store.open(f"sqlite:///{tmp_path / 'state.db'}")
    executor = ScriptedExecutor()
    clock = [1_000_000.0]
    config = cluster_config(scheduler=scheduler)
    try:
        yield (
            ControlPlane(store, executor, config, load_settings().ensure(), clock=lambda: clock[0]),
            executor,
            clock,
        )
    finally:
        store.close()


def test_an_unreachable_executor_at_launch_is_not_held_against_the_job(
    tmp_path: Path, digits_dataset: Path
) -> None:
    with _scripted_plane(tmp_path, retry_backoff_s=10) as (plane, executor, clock):
        store = plane.store
        a, b = (plane.submit(ADMIN, {"train": _train(digits_dataset), "max_restarts": 0}) for _ in range(2))
        executor.launch_error = ExecutorUnavailableError("cannot reach the Ray dashboard at http://head:8265")
        plane.cycle()
        # One launch found the cluster unreachable; the other was not even tried. With
        # max_restarts 0 an ordinary launch failure would have failed the job: this one did not.
        assert executor.launch_tries == 1
        for job in (a, b):
            row = store.get_job(job.id)
            assert (row.state, row.restarts) == ("queued", 0)
        tried = a.id if store.attempts(a.id) else b.id
        other = b.id if tried == a.id else a.id
        reason = store.transitions(tried)[-1].reason
        assert "not counted against max_restarts; launches resume in 10 s" in reason, reason
        assert "the executor is unreachable; launches resume at" in (
            store.get_job(other).waiting_reason or ""
        )

        clock[0] += 9  # still paused: nothing is tried
        plane.cycle()
        assert executor.launch_tries == 1
        clock[0] += 1  # the pause is over; still unreachable: the next pause is twice as long
        plane.cycle()
        assert executor.launch_tries == 2
        assert "launches resume in 20 s" in store.transitions(tried)[-1].reason

        executor.launch_error = None  # the cluster is back
        clock[0] += 20
        plane.cycle()
        assert sorted(executor.launched) == sorted([a.id, b.id])
        for job in (a, b):
            row = store.get_job(job.id)
            assert (row.state, row.restarts) == ("running", 0)
        assert [att.outcome for att in store.attempts(tried)] == ["failed", "failed", None]

        # A launch failure that is the job's own (not the cluster's) still counts.
        executor.launch_error = ExecutorError("job 3: the command is empty; give the trainer command.")
        c = plane.submit(ADMIN, {"train": _train(digits_dataset), "max_restarts": 0})
        executor.script[a.id] = AttemptStatus("exited", exit_code=0)
        plane.cycle()
        assert store.get_job(c.id).state == "failed"
        assert "the command is empty" in store.transitions(c.id)[-1].reason


def test_without_teams_the_default_quota_follows_the_gpus_that_join(
    tmp_path: Path, digits_dataset: Path
) -> None:
    with _scripted_plane(tmp_path, inventory_sync_s=1) as (plane, executor, clock):
        store = plane.store
        assert not plane.config.teams
        team = store.get_team("default")
        assert team is not None and (team.nominal_gpus, team.borrow_limit) == (2, 0)
        jobs = [plane.submit(ADMIN, {"train": _train(digits_dataset)}) for _ in range(4)]
        plane.cycle()
        assert len(executor.launched) == 2  # two GPUs

        # A node with two more GPUs joins: the default team may use them (before, its quota
        # of 2 left them idle while two jobs waited).
        executor.gpus += [Gpu("n-2/0", "n-2", "fake"), Gpu("n-2/1", "n-2", "fake")]
        clock[0] += 1
        plane.cycle()
        assert store.get_team("default").nominal_gpus == 4  # type: ignore[union-attr]
        assert sorted(executor.launched) == sorted(j.id for j in jobs)

        # A quota set by hand is the operator's: the inventory no longer moves it.
        store.upsert_team("default", 3, 0, 1.0)
        executor.gpus += [Gpu("n-3/0", "n-3", "fake")]
        clock[0] += 1
        plane.cycle()
        assert len(store.list_gpus()) == 5 and store.get_team("default").nominal_gpus == 3  # type: ignore[union-attr]
