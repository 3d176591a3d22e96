"""The control plane's configuration: `<home>/cluster.toml` (or a path given to `up`).

Everything here is policy a team lead edits: where jobs run (the executor), priority
classes, teams and their quotas, the GPU inventory (omit it to discover GPUs with NVML), the
price catalog and the scheduler's timings. A missing file means a one-machine default: the
local executor, discovered GPUs, one team `default` entitled to all of them, the default
priority classes.

    prices = "prices.toml"   # optional: your own catalog (relative to this file; top-level
                             # keys come before the first [table] in TOML)

    [executor]               # where jobs run; omit the section for "local"
    kind = "local"           # subprocesses on this machine (GPUs: [[inventory]] or NVML)
    # kind = "ray"           # jobs on an existing Ray cluster, through its job submission API
    # address = "http://127.0.0.1:8265"  # ray: the head's dashboard URL (this is the default)
    # prefix = "vl"          # ray: starts every submission id; one per installation sharing a cluster
    # request_timeout_s = 30 # ray: every call to the dashboard gives up after this long
    # kind = "slurm"         # jobs as sbatch jobs on an existing Slurm cluster
    # partition = "gpu"      # slurm: where jobs go (default: the cluster's default partition)
    # account = "vision"     # slurm: charged to this account (optional)
    # slurm_conf = "/etc/slurm/slurm.conf"  # slurm: default $SLURM_CONF, else Slurm's own
    # command_timeout_s = 30 # slurm: every sbatch/squeue/scontrol/scancel/sinfo gives up after this
    # python = "/opt/vl/.venv/bin/python"  # slurm: visionloop's interpreter on the nodes

    [scheduler]
    cycle_s = 2.0            # how often the scheduler runs (it also runs on every event)
    grace_s = 120            # SIGTERM → this long to checkpoint and exit 75 → SIGKILL
    min_runtime_s = 600      # a job younger than this is never preempted (but by the top class)
    top_class_preempts_young = true  # the top class (e.g. high) need not wait for min_runtime_s
    reclaim_preempts_young = true    # nor a team reclaiming from a job that checkpoints at SIGTERM
    quota_under_head = true  # a team's lower classes take its quota while its head must borrow
    holds_yield_to_quota = true  # ...and the free GPUs held idle for it or other teams' borrowers
    hold_freed_for_job = true  # GPUs a victim frees stay the job's it stepped aside for (a reclaim)
    quota_keeps_lower_classes = true  # in its team's quota, a job that checkpoints keeps it from others
    hold_within_s = 60       # free GPUs idle for a blocked job only if its victims come due this soon
    heartbeat_timeout_s = 60 # a running job silent for this long is declared lost
    retry_backoff_s = 30     # first retry delay after a failure; doubles per restart
    inventory_sync_s = 30    # re-read the executor's GPUs this often (Ray nodes come and go); 0: never
    order = "las"            # or "srpt" (least remaining time by the jobs' max_runtime), "fifo"
    srpt_preemption = false  # with "srpt": evict a same-class job with over twice the time left
    las_preemption = true    # a job under las_threshold_gpu_s of GPU-time evicts a same-class one past it
    las_threshold_gpu_s = 3250  # Tiresias' threshold between its two queues
    victim_order = "least_lost"  # or "smallest" (Slurm's: fewest GPUs, then youngest)
    easy_backfill = false    # reservations hold their free GPUs for jobs whose max_runtime ends first
    reservation_tenants = false  # with easy_backfill: others start there too, and step aside when due

    [priorities]             # class name = rank (higher runs first)
    low = 10
    normal = 50
    high = 100

    [jobs]                   # what a job may touch (both optional)
    allowed_roots = ["/data/shared"]  # every path in a job spec must lie under one of these;
                             # default: the home's datasets/ and weights/
    env_allow = ["HF_HOME"]  # extra variables passed from the control plane's environment
    max_queued_per_team = 2000  # a team's submits past this many waiting jobs get a 429; 0: no limit

    [[teams]]
    name = "detection"
    nominal_gpus = 2
    borrow_limit = 2
    weight = 1.0
    allowed_roots = ["/data/detection", "/data/shared/weights"]  # this team's, instead of [jobs]'

    [[inventory]]            # local only. 4 fake GPUs, 2 of them spot: the whole policy without GPUs
    node = "local"
    type = "fake"
    count = 2
    price_class = "owned"
    [[inventory]]
    node = "spot-a"
    type = "fake"
    count = 2
    price_class = "spot"

With `kind = "ray"` the GPUs are the Ray cluster's (read when the control plane starts:
every alive node's `GPU` resource, typed and priced by node labels such as
`visionloop.io/gpu-type` and `visionloop.io/price-class`; see
visionloop.sched.executors.ray), so an `[[inventory]]` next to it is an error rather than
silently ignored: the scheduler would otherwise place jobs on GPUs Ray does not have. Paths in
job specs, the visionloop home and run dirs must be valid on the Ray nodes (shared storage).
With `kind = "slurm"` they are the partition's: every node that takes work, its `gpu` gres
typed and priced by node features (`Feature=gpu_type:A100-80GB,spot`; see
visionloop.sched.executors.slurm); the same shared storage is needed, and visionloop installed
on the nodes (`python`).
**What a job may read.** Every path in a job spec (`data.dataset`, `model.pretrained`) must be
absolute and lie, after symbolic links and `..` are resolved, under one of the allowed roots
of the team the job is for (admins submitting for a team are bound by that team's roots): the
team's `allowed_roots`, else `[jobs] allowed_roots`, else the home's `datasets/` and
`weights/`. It is checked at submit and again when each attempt is launched. What a job writes
(its run dir and attempt dir) the control plane chooses, under the home.

**What a job inherits.** Jobs start with a clean environment: PATH, HOME, USER, LOGNAME, LANG,
LANGUAGE, LC_*, TZ, TMPDIR, VIRTUAL_ENV, the visionloop variables the job needs
(VISIONLOOP_HOME, VISIONLOOP_TRACKING_URI, VISIONLOOP_EXPERIMENT) and the executor's own
(CUDA_VISIBLE_DEVICES, ...), plus the names in `[jobs] env_allow`. Nothing else of the control
plane's environment (VISIONLOOP_DB_URL, cloud credentials) reaches a job.

**How much a team may queue.** A team with `[jobs] max_queued_per_team` jobs waiting (2,000 by
default; Slurm's `MaxSubmitJobs`) has further submissions refused, with the count and what to
do, until some start or are cancelled: a runaway script cannot bury the other teams' jobs or
slow the scheduling cycle, which is measured at 10,000 waiting jobs. A tuning study waits
and submits again.

Switch executors only with no job running: `up` refuses to start while jobs have open
attempts on another executor (it could not find their processes, and would run them twice).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from visionloop.core.errors import ConfigError
from visionloop.core.fsutil import NotRegularFileError, NotTextError, TooLargeError, read_capped_text
from visionloop.core.safetoml import TomlError, load_toml
from visionloop.sched.config_executor import ExecutorConfig, parse_executor
from visionloop.sched.config_scheduler import SchedulerTimings, parse_scheduler
from visionloop.sched.config_values import MAX_GPUS, number, shown, where, whole_number
from visionloop.sched.view import DEFAULT_PRIORITIES, Gpu, PriceClass, Team

DEFAULT_TEAM = "default"
# Five busy teams at the default stay within the 10,000 waiting jobs the cycle is measured at.
DEFAULT_MAX_QUEUED_PER_TEAM = 2000
MAX_QUEUED_PER_TEAM = 10_000_000
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# ASCII only: str.isalnum() also takes "²", "٣" and look-alikes such as a Cyrillic "е", which
# make two teams (or nodes) that print the same, and a name typed decomposed (e + U+0301)
# would be refused where the composed one passed.
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
# A cluster.toml is a page or two; a file past this is not one (and is not read into memory).
MAX_CONFIG_BYTES = 1024 * 1024
# Ranks go to the job store's 32-bit INTEGER column with every job; beyond this is a typo.
MAX_RANK = 1_000_000
# Fair-share weights are ratios: past this, sums of them stop being meaningful floats.
MAX_WEIGHT = 1_000_000.0


@dataclass(frozen=True)
class ClusterConfig:
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    timings: SchedulerTimings = field(default_factory=SchedulerTimings)
    priorities: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_PRIORITIES))
    teams: tuple[Team, ...] = ()
    inventory: tuple[Gpu, ...] | None = None  # None: discover with NVML
    prices: Path | None = None
    source: Path | None = None
    # Where job specs' paths may point: [jobs] allowed_roots (None: the home's datasets/ and
    # weights/), and per team, its own `allowed_roots` instead.
    allowed_roots: tuple[Path, ...] | None = None
    team_roots: Mapping[str, tuple[Path, ...]] = field(default_factory=dict)
    # Extra variable names passed from the control plane's environment to every job.
    env_allow: tuple[str, ...] = ()
    # A team's submissions past this many waiting jobs are refused (None: no limit).
    max_queued_per_team: int | None = DEFAULT_MAX_QUEUED_PER_TEAM

    def roots_for(self, team: str) -> tuple[Path, ...] | None:
        """The folders `team`'s jobs may use (None: the defaults, the home's datasets/ and
        weights/)."""
        return self.team_roots.get(team, self.allowed_roots)

    def priority_rank(self, name: str) -> int:
        try:
            return self.priorities[name]
        except KeyError:
            known = ", ".join(f"{k} ({v})" for k, v in sorted(self.priorities.items(), key=lambda kv: kv[1]))
            raise ConfigError(f"unknown priority class {name!r}; the classes are: {known}.") from None


def _known(entry: Mapping[str, Any], what: str, keys: tuple[str, ...], path: Path | None) -> None:
    unknown = set(entry) - set(keys)
    if unknown:
        raise ConfigError(
            f"{where(path, what)} has unknown keys {sorted(unknown)}; known: {', '.join(keys)}. "
            "(In TOML, a top-level key such as `prices` written after a [[table]] belongs to that "
            "table: move it to the top of the file.)"
        )


def _name(v: Any, what: str, path: Path | None, example: str = 'name = "detection"') -> str:
    if not isinstance(v, str) or not _NAME.fullmatch(v):
        raise ConfigError(
            f"{where(path, what)} must be a name of 1 to 64 ASCII letters, digits, '-', '_' or '.', "
            f"got {shown(v)} (e.g. {example})."
        )
    return v


def _roots(v: Any, what: str, path: Path | None) -> tuple[Path, ...]:
    example = 'allowed_roots = ["/data/detection"]'
    # No NUL: Path() takes it, and the first check of a job's paths would then fail with
    # "embedded null byte" inside the API instead of here.
    if not isinstance(v, list) or not v or not all(isinstance(r, str) and r and "\0" not in r for r in v):
        raise ConfigError(
            f"{where(path, what)} must be a non-empty list of folders, got {shown(v)} (e.g. {example})."
        )
    roots = tuple(Path(r).expanduser() for r in v)
    relative = [str(r) for r in roots if not r.is_absolute()]
    if relative:
        raise ConfigError(
            f"{where(path, what)}: {', '.join(relative)} must be absolute folders (e.g. {example})."
        )
    return roots


def _jobs(section: Any, path: Path | None) -> tuple[tuple[Path, ...] | None, tuple[str, ...], int | None]:
    if not isinstance(section, dict):
        raise ConfigError(f'{where(path, "[jobs]")} must be a table, e.g. [jobs] env_allow = ["HF_HOME"].')
    _known(section, "[jobs]", ("allowed_roots", "env_allow", "max_queued_per_team"), path)
    roots = None
    if "allowed_roots" in section:
        roots = _roots(section["allowed_roots"], "jobs.allowed_roots", path)
    names = section.get("env_allow", [])
    if not isinstance(names, list) or not all(isinstance(n, str) and _ENV_NAME.fullmatch(n) for n in names):
        raise ConfigError(
            f"{where(path, 'jobs.env_allow')} must be a list of environment variable names, got "
            f'{shown(names)} (e.g. env_allow = ["HF_HOME", "WANDB_MODE"]).'
        )
    limit = whole_number(
        section,
        "max_queued_per_team",
        DEFAULT_MAX_QUEUED_PER_TEAM,
        path,
        2000,
        maximum=MAX_QUEUED_PER_TEAM,
        section="jobs",
    )
    return roots, tuple(dict.fromkeys(names)), limit or None


def parse_cluster_config(doc: Mapping[str, Any], path: Path | None = None) -> ClusterConfig:
    sections = ("executor", "scheduler", "priorities", "teams", "inventory", "prices", "jobs")
    unknown = set(doc) - set(sections)
    if unknown:
        raise ConfigError(
            f"{path or 'cluster config'}: unknown keys {sorted(unknown)}; known: {', '.join(sections)}."
        )
    executor = parse_executor(doc.get("executor", {}), path)
    if executor.kind == "ray" and "inventory" in doc:
        raise ConfigError(
            f"{where(path, '[[inventory]]')} lists GPUs for the local executor, but executor.kind is "
            '"ray": the GPUs are the Ray cluster\'s. Remove [[inventory]]; set GPU types and price '
            "classes as Ray node labels (`ray start ... --labels "
            "visionloop.io/gpu-type=A100-80GB,visionloop.io/price-class=spot`)."
        )
    if executor.kind == "slurm" and "inventory" in doc:
        raise ConfigError(
            f"{where(path, '[[inventory]]')} lists GPUs for the local executor, but executor.kind is "
            "\"slurm\": the GPUs are the Slurm partition's (its nodes' gpu gres). Remove [[inventory]]; "
            "set GPU types and price classes as node features in slurm.conf "
            "(`Feature=gpu_type:A100-80GB,spot`)."
        )
    timings = parse_scheduler(doc.get("scheduler", {}), path)
    priorities = dict(DEFAULT_PRIORITIES)
    if "priorities" in doc:
        raw = doc["priorities"]
        if not isinstance(raw, dict) or not raw:
            raise ConfigError(
                f"{where(path, '[priorities]')} must map class names to ranks, e.g. high = 100."
            )
        priorities = {
            _name(k, "priorities", path, "batch = 30"): whole_number(raw, k, None, path, 50, maximum=MAX_RANK)
            for k in raw
        }
    allowed_roots, env_allow, max_queued = _jobs(doc.get("jobs", {}), path)
    teams: list[Team] = []
    team_roots: dict[str, tuple[Path, ...]] = {}
    for entry in _tables(doc, "teams", 'name = "detection"', path):
        if not isinstance(entry, dict):
            raise ConfigError(f"{where(path, '[[teams]]')} entries must be tables with a name.")
        _known(entry, "[[teams]]", ("name", "nominal_gpus", "borrow_limit", "weight", "allowed_roots"), path)
        weight = number(entry, "weight", 1.0, path, minimum=0.001, maximum=MAX_WEIGHT)
        teams.append(
            Team(
                name=_name(entry.get("name"), "teams.name", path, 'name = "detection"'),
                nominal_gpus=whole_number(entry, "nominal_gpus", 0, path, 2),
                borrow_limit=whole_number(entry, "borrow_limit", 0, path, 2),
                weight=weight,
            )
        )
        if "allowed_roots" in entry:
            team_roots[teams[-1].name] = _roots(entry["allowed_roots"], "teams.allowed_roots", path)
    twice = sorted(name for name, n in Counter(t.name for t in teams).items() if n > 1)
    if twice:
        # Named: with dozens of teams, "a team is listed twice" leaves the admin to search.
        raise ConfigError(
            f"{where(path, '[[teams]]')}: {shown(twice)} listed more than once; merge each into one "
            "[[teams]] table."
        )
    inventory: list[Gpu] | None = None
    if "inventory" in doc:
        inventory = []
        on_node: Counter[str] = Counter()  # GPUs listed so far per node: the next one's index
        for entry in _tables(doc, "inventory", "count = 2", path):
            if not isinstance(entry, dict):
                raise ConfigError(f"{where(path, '[[inventory]]')} entries must be tables, e.g. count = 2.")
            _known(entry, "[[inventory]]", ("node", "type", "count", "price_class"), path)
            node = _name(entry.get("node", "local"), "inventory.node", path, 'node = "gpu-1"')
            gpu_type = _name(entry.get("type", "fake"), "inventory.type", path, 'type = "A100-80GB"')
            price_class = entry.get("price_class", "owned")
            if price_class not in get_args(PriceClass):
                raise ConfigError(
                    f"{where(path, 'inventory.price_class')} must be one of {list(get_args(PriceClass))}, "
                    f"got {price_class!r}."
                )
            # Counted as we go, not summed over the inventory per entry: 45,000 one-GPU entries
            # (630 KB) took 19 s that way.
            start = on_node[node]
            count = whole_number(entry, "count", 1, path, 4)
            # Checked before a Gpu is built: `count = 1000000000` would otherwise fill memory
            # (and every cycle would walk them) before anything said a word.
            if len(inventory) + count > MAX_GPUS:
                raise ConfigError(
                    f"{where(path, '[[inventory]]')} lists more than {MAX_GPUS} GPUs (the limit of one "
                    "inventory); check each entry's count, e.g. count = 4."
                )
            for i in range(count):
                inventory.append(
                    Gpu(id=f"{node}/{start + i}", node=node, type=gpu_type, price_class=price_class)
                )
            on_node[node] += count
    prices = None
    if "prices" in doc:
        # Not empty: "" is the config's own folder, which then fails as "a folder" far from here.
        if not isinstance(doc["prices"], str) or not doc["prices"].strip() or "\0" in doc["prices"]:
            raise ConfigError(
                f"{where(path, 'prices')} must be the path of a TOML file, got {shown(doc['prices'])} "
                '(e.g. prices = "prices.toml"); remove the key for the shipped catalog.'
            )
        prices = Path(doc["prices"]).expanduser()
        if path is not None and not prices.is_absolute():
            prices = path.parent / prices
    return ClusterConfig(
        executor=executor,
        timings=timings,
        priorities=priorities,
        teams=tuple(teams),
        inventory=tuple(inventory) if inventory is not None else None,
        prices=prices,
        source=path,
        allowed_roots=allowed_roots,
        team_roots=team_roots,
        env_allow=env_allow,
        max_queued_per_team=max_queued,
    )


def _tables(doc: Mapping[str, Any], key: str, example: str, path: Path | None) -> list[Any]:
    """`[[key]]`'s entries. A `[key]` table (one bracket) or `key = "..."` would otherwise be
    iterated for its keys or characters, and the error would blame entries that do not exist."""
    v = doc.get(key, [])
    if not isinstance(v, list):
        raise ConfigError(
            f"{where(path, key)} must be a list of [[{key}]] tables (two brackets), got {shown(v)}; "
            f"e.g.\n[[{key}]]\n{example}"
        )
    return v


def load_cluster_config(path: Path) -> ClusterConfig:
    """Read `path`; a missing file gives the one-machine default."""
    # exists(), not is_file(): a FIFO, device or folder named cluster.toml is refused below
    # (read_capped_text), not silently read as "no config" (all GPUs to one default team).
    if not path.exists():
        return ClusterConfig()
    hint = "Fix it, or remove it for the defaults."
    try:
        # A regular file only: a FIFO would block, /dev/zero never ends.
        text = read_capped_text(path, MAX_CONFIG_BYTES, what="a cluster config")
    except NotRegularFileError as e:
        raise ConfigError(f"cluster config {path} {(e.strerror or '').split(';')[0]}. {hint}") from None
    except OSError as e:
        raise ConfigError(f"cannot read the cluster config {path}: {e.strerror or e}.") from None
    except TooLargeError:
        raise ConfigError(
            f"cluster config {path} is larger than {MAX_CONFIG_BYTES // 1024} KiB, too large to be one; "
            f"check that --config names the right file. {hint}"
        ) from None
    except NotTextError as e:
        raise ConfigError(f"cluster config {e}") from None
    try:
        doc = load_toml(text)
    except TomlError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}. {hint}") from e
    return parse_cluster_config(doc, path)
