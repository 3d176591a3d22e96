"""The attempt shim: a tiny supervisor between the control plane and a job's process.

    python -m visionloop.sched.shim ATTEMPT_DIR [--heartbeat-s S] [--lock-fd FD] [--stop-file F] -- CMD...

Why it exists: the control plane must survive being SIGKILLed at any moment without losing
track of, or taking down, the jobs it started. So the executor starts this shim in its own
session (a SIGKILL of the control plane or of its process group never reaches it), and the
shim keeps everything a later, unrelated control-plane process needs in ATTEMPT_DIR:

- `lock`       flock-ed for as long as the shim lives: the authority on "still alive". The
               executor locks it before forking the shim and passes it as --lock-fd, so no
               instant exists at which a started attempt looks absent (see `lock_held`);
               started by hand, the shim takes the lock itself.
- `log`        the job's stdout and stderr, appended (plus a few `[visionloop shim]` lines);
- `shim.json`  written atomically once CMD is started: the shim's and the child's pid and
               start ticks, the child's process group, the boot id, the attempt's token;
- `heartbeat`  its mtime is the shim's last sign of life (touched every S seconds);
- `exit.json`  written atomically when CMD ends: `{exit_code, ended_at, ...}`. A child killed
               by signal N gets 128+N, as in a shell; a command that cannot be executed gets
               127 (not found) or 126 (not executable), also as in a shell.

The shim forwards SIGTERM, SIGUSR1 and SIGINT to its child only (the trainer, or its DDP
launcher which forwards to its ranks, turns them into "checkpoint, then exit 75"), and exits
with the child's code. With `--stop-file F` it also sends the child SIGTERM, once, when F
appears: how an executor asks the shims of a run across machines to stop through shared
storage, where the only signal it could send reaches every process of the job (a Slurm job
step's), DataLoader workers included, and the trainer could not checkpoint. The child leads
its own process group, so the executor's `kill` takes the whole tree with one killpg; when
the child exits, anything it left in its group is SIGKILLed before exit.json is written (a
job ends with its main process, as under Slurm). The child carries PR_SET_PDEATHSIG(SIGKILL),
so a SIGKILLed shim takes it along; processes the child had started are orphaned then, and
the executor kills them when it reports the attempt lost (they carry the attempt's token in
their environment).

Identity of processes: pids are reused (pid_max may be 32768), so every pid is stored with
its start time. `start_ticks` (clock ticks since boot, from /proc/PID/stat) is exact and
immune to wall-clock changes; it is what the executor compares. `start_time` (epoch seconds
from psutil, whose boot time moves with the wall clock) is there for humans. `boot_id` tells
a reboot apart from a live process. Linux only: /proc, prctl and flock.

This module imports only the standard library, psutil and visionloop.core.fsutil: it starts
in a fraction of a second and never imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

from visionloop.core.fsutil import atomic_write_json

LOG = "log"
SHIM_JSON = "shim.json"
EXIT_JSON = "exit.json"
HEARTBEAT = "heartbeat"
LOCK = "lock"

TOKEN_ENV = "VISIONLOOP_ATTEMPT_TOKEN"

DEFAULT_HEARTBEAT_S = 5.0
STOP_LOOK_S = 0.5  # how often the stop file is looked for (a stat of shared storage)
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
EXIT_NOT_FOUND = 127
EXIT_NOT_EXECUTABLE = 126
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class ProcInfo:
    """What /proc says about a pid right now."""

    start_ticks: int  # clock ticks since boot at which the process started
    zombie: bool  # exited, not yet reaped by its parent


def proc_info(pid: int) -> ProcInfo | None:
    """The start ticks and zombie state of `pid`, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return ProcInfo(start_ticks=int(fields[19]), zombie=fields[0] in (b"Z", b"X"))


def start_ticks(pid: int) -> int | None:
    info = proc_info(pid)
    return info.start_ticks if info else None


def start_time(pid: int) -> float | None:
    """Epoch start time of `pid` (psutil), for humans; None if it is gone."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def boot_id() -> str | None:
    """The kernel's id of this boot: a pid from another boot is certainly not alive."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def same_process(pid: int | None, start_ticks: int | None) -> bool:
    """True if `pid` is alive (not a zombie) and is the very process that started at `start_ticks`."""
    if pid is None or start_ticks is None:
        return False
    info = proc_info(pid)
    return info is not None and not info.zombie and info.start_ticks == start_ticks


def exit_code_of(returncode: int) -> int:
    """Popen's returncode as a shell reports it: killed by signal N → 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def _pdeathsig(parent: int) -> Callable[[], None]:
    """A preexec_fn: die with SIGKILL when the shim dies, so no child outlives it unaccounted."""
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: nothing to load in the child

    def preexec() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the shim died between fork and prctl
            os._exit(EXIT_NOT_EXECUTABLE)

    return preexec


class Shim:
    def __init__(
        self, attempt_dir: Path, command: Sequence[str], heartbeat_s: float, stop_file: Path | None = None
    ) -> None:
        self.dir = attempt_dir
        self.command = list(command)
        self.heartbeat_s = heartbeat_s
        self.stop_file = stop_file
        self.stop_seen = False
        self.child: subprocess.Popen[bytes] | None = None
        self.pending: list[int] = []  # signals that arrived before the child existed
        self.reaped = False
        self._log: int | None = None  # the log, opened once before the job starts

    def log_fd(self) -> int:
        """The log's descriptor, opened once, before the job exists: the job's process writes in
        this folder and could replace the log by a link to another file (which the shim would
        then append to) or a FIFO (which would block the shim's writes for ever)."""
        if self._log is None:
            self._log = os.open(
                self.dir / LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
            )
        return self._log

    def say(self, text: str) -> None:
        # One write per line: the child appends to the same file (O_APPEND keeps lines whole).
        os.write(self.log_fd(), f"[visionloop shim] {text}\n".encode())

    def forward(self, signum: int, _frame: FrameType | None) -> None:
        # Runs between bytecodes of the main thread: no locks, nothing that can block, and no
        # Popen.poll (it would reap the child behind run()'s back). Until run() reaps the
        # child its pid cannot be reused, so os.kill cannot hit another process.
        child = self.child
        if child is None:
            self.pending.append(signum)
        elif not self.reaped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)

    def beat(self) -> None:
        # A full or flaky disk must not take the job down with the shim: skip this beat.
        with contextlib.suppress(OSError):
            (self.dir / HEARTBEAT).touch()  # an existing file gets a new mtime

    def run(self) -> int:
        for sig in FORWARDED:
            signal.signal(sig, self.forward)
        me = os.getpid()
        info: dict[str, Any] = {
            "shim_pid": me,
            "shim_start_ticks": start_ticks(me),
            "shim_start_time": start_time(me),
            "boot_id": boot_id(),
            # The executor's marker, inherited by every descendant: how it finds strays to kill.
            "token": os.environ.get(TOKEN_ENV),
            "command": self.command,
            "started_at": time.time(),
            "child_pid": None,
            "child_start_ticks": None,
            "child_start_time": None,
            "child_pgid": None,
        }
        self.beat()
        log = self.log_fd()  # the child gets its own copy of the descriptor
        try:
            self.child = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                process_group=0,  # the child leads its own group: kill() takes its whole tree
                preexec_fn=_pdeathsig(me),  # safe: the shim has no other thread
                # close_fds (the default) keeps the lock away from the job: the lock
                # means "the shim is alive", and nothing else.
            )
        except OSError as e:
            missing = isinstance(e, FileNotFoundError | NotADirectoryError)
            code = EXIT_NOT_FOUND if missing else EXIT_NOT_EXECUTABLE
            self.say(f"cannot run {self.command[0]!r}: {e.strerror or e} (exit {code})")
            atomic_write_json(self.dir / SHIM_JSON, info)
            return self.finish(code, error=str(e))
        pid = self.child.pid
        info.update(
            child_pid=pid,
            child_start_ticks=start_ticks(pid),
            child_start_time=start_time(pid),
            child_pgid=pid,
        )
        atomic_write_json(self.dir / SHIM_JSON, info)
        for signum in self.pending:
            self.forward(signum, None)
        self.pending.clear()
        # Wait without reaping (WNOWAIT): while the child is an unreaped zombie its pid, and so
        # its process group id, cannot be reused, which makes the killpg below safe.
        next_beat = next_look = time.monotonic() + self.heartbeat_s
        while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
            time.sleep(0.05)
            now = time.monotonic()
            if now >= next_beat:
                self.beat()
                next_beat = now + self.heartbeat_s
            if now >= next_look:
                self.look_for_stop()
                next_look = now + STOP_LOOK_S
        # The job is its main process: whatever it left behind in its group (a DDP rank, a
        # stray worker) must not outlive it, holding a GPU nobody accounts for.
        leftovers = _group_members(pid)
        if leftovers:
            self.say(f"the job left {len(leftovers)} process(es) behind ({leftovers[:5]}): SIGKILL")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        returncode = self.child.wait()
        self.reaped = True
        code = exit_code_of(returncode)
        if returncode < 0:
            self.say(f"the job was killed by {signal.Signals(-returncode).name} (exit {code})")
        return self.finish(code)

    def look_for_stop(self) -> None:
        """SIGTERM to the child, once, when the stop file has appeared."""
        if self.stop_file is None or self.stop_seen:
            return
        with contextlib.suppress(OSError):
            if os.path.lexists(self.stop_file):
                self.stop_seen = True
                self.say(f"stop requested ({self.stop_file}): SIGTERM to the job")
                self.forward(signal.SIGTERM, None)

    def finish(self, code: int, error: str | None = None) -> int:
        record: dict[str, Any] = {"exit_code": code, "ended_at": time.time()}
        if error:
            record["error"] = error
        atomic_write_json(self.dir / EXIT_JSON, record)
        return code


def _group_members(pgid: int) -> list[int]:
    """Live processes in process group `pgid`, other than its leader."""
    members = []
    for pid in psutil.pids():
        if pid == pgid:
            continue
        try:
            in_group = os.getpgid(pid) == pgid
        except OSError:  # gone meanwhile
            continue
        info = proc_info(pid)
        if in_group and info is not None and not info.zombie:
            members.append(pid)
    return members


def lock_held(attempt_dir: Path) -> bool | None:
    """Whether a live shim holds the attempt's lock; None if there is no lock file.

    The executor takes the lock *before* it forks the shim and the shim inherits it, so there
    is no moment at which a started attempt looks absent: a control plane killed mid-launch
    and restarted sees "running" (the shim is starting), never "lost". The kernel releases
    the lock when the shim exits or is killed, zombie or not, whatever its pid becomes."""
    try:
        fd = os.open(attempt_dir / LOCK, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # shared: pollers never block each other
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases our shared lock
    return False


def take_lock(attempt_dir: Path) -> int | None:
    """Open and exclusively lock ATTEMPT_DIR/lock; the fd, or None if a shim holds it."""
    fd = os.open(attempt_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


USAGE = (
    "usage: python -m visionloop.sched.shim ATTEMPT_DIR [--heartbeat-s S] [--lock-fd FD] "
    "[--stop-file F] -- CMD..."
)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--" not in args or args.index("--") < 1 or args.index("--") == len(args) - 1:
        print(f"{USAGE}\nGive the attempt dir, then the command to run after --.", file=sys.stderr)
        return 2
    split = args.index("--")
    attempt_dir, options, command = Path(args[0]), args[1:split], args[split + 1 :]
    heartbeat_s, lock_fd, stop_file = DEFAULT_HEARTBEAT_S, None, None
    while options:
        if len(options) < 2 or options[0] not in ("--heartbeat-s", "--lock-fd", "--stop-file"):
            print(f"{USAGE}\nUnknown option {options[0]!r}.", file=sys.stderr)
            return 2
        if options[0] == "--heartbeat-s":
            heartbeat_s = float(options[1])
        elif options[0] == "--stop-file":
            stop_file = Path(options[1])
        else:
            lock_fd = int(options[1])  # inherited from the executor, already locked
        options = options[2:]
    attempt_dir.mkdir(parents=True, exist_ok=True)
    if lock_fd is None:  # started by hand: take the lock ourselves
        lock_fd = take_lock(attempt_dir)
        if lock_fd is None:
            print(f"another shim is running in {attempt_dir}; use a new attempt dir.", file=sys.stderr)
            return 2
    os.set_inheritable(lock_fd, False)  # held by this process only, for as long as it lives
    return Shim(attempt_dir, command, heartbeat_s, stop_file).run()


if __name__ == "__main__":
    sys.exit(main())
