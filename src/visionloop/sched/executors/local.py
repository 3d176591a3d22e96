"""The local executor: each attempt is a process tree on this machine, under a shim.

    LocalExecutor()                                   # GPUs discovered with NVML
    LocalExecutor(inventory=[Gpu("local/0", ...)])    # configured (fake) GPUs: no GPU needed

Every attempt runs as `python -m visionloop.sched.shim ATTEMPT_DIR -- CMD...` (see
visionloop.sched.shim), started in its own session, so a SIGKILL of the control plane, or of
its whole process group, never reaches a job. All an attempt's state lives in files in its
attempt dir, and the handle is plain JSON, so a control plane restarted after a crash polls,
signals and reads the logs of attempts a previous process started.

Decisions worth knowing:

- **GPU pinning.** A GPU's local index is the integer after the last "/" of its id, for
  discovered GPUs ("HOST/3" is NVML index 3) and configured ones alike ("local/0" → 0). The
  cluster config numbers each node's GPUs from 0: on a real machine, list its GPUs under one
  node; fake extra nodes ("spot-a/0") overlap its indices and only make sense without real
  GPUs. `launch` sets `CUDA_VISIBLE_DEVICES` to the allocated indices in allocation order
  ("1,3") and `CUDA_DEVICE_ORDER=PCI_BUS_ID`, because NVML numbers GPUs in PCI order while
  CUDA's default order is "fastest first": without it index 1 could be another job's GPU.
- **CPU jobs** (no GPUs allocated) get `CUDA_VISIBLE_DEVICES=""`: they see no GPU at all,
  rather than every GPU of the machine, which an unset variable would give them.
- **Multi-GPU jobs.** The command already carries `--nproc-per-node N` (visionloop's own DDP
  launcher, which speaks torchrun's environment and keeps exit code 75; see
  visionloop.train.launch). The executor only pins the devices; the launcher's ranks share
  the child's process group, so `kill` stops all of them.
- **A command that cannot be executed** (not found, not executable) is not an ExecutorError:
  `launch` returns a handle and `poll` reports `exited` with 127 (not found) or 126, as a
  shell would, and the log says why. A job's own failure always arrives as an exit code;
  ExecutorError means the executor itself could not do its part (no attempt dir, the shim
  did not start, the attempt dir was already used).
- **Also set for the job:** VISIONLOOP_JOB_ID, VISIONLOOP_ATTEMPT, VISIONLOOP_ATTEMPT_DIR,
  VISIONLOOP_ATTEMPT_TOKEN (a random marker every descendant inherits: how `kill` finds
  processes that left the job's group) and PYTHONUNBUFFERED=1 unless the request sets it
  (so `jobs logs --follow` is live). The job does *not* inherit the control plane's
  environment: only its clean base (PATH, HOME, locale, TZ, TMPDIR, VIRTUAL_ENV; see
  visionloop.sched.executors.env), then the request's env, then the pinning. `cpus` and
  `memory_gb` are placement hints only: nothing here enforces them (no cgroups). The job
  runs in the control plane's working directory, so commands should use absolute paths.
- **Alive, exited or lost.** `poll` reads exit.json first (exited), then asks whether the
  shim still holds the attempt's flock (running; locked before the shim is forked, so even
  an attempt whose control plane died mid-launch reads running, never lost). Otherwise the
  attempt is lost, and `poll` SIGKILLs whatever of it survived (orphaned DDP ranks) before
  saying so: the control plane requeues a lost job, which must never run twice.
- **Zombies.** The executor that launched a shim reaps it on every call (launch, poll,
  terminate, kill), so a long-running control plane does not collect finished shims; a
  restarted one reads the outcome from exit.json, and the orphaned shims are init's.
- Linux only (/proc, prctl, flock).

Handle (JSON, stored by the control plane with the attempt):

    {"executor": "local", "node": HOST, "attempt_dir": ABS PATH, "token": HEX,
     "pid": SHIM PID, "pid_start_time": EPOCH S, "pid_start_ticks": TICKS SINCE BOOT,
     "boot_id": STR, "child_pid": PID | null, "child_start_ticks": TICKS | null,
     "child_pgid": PGID | null, "cuda_visible_devices": "1,3"}

Only `attempt_dir` is indispensable: every method also accepts the bare
`{"attempt_dir": ...}` the control plane stores before calling `launch`, and fills in the
rest from the attempt's shim.json (`adopt` returns that completed handle; an addition to the
Executor protocol).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

from visionloop.core.errors import ExecutorError
from visionloop.sched import shim
from visionloop.sched.executors.attempt_files import log_tail, mtime, read_log, read_status
from visionloop.sched.executors.base import AttemptStatus, Handle, LaunchRequest
from visionloop.sched.executors.env import job_env
from visionloop.sched.view import Gpu

# How long `launch` waits for the shim to report its child started. A cold Python start on a
# loaded 2-core machine takes well under a second; this only bounds a broken installation.
DEFAULT_START_TIMEOUT_S = 30.0
# How long `kill` lets the shim record the SIGKILL of its child (exit.json, 137) before it
# kills the shim too. The shim notices within ~50 ms.
KILL_RECORD_WAIT_S = 2.0


class LocalExecutor:
    name = "local"

    def __init__(
        self,
        inventory: Sequence[Gpu] | None = None,
        *,
        heartbeat_s: float = shim.DEFAULT_HEARTBEAT_S,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
        python: str = sys.executable,
    ) -> None:
        """`inventory`: the GPUs to offer (None: discover them with NVML). `python` runs the
        shim; it must be able to import visionloop."""
        self._inventory = list(inventory) if inventory is not None else None
        if self._inventory is not None:
            _check_indices(self._inventory)
        self._discovered: list[Gpu] | None = None
        self.heartbeat_s = heartbeat_s
        self.start_timeout_s = start_timeout_s
        self.python = python
        self.node = socket.gethostname()
        self._lock = threading.Lock()
        # Shims launched here and not reaped yet, with their start ticks once known.
        self._shims: dict[int, tuple[subprocess.Popen[bytes], int | None]] = {}
        self._returncodes: dict[tuple[int, int | None], int] = {}  # (pid, start ticks) → code
        self._reaped_at = 0.0

    # -- capacity -------------------------------------------------------------------------

    def capacity(self) -> list[Gpu]:
        if self._inventory is not None:
            return list(self._inventory)
        if self._discovered is None:
            self._discovered = discover_gpus(self.node)
        return list(self._discovered)

    # -- launch ---------------------------------------------------------------------------

    def launch(self, request: LaunchRequest) -> Handle:
        self._reap()
        if not request.command:
            raise ExecutorError(f"job {request.job_id}: the command is empty; give the trainer command.")
        if request.nodes > 1:
            raise ExecutorError(
                f"job {request.job_id} spans {request.nodes} nodes, but the local executor runs on this "
                "machine only; run it with the Ray executor, or resubmit it with resources.nodes: 1."
            )
        known = {g.id for g in self.capacity()}
        unknown = [g.id for g in request.gpus if g.id not in known]
        if unknown:
            raise ExecutorError(
                f"job {request.job_id}: GPUs {unknown} are not on this executor (it has {sorted(known)}); "
                "allocate from LocalExecutor.capacity()."
            )
        devices = ",".join(str(gpu_index(g)) for g in request.gpus)
        attempt_dir = Path(request.attempt_dir).expanduser().resolve()
        try:
            attempt_dir.mkdir(parents=True, exist_ok=True)
            lock_fd = _take_lock(attempt_dir)
        except OSError as e:
            raise ExecutorError(
                f"cannot prepare the attempt dir {attempt_dir}: {e.strerror or e}; "
                "check the path and its permissions."
            ) from e
        try:
            if (attempt_dir / shim.SHIM_JSON).exists() or (attempt_dir / shim.EXIT_JSON).exists():
                raise ExecutorError(
                    f"attempt dir {attempt_dir} was already used by an earlier launch; launch each attempt "
                    "in a new dir, or take the earlier one over with LocalExecutor.adopt()."
                )
            token = secrets.token_hex(8)
            # A clean environment: nothing of ours (VISIONLOOP_DB_URL, credentials) but the base.
            env = job_env(os.environ, request.env)
            env.update(
                CUDA_VISIBLE_DEVICES=devices,
                CUDA_DEVICE_ORDER="PCI_BUS_ID",
                VISIONLOOP_JOB_ID=str(request.job_id),
                VISIONLOOP_ATTEMPT=str(request.attempt),
                VISIONLOOP_ATTEMPT_DIR=str(attempt_dir),
                **{shim.TOKEN_ENV: token},
            )
            argv = [self.python, "-m", "visionloop.sched.shim", str(attempt_dir)]
            argv += [
                "--heartbeat-s",
                str(self.heartbeat_s),
                "--lock-fd",
                str(lock_fd),
                "--",
                *request.command,
            ]
            try:
                with open(attempt_dir / shim.LOG, "ab") as log:
                    proc = subprocess.Popen(
                        argv,
                        stdin=subprocess.DEVNULL,
                        stdout=log,  # a file, never a pipe: a pipe would break when we die
                        stderr=log,
                        env=env,
                        start_new_session=True,  # out of our process group and session
                        pass_fds=(lock_fd,),  # the shim holds the lock from its first instant
                    )
            except OSError as e:
                raise ExecutorError(
                    f"cannot start the shim with {self.python!r}: {e.strerror or e}; "
                    "pass LocalExecutor(python=...) an interpreter that has visionloop installed."
                ) from e
        finally:
            os.close(lock_fd)  # the shim's inherited copy keeps the lock
        with self._lock:
            # Read now: the forked shim is ours, unreaped, so /proc still holds it even if it died.
            self._shims[proc.pid] = (proc, shim.start_ticks(proc.pid))
        info = self._wait_started(proc, attempt_dir, token)
        handle = _handle(self.node, attempt_dir, info)
        handle["cuda_visible_devices"] = devices
        return handle

    def _wait_started(self, proc: subprocess.Popen[bytes], attempt_dir: Path, token: str) -> dict[str, Any]:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            info = read_status(attempt_dir / shim.SHIM_JSON)
            if info is not None:
                return info
            if proc.poll() is not None:
                info = read_status(attempt_dir / shim.SHIM_JSON)  # it may have written, then exited
                if info is not None:
                    return info
                raise ExecutorError(
                    f"the shim exited with code {proc.returncode} before starting the job; its output "
                    f"({attempt_dir / shim.LOG}):\n{log_tail(attempt_dir / shim.LOG)}\n"
                    f"Check that {self.python!r} can run `-m visionloop.sched.shim`."
                )
            if time.monotonic() > deadline:
                # Leave nothing running: the job may have started without our knowing its pid.
                _sweep(token, signal.SIGKILL)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
                raise ExecutorError(
                    f"the shim did not report a started job within {self.start_timeout_s:.0f} s and was "
                    f"killed; its output:\n{log_tail(attempt_dir / shim.LOG)}\nIf the machine is very "
                    "loaded, raise LocalExecutor(start_timeout_s=...)."
                )
            time.sleep(0.01)

    def adopt(self, attempt_dir: Path) -> Handle | None:
        """The full handle of an attempt started in `attempt_dir`, rebuilt from its files; None
        if no shim has reported there (yet). For a control plane that died between `launch`
        and storing the handle. (An addition to the Executor protocol; every method also
        accepts the bare `{"attempt_dir": ...}` handle and completes it the same way.)"""
        attempt_dir = Path(attempt_dir).expanduser().resolve()
        info = read_status(attempt_dir / shim.SHIM_JSON)
        return None if info is None else _handle(self.node, attempt_dir, info)

    # -- poll -----------------------------------------------------------------------------

    def poll(self, handle: Handle) -> AttemptStatus:
        # Reaping walks every shim launched here, and a cycle polls every attempt: at most one
        # walk per cycle (64 running jobs made it 4,096 waitpid calls and 8 ms a cycle).
        self._reap(unless_within_s=0.05)
        attempt_dir = self._attempt_dir(handle)
        ended = _exited(attempt_dir)
        if ended is not None:
            return ended
        h = _complete(handle)
        # The lock is the authority; the pid check only guards against a lock file that was
        # removed or replaced under a live shim (a false "lost" would start the job twice).
        if shim.lock_held(attempt_dir) or _is_alive(h, "pid"):
            starting = "starting: the shim has not reported its job yet" if h.get("pid") is None else ""
            return AttemptStatus("running", detail=starting, heartbeat_at=mtime(attempt_dir / shim.HEARTBEAT))
        # The shim is gone. exit.json may have appeared since our first look.
        self._reap()  # its exit status, for the "lost" detail
        ended = _exited(attempt_dir)
        if ended is not None:
            return ended
        detail = self._why_lost(attempt_dir, h)
        # "lost" makes the control plane requeue the job: nothing of this attempt may live on
        # (a DDP rank orphaned when its launcher died with the shim would train twice).
        killed = _kill_remnants(h)
        if killed:
            detail += f"; killed {killed} leftover process(es) of the attempt"
        return AttemptStatus("lost", detail=detail, heartbeat_at=mtime(attempt_dir / shim.HEARTBEAT))

    def _why_lost(self, attempt_dir: Path, h: Handle) -> str:
        pid, ticks = h.get("pid"), h.get("pid_start_ticks")
        if pid is None:
            return (
                f"no shim ever reported in {attempt_dir} (no shim.json, nothing holds its lock): "
                "the attempt never started"
            )
        if not _same_boot(h):
            return f"the machine rebooted since shim pid {pid} started"
        info = shim.proc_info(pid)
        if info is None:
            why = f"shim pid {pid} is gone"
        elif info.start_ticks != ticks:
            why = f"shim pid {pid} is gone (the pid now belongs to another process)"
        else:
            why = f"shim pid {pid} exited"
        with self._lock:
            code = self._returncodes.get((pid, ticks))
        if code is not None:
            why += f" with {_describe(code)}"
        return why + " without writing exit.json (SIGKILL, or the OOM killer?)"

    # -- signals --------------------------------------------------------------------------

    def terminate(self, handle: Handle) -> None:
        """SIGTERM to the shim, which forwards it to the job's main process (the trainer, or
        its DDP launcher, which forwards to every rank). No-op if the shim is gone."""
        self._reap()
        h = self._await_pid(handle)
        if _is_alive(h, "pid"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(h["pid"], signal.SIGTERM)

    def kill(self, handle: Handle) -> None:
        """SIGKILL the job's whole process group and any stray descendant (found by the
        attempt's token), then the shim once it has recorded the exit (137). Safe on a
        finished or lost attempt, and never signals a process that merely reuses a pid."""
        self._reap()
        h = self._await_pid(handle)
        attempt_dir = Path(h["attempt_dir"])
        _kill_remnants(h)
        deadline = time.monotonic() + KILL_RECORD_WAIT_S
        while shim.lock_held(attempt_dir) and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.02)
        if _is_alive(h, "pid"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(h["pid"], signal.SIGKILL)
        self._reap()

    def _await_pid(self, handle: Handle) -> Handle:
        """The completed handle; if the shim is still starting (lock held, no shim.json yet),
        wait for it to report, so a signal sent at that moment is not lost."""
        attempt_dir = self._attempt_dir(handle)
        h = _complete(handle)
        deadline = time.monotonic() + self.start_timeout_s
        while h.get("pid") is None and shim.lock_held(attempt_dir) and time.monotonic() < deadline:
            time.sleep(0.01)
            h = _complete(handle)
        return h

    # -- logs -----------------------------------------------------------------------------

    def log_path(self, handle: Handle) -> Path | None:
        return self._attempt_dir(handle) / shim.LOG

    def read_log(self, handle: Handle, offset: int = 0) -> Iterator[bytes]:
        """The log from byte `offset` to its current end, in chunks; nothing if there is no log
        yet. A follower remembers offset + bytes received and calls again."""
        return read_log(self._attempt_dir(handle) / shim.LOG, offset)

    # -- internals ------------------------------------------------------------------------

    def _attempt_dir(self, handle: Handle) -> Path:
        if handle.get("executor", self.name) != self.name or "attempt_dir" not in handle:
            raise ExecutorError(f"not a local executor handle: {handle!r}; pass it to its own executor.")
        node = handle.get("node")
        if node and node != self.node:
            raise ExecutorError(
                f"this attempt runs on {node!r}, not on {self.node!r}: its processes can only be "
                "polled and signalled from that machine."
            )
        return Path(handle["attempt_dir"])

    def _reap(self, unless_within_s: float = 0.0) -> None:
        """Collect the exit status of finished shims we launched, so none stays a zombie
        (skipped if the last walk was less than `unless_within_s` ago)."""
        now = time.monotonic()
        if unless_within_s and now - self._reaped_at < unless_within_s:
            return
        self._reaped_at = now
        with self._lock:
            for pid, (proc, ticks) in list(self._shims.items()):
                if proc.poll() is not None:
                    self._returncodes[(pid, ticks)] = proc.returncode
                    del self._shims[pid]
            while len(self._returncodes) > 1024:  # only for "lost" details: keep the recent ones
                del self._returncodes[next(iter(self._returncodes))]


def _take_lock(attempt_dir: Path) -> int:
    """The attempt's lock, exclusively ours; waits out pollers (who hold it for microseconds)
    but not a live shim."""
    deadline = time.monotonic() + 1.0
    while (fd := shim.take_lock(attempt_dir)) is None:
        if time.monotonic() > deadline:
            raise ExecutorError(
                f"a shim is already running in {attempt_dir}; launch each attempt in a new dir, or "
                "take the running one over with LocalExecutor.adopt()."
            )
        time.sleep(0.01)
    return fd


def _kill_remnants(h: Handle) -> int:
    """SIGKILL the attempt's job: its process group while its leader is provably the job's
    (same start time), and every process carrying the attempt's token (ranks orphaned by a
    dead leader, processes that left the group). The shim is spared: it records the exit.
    Returns how many processes were found by their token."""
    if h.get("child_pgid") is not None and _is_alive(h, "child_pid"):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(h["child_pgid"], signal.SIGKILL)
    return _sweep(h["token"], signal.SIGKILL, spare=h.get("pid")) if h.get("token") else 0


def _same_boot(h: Handle) -> bool:
    return not h.get("boot_id") or h["boot_id"] == shim.boot_id()


def _is_alive(h: Handle, which: str) -> bool:
    """Whether the handle's shim ("pid") or job ("child_pid") is alive and is that very
    process: same boot, same start ticks; a pid merely reused by another process is not."""
    ticks = h.get("pid_start_ticks" if which == "pid" else "child_start_ticks")
    return _same_boot(h) and shim.same_process(h.get(which), ticks)


def _exited(attempt_dir: Path) -> AttemptStatus | None:
    ended = read_status(attempt_dir / shim.EXIT_JSON)
    if ended is None:
        return None
    return AttemptStatus("exited", exit_code=int(ended["exit_code"]), heartbeat_at=ended.get("ended_at"))


def _handle(node: str, attempt_dir: Path, info: dict[str, Any]) -> Handle:
    return {
        "executor": LocalExecutor.name,
        "node": node,
        "attempt_dir": str(attempt_dir),
        "token": info.get("token"),
        "pid": info.get("shim_pid"),
        "pid_start_time": info.get("shim_start_time"),
        "pid_start_ticks": info.get("shim_start_ticks"),
        "boot_id": info.get("boot_id"),
        "child_pid": info.get("child_pid"),
        "child_start_ticks": info.get("child_start_ticks"),
        "child_pgid": info.get("child_pgid"),
    }


def _complete(handle: Handle) -> Handle:
    """The handle with any missing process field filled in from the attempt's shim.json."""
    keys = ("pid", "pid_start_ticks", "child_pid", "child_start_ticks", "child_pgid", "boot_id", "token")
    if all(k in handle for k in keys):
        return handle
    info = read_status(Path(handle["attempt_dir"]) / shim.SHIM_JSON)
    if info is None:
        return handle
    filled = _handle(handle.get("node", ""), Path(handle["attempt_dir"]), info)
    return {**filled, **{k: v for k, v in handle.items() if v is not None}}


def _sweep(token: str, sig: signal.Signals, spare: int | None = None) -> int:
    """Signal every process whose environment carries this attempt's token (except `spare`
    and ourselves). Reads /proc/PID/environ, which only shows our own user's processes."""
    me, found = os.getpid(), 0
    marker = f"{shim.TOKEN_ENV}={token}".encode()
    for pid in psutil.pids():
        if pid in (me, spare):
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                ours = marker in f.read().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        if ours:
            found += 1
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    return found


def _describe(returncode: int) -> str:
    if returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"code {returncode}"


# -- GPUs ---------------------------------------------------------------------------------

_INDEX = re.compile(r"/(\d+)$")


def gpu_index(gpu: Gpu) -> int:
    """The local device index of a GPU: the integer after the last "/" of its id."""
    m = _INDEX.search(gpu.id)
    if not m:
        raise ExecutorError(
            f"GPU id {gpu.id!r} does not end in a device index; name local GPUs like 'local/0', "
            "where 0 is the index CUDA_VISIBLE_DEVICES should get."
        )
    return int(m.group(1))


def _check_indices(gpus: Sequence[Gpu]) -> None:
    """Each GPU needs its own device index on its node. (Several nodes in one local inventory
    are a simulation, as in a test config with a fake "spot-a" node: their indices overlap.)"""
    seen: dict[tuple[str, int], str] = {}
    for g in gpus:
        key = (g.node, gpu_index(g))
        if key in seen:
            raise ExecutorError(
                f"GPUs {seen[key]!r} and {g.id!r} map to the same device index {key[1]} on node "
                f"{g.node!r}; give each GPU of a node its own index, e.g. 'local/0', 'local/1'."
            )
        seen[key] = g.id


_VENDOR = re.compile(r"^(NVIDIA|Tesla|Quadro|GeForce)\s+", re.IGNORECASE)
_NOT_MODEL = re.compile(r"^(\d+GB|SXM\d*|PCIE|HBM\d*E?|NVL|NVLINK|MIG.*)$", re.IGNORECASE)
_MARKETED_GB = (4, 6, 8, 10, 11, 12, 16, 20, 24, 32, 40, 48, 64, 80, 94, 96, 141, 144, 180, 192, 288)


def gpu_type(nvml_name: str, memory_bytes: int) -> str:
    """A catalog type name from NVML's: "NVIDIA H100 80GB HBM3" → "H100-80GB",
    "NVIDIA A100-SXM4-40GB" → "A100-40GB", "NVIDIA GeForce RTX 4090" (24 GiB) → "RTX4090-24GB".
    The size is the one in the name, else the marketed size the memory rounds up to (an
    "A10G" reports 22.5 GiB and is sold as 24 GB)."""
    name = nvml_name.strip()
    while (stripped := _VENDOR.sub("", name)) != name:
        name = stripped
    tokens = [t for t in re.split(r"[\s\-_]+", name) if t]
    in_name = [int(t[:-2]) for t in tokens if re.fullmatch(r"\d+GB", t, re.IGNORECASE)]
    model = "".join(t for t in tokens if not _NOT_MODEL.match(t)) or "GPU"
    if in_name:
        gb = in_name[0]
    else:
        gib = memory_bytes / 2**30
        gb = next((s for s in _MARKETED_GB if gib <= s * 1.01), round(gib))
    return f"{model}-{gb}GB"


def discover_gpus(node: str) -> list[Gpu]:
    """This machine's GPUs as NVML sees them (ids "NODE/INDEX", owned). No NVML library or
    no driver means no GPUs: the executor still runs CPU jobs."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded):
        return []
    except pynvml.NVMLError as e:
        raise ExecutorError(
            f"NVML could not start ({e}); check `nvidia-smi`, or configure the GPUs with "
            "LocalExecutor(inventory=[...])."
        ) from e
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            dev = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(dev)
            name = name.decode() if isinstance(name, bytes) else str(name)
            memory = int(pynvml.nvmlDeviceGetMemoryInfo(dev).total)
            gpus.append(Gpu(id=f"{node}/{i}", node=node, type=gpu_type(name, memory), price_class="owned"))
        return gpus
    except pynvml.NVMLError as e:
        raise ExecutorError(f"NVML failed while listing GPUs ({e}); check `nvidia-smi`.") from e
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
