"""The Slurm baseline checked job by job against a real Slurm 22.05 running on this machine.

`visionloop.sched.sim.slurm.Slurm` re-implements Slurm's multifactor priority, its main
scheduler, EASY backfill from users' time limits and preempt/qos with PreemptMode=REQUEUE.
This script starts a throw-away Slurm cluster in a temporary folder (munged, MariaDB,
slurmdbd, slurmctld and one slurmd, all as root, all stopped again on exit, error or
Ctrl-C), submits a small trace of `sleep` jobs to it, reads the real start and end times
from slurmdbd (sacct), replays the same trace through the simulator under `Slurm` and
prints, job by job, the real start, the simulated start and their difference.

Set-up (`slurm.conf`, written by `write_configs`):
  - One node whose CPUs are the "GPUs" (`--gpus`, default 32; `SlurmdParameters=
    config_overrides` lets a 2-core machine declare them), `select/cons_tres` with
    `CR_CPU`; a job of G GPUs is `sbatch -n G`, so it may take any G CPUs (`same_node=False`
    in the model). CPUs rather than GRES because Slurm's job-size factor and fair-share
    usage (billing) count CPUs. The simulator gets the same single node.
  - `PriorityType=priority/multifactor` with `SlurmConfig`'s weights: age 1000, fair share
    10000, QOS 10000, and job size 2000 (see below); `PriorityFlags=NO_FAIR_TREE` (the
    classic F = 2^(-U/S) the model implements; Fair Tree is Slurm's default since 19.05),
    `PriorityFavorSmall=NO`, `PriorityCalcPeriod=1` (minutes, Slurm's minimum),
    `PriorityMaxAge` and `PriorityDecayHalfLife` 7 days / scale.
  - Job size: Slurm 22.05's factor is (min_nodes / nodes + cpus / cluster cpus) / 2
    (`priority_multifactor.c`, `set_priority_factors`); on one node that is 0.5 +
    0.5 * cpus / cluster cpus, so `PriorityWeightJobSize=2000` gives every job the model's
    1000 * GPUs / cluster GPUs plus a constant 1000 that changes no order.
  - QOS `low`, `normal`, `high` with priorities 10, 50, 100 (`DEFAULT_PRIORITIES`; Slurm
    divides by the highest QOS priority, as the model does), `PreemptType=preempt/qos`,
    `PreemptMode=REQUEUE`, high preempts normal and low, normal preempts low.
  - Teams are accounts with fair-share shares 5000/3000/2000 (`entitlement_teams`' weights
    0.5/0.3/0.2; the root user's own association under root keeps its share of 1, i.e.
    1 part in 10,001); every job is submitted by root with `--account=<team>`.
  - `SchedulerType=sched/backfill` with `bf_interval=1`, `bf_resolution=1`,
    `sched_interval=1`, `sched_min_interval=0` (the smallest Slurm allows: backfill every
    second, the main scheduler at every event and every second), and
    `bf_job_part_count_reserve=1`: reserve for the highest-priority job only, i.e. EASY
    backfill as in the model (Slurm's default, 0, reserves for every pending job).
  - `AuthInfo=cred_expire=5`: Slurm holds a requeued job for cred_expire + 1 seconds before
    it may start again (`batch_requeue_fini` in `job_mgr.c`; 121 s by default), which the
    model does not know; 5 s is the smallest value Slurm accepts.

Time scale: Slurm's time limits are whole minutes, so one minute of the real run stands
for one hour of simulated time (`SCALE` = 60). A job of D minutes sleeps D * 60 - `--margin`
seconds, so it ends just before its limit and Slurm never kills it (the model does not
kill at the limit either). The simulator runs in the real run's seconds, with
`PriorityMaxAge` and `PriorityDecayHalfLife` divided by the scale (7 days -> 168 min), each
job submitted when Slurm recorded its submission and running as long as its last run
really took (Slurm's whole-second start and end stamps), no grace period (`sleep` dies at
SIGTERM), no restart overhead, no checkpoints (a requeued batch script starts again from
the beginning).

Variants: `--limits 1` (time limits = the durations, rounded up to whole minutes) and
`--limits 2` (twice the durations); `--no-preemption` runs both sides without preempt/qos.
Each run of the trace takes 10-12 minutes of wall time. Results go to
benchmarks/results/sched_slurm_crosscheck.json, merged by variant so that runs made one at
a time accumulate; `--resimulate` recomputes the comparison from the real times recorded
there without starting Slurm.

Agreement: a start counts as agreeing within `--tolerance` (5 s): backfill runs every
second, the main scheduler at each event, Slurm stamps whole seconds, and a job's CPUs come
free ~0.5 s after its end; jobs that agree differ by 0-1 s. Also printed: the job pairs
started in the same order, and the average JCT of each side. `SlurmctldTiming`, a
diagnostic beside the baseline, emulates two slurmctld timings the baseline lacks (pending
jobs' priorities recomputed only once a minute, a requeued job held 6 s) to tell how much
of a disagreement they explain.

Findings, 2026-11-29 (Slurm 22.05.8, seed 5: 24 jobs, 1-16 GPUs, 1-4 min, on 32 GPUs):

    variant              within 5 s  within 60 s  pairs in order  JCT sim/real  requeues real/sim
    limits 1x, preempt      14/24       19/24         267/276         0.853          3/2
    limits 2x, preempt      16/24       21/24         264/276         0.934          2/6
    limits 1x, no preempt    7/24        9/24         213/276         0.729          0/0
    limits 2x, no preempt    7/24        8/24         215/276         0.738          0/0
    (SlurmctldTiming: 16, 17, 17, 17 of 24 within 5 s; JCT ratio 0.859, 0.939, 0.953, 0.980)
    An earlier run of limits 1x, preempt: 15/24, 19/24, 267/276, 0.855, 3/2 (j11 -5 s, not -6).

The disagreements come from three behaviours of Slurm that the baseline does not have:
  1. Backfill reservations hold whole nodes: `_attempt_backfill` reserves the head job's
     node bitmap in its node-space map (backfill.c, `bit_not(avail_bitmap)` then
     `_add_reservation`), so a later job may start only if it ends before the reservation;
     the baseline's EASY also lets it use the GPUs the reservation does not need (`extra`).
     On one node that leaves GPUs idle: with limits 1x, 3 GPUs stay idle from 191 s to
     233 s while 1-GPU jobs j13, j15, j20 wait (the model starts them at 191 s).
  2. Backfill preempts: `_try_sched` passes `slurm_find_preemptable_jobs` to the select
     plugin, so a job behind the blocked head that fits by requeuing lower-QOS jobs, and
     ends before the head's reservation, starts at once (1x: j12 at 104 s requeuing j05;
     2x: j11 at 102 s requeuing j05). The baseline preempts only in the main loop, which
     stops at the first blocked job; its backfill never preempts.
  3. Priorities are recomputed once a minute (PriorityCalcPeriod's minimum), from usage
     added at the same ticks; running jobs keep theirs, so a requeued job competes with
     the priority it had when it started. A job's priority at submission uses the usage of
     the last tick (e.g. j06 at 33 s: F = 1.0 for every team, so j05 leads and j06 waits
     until 56 s; the model, with fresh usage, starts j06 at once). Without preemption that
     single early difference changes which 8-GPU job takes the GPUs at 57 s and cascades
     (7 of 24 agree; 17 of 24 with SlurmctldTiming).
Also differing but not visible here: a requeued job's age restarts (`batch_requeue_fini`
resets submit and accrue time; the baseline keeps the first submission), and Slurm's
defaults are further from the baseline than this set-up: Fair Tree (not the classic
fair share), bf_job_part_count_reserve=0 (a reservation for every pending job, not EASY),
bf_interval=30 s, bf_resolution=60 s, sched_interval=60 s, cred_expire=120 s. The
job-size factor is (nodes / cluster nodes + CPUs / cluster CPUs) / 2: the baseline's
`weight_job_size` matches half of `PriorityWeightJobSize` on a one-node cluster.

Needs root and the Debian packages (bookworm: Slurm 22.05.8):

    apt-get install -y --no-install-recommends slurmctld slurmd slurm-client slurmdbd \\
        mariadb-server munge
    python benchmarks/sched/slurm_crosscheck.py --limits 1
    python benchmarks/sched/slurm_crosscheck.py --limits 2
    python benchmarks/sched/slurm_crosscheck.py --dry-run   # the trace and the simulation only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import RESULTS, write_result
from visionloop.sched.sim import ClusterSpec, NodeSpec, SimConfig, TraceJob, entitlement_teams, simulate
from visionloop.sched.sim.slurm import Slurm, SlurmConfig
from visionloop.sched.view import DEFAULT_PRIORITIES, ActiveJob, ClusterView, Decision, PendingJob

SCALE = 60.0  # simulated seconds per real second: a real minute stands for an hour
_DAY = 86400.0
MAX_AGE_MIN = round(7 * _DAY / SCALE / 60)  # PriorityMaxAge = PriorityDecayHalfLife, minutes
TEAMS = ("detection", "segmentation", "research")
SHARES = {"detection": 5000, "segmentation": 3000, "research": 2000}  # entitlement_teams' weights
CLASSES = ("low", "normal", "high")
TAG = "VISIONLOOP_SLURM_CROSSCHECK"  # in every process this script starts, to find them again
NAME = "sched_slurm_crosscheck"
CRED_EXPIRE_S = 5  # AuthInfo=cred_expire (Slurm's minimum)
REQUEUE_HOLD_S = CRED_EXPIRE_S + 1.0  # a requeued job's BeginTime: now + cred_expire + 1


@dataclass(frozen=True)
class Job:
    id: str
    submit_s: int  # offset from the first submission, real seconds
    gpus: int
    minutes: int  # its duration, rounded up to whole minutes (the time limit of --limits 1)
    team: str
    qos: str


def make_trace(n: int, seed: int, span_s: int) -> list[Job]:
    """`n` jobs submitted over `span_s` seconds: sizes 1-16 GPUs (mostly small), 1-4 minutes,
    three teams (50/30/20%) and three classes (low 30%, normal 50%, high 20%). The first few
    jobs arrive together so that the cluster fills at once and later jobs must queue."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        at = 0 if i < 6 else rng.randint(10, span_s)
        gpus = rng.choices((1, 2, 4, 8, 16), weights=(25, 25, 25, 17, 8))[0]
        minutes = rng.choices((1, 2, 3, 4), weights=(25, 30, 25, 20))[0]
        team = rng.choices(TEAMS, weights=(50, 30, 20))[0]
        qos = rng.choices(CLASSES, weights=(30, 50, 20))[0]
        jobs.append(Job(f"j{i:02d}", at, gpus, minutes, team, qos))
    jobs.sort(key=lambda j: (j.submit_s, j.id))
    return [Job(f"j{k:02d}", j.submit_s, j.gpus, j.minutes, j.team, j.qos) for k, j in enumerate(jobs)]


# --------------------------------------------------------------------------- the real cluster


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Ports:
    ctld: int = field(default_factory=free_port)
    slurmd: int = field(default_factory=free_port)
    dbd: int = field(default_factory=free_port)
    mysql: int = field(default_factory=free_port)


def write_configs(d: Path, host: str, gpus: int, ports: Ports, preemption: bool, munge_socket: Path) -> None:
    """slurm.conf and slurmdbd.conf for the one-node cluster (see the module docstring)."""
    auth = f"socket={munge_socket}"
    sched = ",".join(
        [
            "bf_interval=1",
            "bf_resolution=1",
            "bf_job_part_count_reserve=1",
            "sched_interval=1",
            "sched_min_interval=0",
            "batch_sched_delay=0",
            "bf_continue",
        ]
    )
    conf = f"""\
ClusterName=vlcheck
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ports.ctld}
SlurmdPort={ports.slurmd}
AuthType=auth/munge
CredType=cred/munge
AuthInfo={auth},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdParameters=config_overrides
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={ports.dbd}
AccountingStorageEnforce=associations,limits,qos
JobCompType=jobcomp/none
MinJobAge=3600
KillWait=5
JobRequeue=1
PriorityType=priority/multifactor
PriorityFlags=NO_FAIR_TREE
PriorityWeightAge=1000
PriorityWeightFairshare=10000
PriorityWeightJobSize=2000
PriorityWeightQOS=10000
PriorityWeightPartition=0
PriorityMaxAge={MAX_AGE_MIN}
PriorityDecayHalfLife={MAX_AGE_MIN}
PriorityCalcPeriod=1
PriorityFavorSmall=NO
PriorityUsageResetPeriod=NONE
SchedulerType=sched/backfill
SchedulerParameters={sched}
PreemptType={"preempt/qos" if preemption else "preempt/none"}
PreemptMode={"REQUEUE" if preemption else "OFF"}
NodeName={host} NodeAddr=127.0.0.1 CPUs={gpus} Boards=1 SocketsPerBoard=1 CoresPerSocket={gpus} \
ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN
PartitionName=gpu Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
    (d / "slurm.conf").write_text(conf)
    dbd = d / "slurmdbd.conf"
    dbd.write_text(f"""\
AuthType=auth/munge
AuthInfo={auth}
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={ports.dbd}
SlurmUser=root
PidFile={d}/slurmdbd.pid
LogFile={d}/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={ports.mysql}
StorageUser=root
StorageLoc=slurm_acct_db
""")
    dbd.chmod(0o600)  # slurmdbd refuses a config others can read


class RealSlurm:
    """The daemons, started in order and stopped in reverse; `stop` is safe to call twice."""

    def __init__(self, gpus: int, preemption: bool, keep: bool) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="vl-slurm-"))
        self.gpus, self.preemption, self.keep = gpus, preemption, keep
        self.host = socket.gethostname().split(".")[0]
        self.ports = Ports()
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf"), TAG: str(self.dir)}
        self.env.pop("SLURM_TIME_FORMAT", None)

    # -- helpers

    def _spawn(self, name: str, argv: Sequence[str]) -> None:
        log = (self.dir / f"{name}.out").open("wb")
        # Own session: a Ctrl-C in the terminal reaches this script only, which then stops
        # the daemons in order (slurmd must outlive the jobs it has to kill).
        p = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, p))

    def cmd(self, *argv: str, check: bool = True, extra_env: Mapping[str, str] | None = None) -> str:
        done = subprocess.run(
            argv, env={**self.env, **(extra_env or {})}, capture_output=True, text=True, timeout=60
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def _wait(self, what: str, test: Any, timeout: float = 60.0) -> None:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            for name, p in self.procs:
                if p.poll() is not None:
                    tail = (self.dir / f"{name}.out").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"{name} exited ({p.returncode}) while waiting for {what}:\n{tail}")
            with contextlib.suppress(Exception):
                if test():
                    return
            time.sleep(0.5)
        raise RuntimeError(f"timed out waiting for {what} (logs in {self.dir})")

    # -- start

    def start(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "db", "munge"):
            (d / sub).mkdir()
        munge = d / "munge"
        munge.chmod(0o700)
        key = munge / "munge.key"
        shutil.copy("/etc/munge/munge.key", key)
        key.chmod(0o400)
        # The default socket: Slurm's clients (sacctmgr at least) ignore AuthInfo=socket=.
        sock = Path("/run/munge/munge.socket.2")
        if sock.exists():
            alive = subprocess.run(["munge", "-n", "-S", str(sock)], capture_output=True).returncode == 0
            if alive:
                raise RuntimeError(f"a munged already serves {sock}; stop it first")
            sock.unlink()  # left by a run that was killed
        sock.parent.mkdir(parents=True, exist_ok=True)
        write_configs(d, self.host, self.gpus, self.ports, self.preemption, sock)
        self._spawn(
            "munged",
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={sock}",
                f"--key-file={key}",
                f"--log-file={munge}/munged.log",
                f"--pid-file={munge}/munged.pid",
                f"--seed-file={munge}/munged.seed",
            ],
        )
        self._wait("munged", lambda: sock.exists())
        subprocess.run(
            [
                "mariadb-install-db",
                f"--datadir={d}/db",
                "--user=root",
                "--auth-root-authentication-method=normal",
            ],
            check=True,
            capture_output=True,
        )
        # A private, throw-away database on 127.0.0.1 only: no grant tables, no password.
        self._spawn(
            "mariadbd",
            [
                "mariadbd",
                "--no-defaults",
                f"--datadir={d}/db",
                "--user=root",
                "--skip-grant-tables",
                "--bind-address=127.0.0.1",
                f"--port={self.ports.mysql}",
                f"--socket={d}/mysql.sock",
                f"--pid-file={d}/mysqld.pid",
                "--innodb-buffer-pool-size=64M",
                "--innodb-lock-wait-timeout=900",
            ],
        )
        self._wait("mariadbd", lambda: _port_open(self.ports.mysql))
        self._spawn("slurmdbd", ["slurmdbd", "-D"])  # reads slurmdbd.conf beside $SLURM_CONF
        self._wait("slurmdbd", lambda: _port_open(self.ports.dbd))
        self._accounts()
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(d / "slurm.conf")])
        self._wait("slurmctld", lambda: self.cmd("scontrol", "ping").count("UP") >= 1)
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(d / "slurm.conf"), "-N", self.host])
        self._wait(
            "the node to be idle",
            lambda: self.cmd("sinfo", "-h", "-N", "-o", "%t").strip() == "idle",
        )

    def _accounts(self) -> None:
        """Cluster, QOS and the teams' accounts in slurmdbd, before slurmctld reads them."""
        mgr = ("sacctmgr", "-i")
        self._wait("sacctmgr", lambda: self.cmd(*mgr, "add", "cluster", "vlcheck") is not None)
        self.cmd(
            *mgr, "modify", "qos", "where", "name=normal", "set", f"priority={DEFAULT_PRIORITIES['normal']}"
        )
        self.cmd(*mgr, "add", "qos", "low", f"priority={DEFAULT_PRIORITIES['low']}")
        self.cmd(*mgr, "add", "qos", "high", f"priority={DEFAULT_PRIORITIES['high']}")
        if self.preemption:
            self.cmd(*mgr, "modify", "qos", "where", "name=normal", "set", "preempt=low")
            self.cmd(*mgr, "modify", "qos", "where", "name=high", "set", "preempt=low,normal")
        for team, shares in SHARES.items():
            self.cmd(*mgr, "add", "account", team, "cluster=vlcheck", f"fairshare={shares}")
        self.cmd(
            *mgr,
            "add",
            "user",
            "root",
            f"account={','.join(TEAMS)}",
            "cluster=vlcheck",
            "qos=low,normal,high",
            "defaultqos=normal",
        )

    # -- stop

    def stop(self) -> None:
        """Cancel every job, wait for the nodes to clean up, stop the daemons in reverse
        order (SIGTERM, then SIGKILL after 20 s), then kill anything left that carries this
        run's tag (a job step whose slurmd died first)."""
        if any(n == "slurmctld" and p.poll() is None for n, p in self.procs):
            with contextlib.suppress(Exception):
                self.cmd("scancel", "--full", "--user=root", check=False)
                t_end = time.monotonic() + 30
                while time.monotonic() < t_end and self.cmd("squeue", "-h", check=False).strip():
                    time.sleep(1)
        for _name, p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        self.procs.clear()
        for pid in tagged_pids(str(self.dir)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def tagged_pids(tag: str) -> list[int]:
    """Processes whose environment carries TAG=tag (everything started for this run)."""
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        with contextlib.suppress(OSError):
            if f"{TAG}={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found


@contextlib.contextmanager
def real_slurm(gpus: int, preemption: bool, keep: bool) -> Iterator[RealSlurm]:
    """A started cluster, stopped on exit, on error and on SIGTERM/SIGINT."""
    cluster = RealSlurm(gpus, preemption, keep)

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, on_signal)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        signal.signal(signal.SIGTERM, old)


# --------------------------------------------------------------------------- the real run


@dataclass
class RealJob:
    id: str
    submit: float  # the job's first submission, real seconds from the first job's
    first_start: float
    end: float
    last_run_s: float  # the length of its last (completed) run
    runs: int  # 1 + times it was requeued


def run_real(cluster: RealSlurm, trace: list[Job], limit_factor: int, margin_s: int) -> dict[str, Any]:
    """Submit the trace at its offsets, wait for every job, read sacct; priorities of the
    pending jobs are sampled every 2 s (as Slurm last computed them) for diagnosis."""
    ids: dict[str, str] = {}  # slurm id -> ours
    t0 = time.time()
    pending = list(trace)
    samples: list[dict[str, Any]] = []
    last_sample = 0.0
    last: dict[str, int] = {}
    while True:
        now = time.time() - t0
        while pending and pending[0].submit_s <= now:
            j = pending.pop(0)
            sid = cluster.cmd(
                "sbatch",
                "--parsable",
                f"--job-name={j.id}",
                f"--account={j.team}",
                f"--qos={j.qos}",
                f"--ntasks={j.gpus}",
                f"--time={j.minutes * limit_factor}",
                "--requeue",
                "--output=/dev/null",
                f"--wrap=exec sleep {j.minutes * 60 - margin_s}",
            ).strip()
            ids[sid.split(";")[0]] = j.id
        if now - last_sample >= 2.0:
            last_sample = now
            out = cluster.cmd("squeue", "-h", "-t", "PD", "-o", "%j %Q", check=False)
            prios = {a: int(b) for a, b in (line.split() for line in out.splitlines() if line.strip())}
            if prios != last:
                samples.append({"t": round(now, 1), "pending_priority": prios})
                last = prios
            if not pending and not cluster.cmd("squeue", "-h", "-o", "%i", check=False).strip():
                break
        if now > 3600:
            raise RuntimeError("the real run took over an hour")
        time.sleep(0.2)
    # sacct: one line per run (-D) of each allocation (-X), epoch seconds.
    t_end = time.monotonic() + 60
    while True:
        out = cluster.cmd(
            "sacct",
            "-n",
            "-P",
            "-X",
            "-D",
            "-S",
            "now-2hours",
            "-o",
            "JobIDRaw,JobName,Submit,Start,End,State",
            extra_env={"SLURM_TIME_FORMAT": "%s"},
        )
        rows = [line.split("|") for line in out.splitlines() if line.strip()]
        done = {r[1] for r in rows if r[5] == "COMPLETED"}
        if done >= {j.id for j in trace} or time.monotonic() > t_end:
            break
        time.sleep(2)  # slurmctld sends job records to slurmdbd asynchronously
    by_job: dict[str, list[list[str]]] = {}
    for r in rows:
        by_job.setdefault(r[1], []).append(r)
    first_submit = min(int(r[2]) for r in rows)
    jobs: dict[str, dict[str, Any]] = {}
    for j in trace:
        recs = sorted(by_job.get(j.id, []), key=lambda r: int(r[3]) if r[3].isdigit() else 0)
        fin = [r for r in recs if r[5] == "COMPLETED"]
        if not fin:
            raise RuntimeError(f"job {j.id} did not complete in Slurm: {recs}")
        starts = [int(r[3]) for r in recs if r[3].isdigit()]
        subs = [int(r[2]) for r in recs]
        jobs[j.id] = asdict(
            RealJob(
                j.id,
                float(min(subs) - first_submit),
                float(min(starts) - first_submit),
                float(int(fin[-1][4]) - first_submit),
                float(int(fin[-1][4]) - int(fin[-1][3])),
                len(recs),
            )
        )
    return {"jobs": jobs, "priority_samples": samples, "sacct": rows}


def scheduling_events(log: Path) -> list[str]:
    """slurmctld's own account of each decision (submissions with their initial priority,
    starts by the main scheduler ("sched: Allocate") or by backfill ("sched/backfill"),
    requeues for preemption, completions); Slurm's JobId N is the trace's job N - 1."""
    keys = ("submit_batch_job", "Allocate JobId", "_start_job", "preempted JobId", "done")
    with contextlib.suppress(OSError):
        return [line for line in log.read_text(errors="replace").splitlines() if any(k in line for k in keys)]
    return []


def ctld_started(log: Path, real_run: Mapping[str, Any]) -> float:
    """When slurmctld started (its decay thread's first tick), in seconds from the first
    submission (0 if the log does not say)."""
    first = min(int(r[2]) for r in real_run["sacct"])
    for line in log.read_text(errors="replace").splitlines():
        if "slurmctld version" in line and " started" in line:
            stamp = line[1 : line.index("]")]
            return time.mktime(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S")) + float(stamp[19:]) - first
    return 0.0


# --------------------------------------------------------------------------- the simulation


class SlurmctldTiming(Slurm):
    """A diagnostic, not the baseline: the model with two of slurmctld's timings emulated.
    1. Slurm adds running jobs' usage and recomputes pending jobs' priorities only in its
       decay thread, every `PriorityCalcPeriod` (`_decay_thread` and
       `decay_apply_weighted_factors` in `priority_multifactor.c`; running jobs keep theirs
       unless `PriorityFlags=CALCULATE_RUNNING`). So a job's priority is the one computed at
       its submission, from the usage of the last recalculation, until the next one; a
       requeued job keeps the priority it had when it started. The baseline recomputes
       everything at every cycle. Ticks at `phase_s` + k * `period_s` (slurmctld's start).
    2. A requeued job may not start for cred_expire + 1 s (`hold_s`; `batch_requeue_fini`
       in `job_mgr.c`); in the baseline it may start again at once."""

    def __init__(
        self,
        time_limits: Mapping[str, float],
        config: SlurmConfig,
        period_s: float,
        phase_s: float,
        hold_s: float,
    ) -> None:
        super().__init__(time_limits, config)
        self.period, self.phase, self.hold = period_s, phase_s, hold_s
        self.tick = -float("inf")
        self.snapshot: dict[str, float] = {}  # usage as of the last tick
        self.cached: dict[str, float] = {}  # job -> priority Slurm holds for it
        self.was_running: set[str] = set()
        self.requeued_at: dict[str, float] = {}

    def __call__(self, view: ClusterView) -> Decision:
        tick = self.phase + math.floor((view.now - self.phase) / self.period) * self.period
        if tick > self.tick:
            self.tick = tick
            self._account(view.now)
            self.snapshot = dict(self.usage)
            for j in view.queued:  # pending jobs only: running ones keep theirs
                self.cached.pop(j.id, None)
        for j in view.queued:
            if j.id in self.was_running:
                self.requeued_at[j.id] = view.now
        self.was_running = {j.id for j in view.running}
        held = {j.id for j in view.queued if view.now < self.requeued_at.get(j.id, -math.inf) + self.hold}
        decision = super().__call__(replace(view, queued=[j for j in view.queued if j.id not in held]))
        for jid in held:
            decision.waiting[jid] = f"requeued: held until {self.requeued_at[jid] + self.hold:.0f}"
        return decision

    def fairshare(self, team: str, view: ClusterView) -> float:
        live, self.usage = self.usage, self.snapshot
        try:
            return super().fairshare(team, view)
        finally:
            self.usage = live

    def priority(self, job: PendingJob | ActiveJob, gpus: int, view: ClusterView) -> float:
        if job.id not in self.cached:
            self.cached[job.id] = super().priority(job, gpus, view)
        return self.cached[job.id]


def run_sim(
    trace: list[Job],
    real: Mapping[str, Mapping[str, Any]] | None,
    limit_factor: int,
    margin_s: int,
    gpus: int,
    preemption: bool,
    calc_period_phase_s: float | None = None,
) -> dict[str, dict[str, float]]:
    """The trace under the model, in the real run's seconds. With `real`, each job arrives
    when Slurm recorded it and runs as long as its last run took; without, at its planned
    offset for its planned sleep (a dry run). With `calc_period_phase_s`, under
    `SlurmctldTiming` (PriorityCalcPeriod=1 with ticks at that phase, and the requeue
    hold) instead."""
    tj = []
    for j in trace:
        submit = float(real[j.id]["submit"]) if real else float(j.submit_s)
        run_s = float(real[j.id]["last_run_s"]) if real else float(j.minutes * 60 - margin_s)
        tj.append(TraceJob(j.id, submit, j.gpus, run_s, j.team, j.qos, "allowed"))
    limits = {j.id: float(j.minutes * 60 * limit_factor) for j in trace}
    cfg = SlurmConfig(
        max_age_s=MAX_AGE_MIN * 60.0,
        decay_half_life_s=MAX_AGE_MIN * 60.0,
        preemption=preemption,
        grace_s=0.0,
    )
    cluster = ClusterSpec((NodeSpec("node0", gpus),), entitlement_teams(gpus))
    sim_cfg = SimConfig(
        grace_s=0.0,  # sleep exits at SIGTERM
        restart_overhead_s=0.0,
        checkpoint_every_s=1e12,  # no checkpoint: a requeued script starts again
        tick_s=1.0,
        pace_error=0.0,
    )
    sched = (
        Slurm(limits, cfg)
        if calc_period_phase_s is None
        else SlurmctldTiming(limits, cfg, 60.0, calc_period_phase_s, REQUEUE_HOLD_S)
    )
    result = simulate(tj, cluster, sched, sim_cfg)
    if result.unfinished:
        raise SystemExit(f"the model left {len(result.unfinished)} jobs unfinished")
    return {
        r.id: {
            "submit": r.submit,
            "first_start": float(r.first_start or 0.0),
            "end": float(r.finish or 0.0),
            "preemptions": float(r.preemptions),
        }
        for r in result.jobs
    }


# --------------------------------------------------------------------------- comparison


def concordance(a: Mapping[str, float], b: Mapping[str, float], tie_s: float) -> tuple[int, int]:
    """Pairs of jobs started in the same order by both (starts within `tie_s` of each other
    count as simultaneous, and a simultaneous pair agrees with anything), and all pairs."""
    ids = sorted(a)
    agree = total = 0
    for i, x in enumerate(ids):
        for y in ids[i + 1 :]:
            total += 1
            da, db = a[x] - a[y], b[x] - b[y]
            if abs(da) <= tie_s or abs(db) <= tie_s or (da > 0) == (db > 0):
                agree += 1
    return agree, total


def compare(
    trace: list[Job],
    real: Mapping[str, Mapping[str, Any]],
    sim: Mapping[str, Mapping[str, float]],
    tol_s: float,
    quiet: bool = False,
) -> dict[str, Any]:
    """Job by job (printed unless `quiet`) and in summary."""
    say = (lambda *_: None) if quiet else print
    say(
        f"{'job':>4} {'GPUs':>4} {'min':>3} {'team':>12} {'qos':>6} {'submit':>6} {'real start':>10} "
        f"{'sim start':>9} {'diff':>6} {'real end':>8} {'sim end':>7} {'runs':>4} {'sim pre':>7}"
    )
    rows = []
    for j in sorted(trace, key=lambda j: (real[j.id]["first_start"], j.id)):
        r, s = real[j.id], sim[j.id]
        diff = s["first_start"] - r["first_start"]
        rows.append(
            {
                "job": j.id,
                "gpus": j.gpus,
                "minutes": j.minutes,
                "team": j.team,
                "qos": j.qos,
                "submit_s": r["submit"],
                "real_start_s": r["first_start"],
                "sim_start_s": s["first_start"],
                "start_diff_s": diff,
                "real_end_s": r["end"],
                "sim_end_s": s["end"],
                "real_requeues": r["runs"] - 1,
                "sim_preemptions": int(s["preemptions"]),
            }
        )
        mark = "" if abs(diff) <= tol_s else "  *"
        say(
            f"{j.id:>4} {j.gpus:>4} {j.minutes:>3} {j.team:>12} {j.qos:>6} {r['submit']:>6.0f} "
            f"{r['first_start']:>10.0f} {s['first_start']:>9.0f} {diff:>+6.0f} {r['end']:>8.0f} "
            f"{s['end']:>7.0f} {r['runs']:>4} {int(s['preemptions']):>7}{mark}"
        )
    n = len(rows)
    within = sum(abs(r["start_diff_s"]) <= tol_s for r in rows)
    within60 = sum(abs(r["start_diff_s"]) <= 60 for r in rows)
    agree, pairs = concordance(
        {j: r["first_start"] for j, r in real.items()}, {j: s["first_start"] for j, s in sim.items()}, tol_s
    )
    seq_real = [j for j, _ in sorted(real.items(), key=lambda kv: (kv[1]["first_start"], kv[0]))]
    seq_sim = [j for j, _ in sorted(sim.items(), key=lambda kv: (kv[1]["first_start"], kv[0]))]
    jct_real = sum(r["end"] - r["submit"] for r in real.values()) / n
    jct_sim = sum(s["end"] - s["submit"] for s in sim.values()) / n
    summary = {
        "jobs": n,
        "tolerance_s": tol_s,
        "starts_within_tolerance": within,
        "starts_within_60s": within60,
        "mean_abs_start_diff_s": sum(abs(r["start_diff_s"]) for r in rows) / n,
        "order_pairs_agreeing": agree,
        "order_pairs": pairs,
        "start_sequence_real": seq_real,
        "start_sequence_sim": seq_sim,
        "avg_jct_real_s": jct_real,
        "avg_jct_sim_s": jct_sim,
        "jct_ratio_sim_over_real": jct_sim / jct_real,
        "requeues_real": sum(r["runs"] - 1 for r in real.values()),
        "preemptions_sim": int(sum(s["preemptions"] for s in sim.values())),
        "makespan_real_s": max(r["end"] for r in real.values()),
        "makespan_sim_s": max(s["end"] for s in sim.values()),
    }
    say(
        f"starts within {tol_s:.0f} s: {within} of {n}; within 60 s: {within60} of {n}; "
        f"mean |diff| {summary['mean_abs_start_diff_s']:.1f} s"
    )
    say(f"start order: {agree} of {pairs} pairs agree ({agree / pairs:.1%}, ties within {tol_s:.0f} s)")
    say(
        f"avg JCT: real {jct_real:.0f} s ({jct_real * SCALE / 3600:.2f} simulated h), sim {jct_sim:.0f} s, "
        f"sim / real = {jct_sim / jct_real:.3f}"
    )
    say(f"requeues: real {summary['requeues_real']}, sim {summary['preemptions_sim']}")
    return {"summary": summary, "per_job": rows}


def variant_key(limit_factor: int, preemption: bool) -> str:
    return f"limits_{limit_factor}x_{'preempt' if preemption else 'nopreempt'}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limits", type=int, choices=(1, 2), default=1, help="time limit / duration (whole min)")
    ap.add_argument(
        "--no-preemption", action="store_true", help="preempt/none in Slurm, preemption off in the model"
    )
    ap.add_argument("--jobs", type=int, default=24, help="jobs in the trace")
    ap.add_argument("--seed", type=int, default=5, help="trace seed")
    ap.add_argument("--span", type=int, default=240, help="submissions spread over this many seconds")
    ap.add_argument("--gpus", type=int, default=32, help="'GPUs' (CPUs) of the one node")
    ap.add_argument("--margin", type=int, default=3, help="a job sleeps its limit minus this (s)")
    ap.add_argument(
        "--tolerance",
        type=float,
        default=5.0,
        help="start difference counted as agreement (s): backfill every 1 s, the main scheduler at "
        "every event, whole-second stamps and ~1 s from a job's end to its CPUs being free, "
        "accumulated over a few jobs in a row",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the trace and simulate it; no Slurm")
    ap.add_argument("--resimulate", action="store_true", help="compare again from the recorded real run")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder (configs, logs)")
    ap.add_argument("--name", default=NAME, help="results file name")
    args = ap.parse_args()
    preemption = not args.no_preemption
    trace = make_trace(args.jobs, args.seed, args.span)
    key = variant_key(args.limits, preemption)
    path = RESULTS / f"{args.name}.json"
    previous: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}

    if args.dry_run:
        for j in trace:
            print(f"{j.id} at {j.submit_s:>3} s: {j.gpus:>2} GPUs, {j.minutes} min, {j.team}, {j.qos}")
        sim = run_sim(trace, None, args.limits, args.margin, args.gpus, preemption)
        for jid, s in sorted(sim.items(), key=lambda kv: kv[1]["first_start"]):
            print(f"{jid}: start {s['first_start']:.0f} end {s['end']:.0f} preempted {s['preemptions']:.0f}")
        print(f"makespan {max(s['end'] for s in sim.values()):.0f} s")
        return

    if args.resimulate:
        try:
            real_run = previous["variants"][key]["real"]
        except KeyError:
            raise SystemExit(f"{path}: no recorded real run for {key}") from None
    else:
        if os.geteuid() != 0:
            raise SystemExit("starting Slurm's daemons needs root")
        missing = [
            b
            for b in ("munged", "mariadbd", "slurmdbd", "slurmctld", "slurmd", "sbatch")
            if not shutil.which(b)
        ]
        if missing:
            raise SystemExit(f"missing {', '.join(missing)}; see --help for the packages")
        with real_slurm(args.gpus, preemption, args.keep) as cluster:
            version = cluster.cmd("sinfo", "-V").strip()
            print(f"{version} in {cluster.dir}; submitting {len(trace)} jobs ({key})", flush=True)
            real_run = run_real(cluster, trace, args.limits, args.margin)
            real_run["slurm_version"] = version
            real_run["slurm_conf"] = (cluster.dir / "slurm.conf").read_text()
            real_run["slurmctld_events"] = scheduling_events(cluster.dir / "slurmctld.log")
            real_run["slurmctld_started_s"] = ctld_started(cluster.dir / "slurmctld.log", real_run)
    sim = run_sim(trace, real_run["jobs"], args.limits, args.margin, args.gpus, preemption)
    print(f"{key}: {real_run.get('slurm_version', 'slurm')}, {len(trace)} jobs on {args.gpus} GPUs")
    comparison = compare(trace, real_run["jobs"], sim, args.tolerance)
    # The diagnostic: how much of the disagreement slurmctld's timings explain.
    phase = float(real_run.get("slurmctld_started_s", 0.0))
    sim_cp = run_sim(trace, real_run["jobs"], args.limits, args.margin, args.gpus, preemption, phase)
    diag = compare(trace, real_run["jobs"], sim_cp, args.tolerance, quiet=True)["summary"]
    print(
        f"diagnostic, the model with priorities recomputed once a minute and requeued jobs held "
        f"{REQUEUE_HOLD_S:.0f} s, as in slurmctld (SlurmctldTiming): starts within "
        f"{args.tolerance:.0f} s: {diag['starts_within_tolerance']} "
        f"of {diag['jobs']}; within 60 s: {diag['starts_within_60s']}; order "
        f"{diag['order_pairs_agreeing']} of {diag['order_pairs']} pairs; avg JCT sim / real = "
        f"{diag['jct_ratio_sim_over_real']:.3f}; requeues {diag['preemptions_sim']}"
    )
    comparison["diagnostic_slurmctld_timing"] = {
        "summary": diag,
        "start_diff_s": {j: sim_cp[j]["first_start"] - r["first_start"] for j, r in real_run["jobs"].items()},
    }
    variants = dict(previous.get("variants", {})) if previous.get("trace_seed") == args.seed else {}
    variants[key] = {
        "limit_factor": args.limits,
        "preemption": preemption,
        **comparison,
        "real": real_run,
        "sim": sim,
    }
    out = write_result(
        args.name,
        {
            "scale_sim_s_per_real_s": SCALE,
            "trace_seed": args.seed,
            "gpus": args.gpus,
            "margin_s": args.margin,
            "trace": [asdict(j) for j in trace],
            "variants": variants,
        },
    )
    print(f"results: {out}")


if __name__ == "__main__":
    main()
