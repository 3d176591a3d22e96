"""The quota guarantee, measured in the simulator: a team whose queued job fits in its unused
nominal quota should get it within a cycle plus the grace period (the time a reclaim takes).
Each unbroken stretch a team spends so is recorded: the total, the longest, how many outlast
the guarantee, and of those how many began with fewer GPUs up than the quotas add up to (a
spot node down: then not every team can have its quota, whatever the policy).

A second measure counts only what some policy could have done: stretches in which the
GPUs existed, free or lent to teams beyond their own nominal quota, of a kind the job
accepts (a job that never runs on spot cannot be given its quota on spot GPUs).
`waiting_in_quota` picks the teams for both."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from visionloop.sched.view import Gpu, SpotPolicy, Team


def waiting_in_quota(
    queued: Iterable[tuple[str, int, SpotPolicy]],
    held: Mapping[str, tuple[int, int]],
    free: tuple[int, int],
    teams: Mapping[str, Team],
) -> tuple[set[str], set[str]]:
    """Teams with a queued job (team, GPUs, spot policy) that fits in their unused nominal
    quota; and those of them with such a job that the GPUs up could hold: free ones plus
    those other teams hold beyond their nominal quota, of a kind it accepts. `held` (per
    team) and `free` count (GPUs not on spot, GPUs on spot)."""
    jobs = [(str(i), *j) for i, j in enumerate(queued)]
    team_of = {i: team for i, team, _, _ in jobs}
    fits, there = jobs_in_quota(jobs, held, free, teams)
    return {team_of[i] for i in fits}, {team_of[i] for i in there}


def jobs_in_quota(
    queued: Iterable[tuple[str, str, int, SpotPolicy]],
    held: Mapping[str, tuple[int, int]],
    free: tuple[int, int],
    teams: Mapping[str, Team],
) -> tuple[set[str], set[str]]:
    """`waiting_in_quota` job by job: of the queued jobs (id, team, GPUs, spot policy), those
    that fit in their team's unused nominal quota, and those of them the GPUs up could hold."""
    fits: set[str] = set()
    there: set[str] = set()
    rooms: dict[tuple[str, bool], int] = {}
    for job_id, name, gpus, spot in queued:
        team = teams.get(name)
        own = held.get(name, (0, 0))
        if team is None or gpus > team.nominal_gpus - own[0] - own[1]:
            continue
        fits.add(job_id)
        never = spot == "never"
        room = rooms.get((name, never))
        if room is None:
            room = free[0] + (0 if never else free[1])
            for other, (fixed, on_spot) in held.items():
                lent = fixed + on_spot - (teams[other].nominal_gpus if other in teams else 0)
                if other != name and lent > 0:
                    room += min(lent, fixed + (0 if never else on_spot))
            rooms[(name, never)] = room
        if gpus <= room:
            there.add(job_id)
    return fits, there


class QuotaMeter:
    """The measures over a run: `every` counts each team's stretches, `reclaimable` only
    while the GPUs were there to give, and `jobs` each job's own (the guarantee read job by
    job: a team whose jobs each get their quota in time, one after another, may still have
    had one waiting all along, as when its own classes preempt each other). `update` after
    every cycle, `close` at the end of the run."""

    def __init__(self, teams: Mapping[str, Team], guarantee_s: float) -> None:
        self.teams = teams
        self.every = QuotaWatch(teams, guarantee_s)
        self.reclaimable = QuotaWatch(teams, guarantee_s)
        self.jobs = QuotaWatch(teams, guarantee_s)

    def update(
        self,
        t: float,
        queued: Iterable[tuple[str, str, int, SpotPolicy]],
        gpus: Iterable[Gpu],
        team_of: Mapping[str, str],
    ) -> None:
        """After a cycle: the queued jobs (id, team, GPUs, spot policy), the GPUs, and the
        team that holds each held GPU."""
        held: dict[str, tuple[int, int]] = {}
        free = [0, 0]
        up = 0
        for g in gpus:
            spot = int(g.spot)
            team = team_of.get(g.id)
            if team is not None:
                k = held.get(team, (0, 0))
                held[team] = (k[0] + 1 - spot, k[1] + spot)
            elif g.up:
                free[spot] += 1
            up += g.up
        jobs = list(queued)
        fits, there = jobs_in_quota(jobs, held, (free[0], free[1]), self.teams)
        team_of_job = {job_id: team for job_id, team, _, _ in jobs}
        self.every.update(t, {team_of_job[i] for i in fits}, lambda: up)
        self.reclaimable.update(t, {team_of_job[i] for i in there}, lambda: up)
        self.jobs.update(t, there, lambda: up)

    def close(self, t: float) -> None:
        self.every.close(t)
        self.reclaimable.close(t)
        self.jobs.close(t)


class QuotaWatch:
    """The stretches each team (or job) waits in unused quota; `update` after every cycle,
    `close` at the end of the run."""

    def __init__(self, teams: Mapping[str, Team], guarantee_s: float) -> None:
        self.nominal = sum(t.nominal_gpus for t in teams.values())
        self.guarantee_s = guarantee_s
        self.since: dict[str, float] = {}  # team -> when its current stretch began
        self.short: set[str] = set()  # teams whose current stretch began short of GPUs
        self.total_s: dict[str, float] = {}
        self.longest_s: dict[str, float] = {}
        self.late = 0
        self.late_short = 0

    def update(self, t: float, waiting: set[str], up_gpus: Callable[[], int]) -> None:
        """Open a stretch for each team that now waits in unused quota (`up_gpus` is asked
        only then), close the others'."""
        for team in waiting:
            if team not in self.since:
                self.since[team] = t
                if up_gpus() < self.nominal:
                    self.short.add(team)
        for team in [team for team in self.since if team not in waiting]:
            held = t - self.since.pop(team)
            self.total_s[team] = self.total_s.get(team, 0.0) + held
            self.longest_s[team] = max(self.longest_s.get(team, 0.0), held)
            late = held > self.guarantee_s
            self.late += late
            self.late_short += late and team in self.short
            self.short.discard(team)

    def close(self, t: float) -> None:
        self.update(t, set(), lambda: 0)
