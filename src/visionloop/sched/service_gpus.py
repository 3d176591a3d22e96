"""The control plane's side of the GPU inventory: the executor's GPUs read at start-up and
again every `inventory_sync_s`, the teams' quotas set from the config (or following the
inventory when there is none), and spot interruptions taking GPUs away and giving them back."""

from __future__ import annotations

from visionloop.core.errors import ExecutorError, NotFoundError
from visionloop.sched.config import DEFAULT_TEAM
from visionloop.sched.service_base import PlaneBase, log
from visionloop.sched.states import JobState
from visionloop.sched.view import Team


class GpuSyncMixin(PlaneBase):
    """Keeping the store's inventory and quotas in step with the executor and the config."""

    def _sync_inventory(self) -> None:
        self.store.sync_gpus(self.executor.capacity())
        self._inventory_at = self.clock()

    def _resync_inventory(self, now: float) -> None:
        """Every `inventory_sync_s`, read the executor's GPUs again: a Ray node that joined
        adds its GPUs, one that left has its GPUs marked down (not deleted: attempts on them
        are still being settled, and a failure there counts as an interruption, not a
        failure). An executor that cannot answer keeps the inventory as it is."""
        every = self.config.timings.inventory_sync_s
        if every <= 0 or now - self._inventory_at < every:
            return
        self._inventory_at = now
        try:
            found = self.executor.capacity()
        except ExecutorError as e:
            log.warning("could not re-read the executor's GPUs (%s); keeping the inventory as it is", e)
            return
        before = {g.id: g.up for g in self.store.list_gpus()}
        after = {g.id: g.up for g in self.store.sync_gpus(found, now=now, missing="down")}
        added = sorted(after.keys() - before.keys())
        gone = sorted(k for k, up in after.items() if before.get(k) and not up)
        back = sorted(k for k, up in after.items() if up and before.get(k) is False)
        if added or gone or back:
            log.info("inventory changed: new GPUs %s, gone %s, back %s", added, gone, back)
        self._follow_inventory(sum(before.values()), sum(after.values()))  # GPUs up

    def _follow_inventory(self, before: int, after: int) -> None:
        """With no teams configured, the default team is entitled to every GPU that is up: when
        Ray nodes join (or the control plane first started with none) its quota grows with
        them, and it shrinks when they leave. A quota someone set by hand (`visionloop admin
        team set default ...`, not equal to the count before) is left alone."""
        if self.config.teams or before == after:
            return
        team = self.store.get_team(DEFAULT_TEAM)
        if team is not None and team.nominal_gpus == before:
            self.store.upsert_team(DEFAULT_TEAM, after, team.borrow_limit, team.weight)
            log.info("the default team's quota follows the inventory: %d -> %d GPUs", before, after)

    def _sync_teams(self) -> None:
        teams = list(self.config.teams)
        if not teams and self.store.get_team(DEFAULT_TEAM) is None:
            # One machine, no config: a single team entitled to every GPU.
            n = sum(g.up for g in self.store.list_gpus())
            teams = [Team(DEFAULT_TEAM, nominal_gpus=n, borrow_limit=0)]
        for team in teams:
            self.store.upsert_team(team.name, team.nominal_gpus, team.borrow_limit, team.weight)

    def spot_interrupt(self, target: str, reason: str | None = None) -> list[int]:
        """A spot notice for a GPU id or a whole node: its GPUs go down, and the jobs on them
        get the same checkpoint-and-requeue handshake as a preemption."""
        with self._lock:
            now = self.clock()
            why = reason or f"spot interruption on {target}"
            affected = set(self.store.set_gpus_up(target, up=False, reason=why, now=now))
            if not affected:
                raise NotFoundError(f"no GPU or node named {target!r}; `visionloop admin gpus` lists them.")
            victims: list[int] = []
            for attempt in self.store.active_attempts():
                if not affected & {a.gpu_id for a in attempt.allocations}:
                    continue
                job = self.store.get_job(attempt.job_id)
                if job.state == JobState.RUNNING:
                    self.store.transition(
                        job.id,
                        JobState.PREEMPTING,
                        f"{why}: checkpointing before the GPU goes",
                        expect=JobState.RUNNING,
                        now=now,
                    )
                    self._signal(job.id, terminate=True)
                    victims.append(job.id)
        self.wake.set()
        return victims

    def spot_restore(self, target: str) -> list[str]:
        with self._lock:
            gpus = self.store.set_gpus_up(target, up=True, reason="spot capacity back", now=self.clock())
            if not gpus:
                raise NotFoundError(f"no GPU or node named {target!r}; `visionloop admin gpus` lists them.")
        self.wake.set()
        return gpus
