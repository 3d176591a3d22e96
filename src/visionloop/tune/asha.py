"""Asynchronous successive halving with promotion (Li et al., "A System for Massively
Parallel Hyperparameter Tuning", MLSys 2020, Algorithm 2).

Every trial trains to the first rung and pauses there. When a slot is free, the highest rung
with a paused trial among the best 1/η of all the trials that reached that rung promotes
that trial to the next rung (it resumes from its checkpoint); only when none can be promoted
does a new trial start at the bottom. A trial is never judged against trials that have not
reached its rung yet, so an early bad luck of the draw does not stop it for good: it waits,
and goes on as soon as enough trials have done worse.

Optuna's SuccessiveHalvingPruner (and Ray Tune's ASHA) can only stop a trial at a rung, at
the moment it gets there: a queue that pauses trials through checkpoints can do the
algorithm as written. This module is the rule alone, on the trials' reported values, with no
state of its own: the tuner applies it to what the database says, every pass.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from optuna.trial import FrozenTrial


@dataclass(frozen=True)
class Promotion:
    number: int  # the trial's number
    rung: int  # the epoch it paused at
    rank: int  # its rank among the trials that reached that rung (0: best)
    reached: int  # how many trials reached that rung


def promotable(
    trials: Sequence[FrozenTrial],
    paused_at: Mapping[int, int],
    rungs: Sequence[int],
    reduction_factor: int,
    maximize: bool,
) -> Promotion | None:
    """The paused trial to promote next, or None.

    `paused_at`: trial number → the rung epoch it is paused at. A trial that reached a rung
    is one with a value reported at that step, whatever it did afterwards (went on, was
    pruned, failed later). At each rung, the best ⌊n / η⌋ of the n trials that reached it may
    go on; the highest rung is served first (it is closest to a finished trial). Ties are
    broken by trial number, so the same database gives the same answer every pass."""
    for rung in sorted(rungs, reverse=True):
        reached = [
            (t.intermediate_values[rung], t.number)
            for t in trials
            if rung in t.intermediate_values and math.isfinite(t.intermediate_values[rung])
        ]
        quota = len(reached) // reduction_factor
        if quota == 0:
            continue
        reached.sort(key=lambda vn: (-vn[0] if maximize else vn[0], vn[1]))
        for rank, (_, number) in enumerate(reached[:quota]):
            if paused_at.get(number) == rung:
                return Promotion(number=number, rung=rung, rank=rank, reached=len(reached))
    return None


__all__ = ["Promotion", "promotable"]
