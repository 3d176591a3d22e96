"""The canary step of a loop's round: the candidate becomes the server's challenger, gets its
canary and shadow shares, and is watched (`loop.canary` judges it) until it has held for
`watch_minutes`, or failed, or had too little traffic to judge in the longest watch.

Every pass reads the server again and records where the watch stands in the step's outputs,
so a loop killed mid-watch goes on with the same window. What the loop changes on the server
and in the registry is undone when the canary ends either way: the challenger alias is
removed (only while it still names the candidate) and the canary and shadow shares go back to
0 (they hold until the server restarts, when its serving config's apply again).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from visionloop.core.settings import Settings
from visionloop.loop.canary import Reading, Server, ServerError, difference, judge
from visionloop.loop.spec import LoopSpec, RolloutSpec
from visionloop.loop.state import LoopState, Round, StepRecord, record_event


class Canary:
    def __init__(
        self,
        spec: LoopSpec,
        rollout: RolloutSpec,
        settings: Settings,
        state: LoopState,
        rnd: Round,
        rec: StepRecord,
        save: Callable[[], None],
    ) -> None:
        self.spec, self.rollout, self.settings = spec, rollout, settings
        self.state, self.rnd, self.rec, self.save = state, rnd, rec, save
        self.server = Server(rollout, spec.model)
        self.candidate = int(rnd.steps["register"].outputs["version"])

    def _event(self, what: str, reason: str) -> None:
        record_event(self.settings.home, self.spec.name, self.rnd.number, what, reason)

    def step(self) -> str:
        from visionloop.registry import CHAMPION, aliases

        o = self.rec.outputs
        now = time.time()
        if o.get("rolled_back"):  # decided by an attempt that died while undoing the canary
            clear(self.spec, self.rollout, self.settings, self.candidate, self.rnd.number)
            return "rejected"
        if "champion" not in o:
            champion = aliases(self.spec.model, self.settings).get(CHAMPION)
            if champion is None or champion == self.candidate:
                self.rec.reason = "no champion to compare with: promoted without a canary"
                return "skipped"
            o.update(champion=champion, candidate=self.candidate, since=now)
            self.save()
        if "started" not in o:
            return self._start(now)
        return self._watch(now)

    # ------------------------------------------------------------------ start
    def _start(self, now: float) -> str:
        from visionloop.registry import aliases, set_alias

        o, r = self.rec.outputs, self.rollout
        champion, served = int(o["champion"]), self.server.model
        if aliases(self.spec.model, self.settings).get(r.challenger_alias) != self.candidate:
            set_alias(
                self.spec.model,
                self.candidate,
                r.challenger_alias,
                actor=f"loop {self.spec.name}",
                settings=self.settings,
                reason=f"round {self.rnd.number}: canary of {r.canary_percent:g}%",
            )
            self._event("challenger set", f"{self.spec.model}@{r.challenger_alias} -> v{self.candidate}")
        late = now - float(o["since"]) > r.load_timeout_s
        try:
            routing = self.server.routing()
        except ServerError as e:
            if late:
                return self._roll_back(f"the server could not be reached for {r.load_timeout_s:g} s: {e}")
            self.rec.reason = f"waiting for the server: {e}"
            return "waiting"
        if routing.get("primary") != champion or routing.get("challenger") != self.candidate:
            seen = f"primary v{routing.get('primary')}, challenger {routing.get('challenger')}"
            if late:
                return self._roll_back(
                    f"the server did not load v{self.candidate} as {served}'s challenger within "
                    f"{r.load_timeout_s:g} s (it serves {seen}); see its log"
                )
            self.rec.reason = f"waiting for the server to load v{self.candidate} (it serves {seen})"
            return "waiting"
        self.server.set_routing(r.canary_percent, r.shadow_percent)
        o["before"] = self.server.read().to_json()
        o["started"] = now
        self.rec.reason = (
            f"v{self.candidate} answers {r.canary_percent:g}% of {served}'s requests"
            + (f" and {r.shadow_percent:g}% mirrored" if r.shadow_percent else "")
            + f", watched for {r.watch_minutes:g} min"
        )
        self._event("canary started", self.rec.reason)
        return "waiting"

    # ------------------------------------------------------------------ watch
    def _watch(self, now: float) -> str:
        o, r = self.rec.outputs, self.rollout
        champion = int(o["champion"])
        elapsed = now - float(o["started"])
        try:
            routing = self.server.routing()
            after = self.server.read()
        except ServerError as e:
            if elapsed > r.longest_watch_s:
                return self._roll_back(f"the server could not be read to end the watch: {e}")
            self.rec.reason = f"cannot read the server ({e}); still watching"
            return "waiting"
        if routing.get("primary") != champion:
            return self._roll_back(
                f"the champion changed during the canary (the server answers with v{routing.get('primary')}, "
                f"the watch compared with v{champion})"
            )
        before = Reading.from_json(o["before"])
        moved = (
            routing.get("challenger") != self.candidate
            or routing.get("canary_percent") != r.canary_percent
            or routing.get("shadow_percent") != r.shadow_percent
        )
        if moved or not before.before(after):
            # The server restarted (its counters went back, its shares to the serving config's)
            # or someone changed the shares: set them again and watch afresh.
            why = "the routing was changed" if moved else "the server restarted"
            if routing.get("challenger") != self.candidate:
                from visionloop.registry import aliases

                if aliases(self.spec.model, self.settings).get(r.challenger_alias) != self.candidate:
                    # Someone moved or removed the challenger alias (or this loop rolled it back
                    # and died before recording it): the canary is over, never set up again.
                    return self._roll_back(
                        f"the {r.challenger_alias} alias no longer names v{self.candidate}"
                    )
                o.pop("started")  # a restarted server: back to waiting for it to load the challenger
                o["since"] = now
                self._event("canary restarted", f"{why}: the server does not serve v{self.candidate} yet")
                return self._start(now)
            self.server.set_routing(r.canary_percent, r.shadow_percent)
            o["before"], o["started"] = self.server.read().to_json(), now
            o["restarts"] = int(o.get("restarts", 0)) + 1
            self.rec.reason = f"{why}: shares set again, the watch starts over"
            self._event("canary restarted", self.rec.reason)
            return "waiting"
        verdict = judge(difference(before, after), champion, self.candidate, r)
        o["verdict"] = {
            "passed": verdict.passed,
            "reasons": list(verdict.reasons),
            "figures": verdict.figures,
            "minutes": elapsed / 60,
        }
        if verdict.passed is False:
            return self._roll_back(f"the canary failed after {elapsed / 60:.1f} min: {verdict.summary()}")
        if elapsed < r.watch_minutes * 60:
            self.rec.reason = f"watching ({elapsed / 60:.1f} of {r.watch_minutes:g} min): {verdict.summary()}"
            return "waiting"
        if verdict.passed is None:
            if elapsed < r.longest_watch_s:
                self.rec.reason = f"watch extended, too little traffic yet: {verdict.summary()}"
                return "waiting"
            return self._roll_back(
                f"too little traffic to judge in {r.longest_watch_s / 60:g} min: {verdict.summary()}"
            )
        self.rec.reason = f"the canary held for {elapsed / 60:.1f} min: {verdict.summary()}"
        return "done"

    def _roll_back(self, why: str) -> str:
        # The decision and its reason are saved before anything is undone: an attempt that dies
        # halfway finishes the undoing with the same reason.
        self.rec.outputs["rolled_back"] = True
        self.rec.reason = f"rolled back: {why}"
        self.save()
        clear(self.spec, self.rollout, self.settings, self.candidate, self.rnd.number)
        return "rejected"


def clear(
    spec: LoopSpec, rollout: RolloutSpec, settings: Settings, candidate: int, round_number: int
) -> None:
    """Undo what the canary set: the server's shares back to 0, the challenger alias removed
    while it still names `candidate`. A server that cannot be reached is noted, not fatal: the
    alias is what it follows, and the shares apply to no challenger once the alias is gone."""
    from visionloop.registry import unset_alias

    try:
        Server(rollout, spec.model).set_routing(0.0, 0.0)
    except ServerError as e:
        record_event(settings.home, spec.name, round_number, "canary shares not reset", str(e))
    removed = unset_alias(
        spec.model,
        rollout.challenger_alias,
        actor=f"loop {spec.name}",
        settings=settings,
        reason=f"round {round_number}: canary ended",
        expected=candidate,
    )
    if removed is not None:
        record_event(settings.home, spec.name, round_number, "challenger removed", f"was v{removed}")
