"""The early-stopping rule of a sweep: asynchronous successive halving (ASHA), as pure functions
of made-up or measured eval losses (no Airflow, no torch, no files).

The rungs are steps: the first (`first`), then `first x factor`, `first x factor^2`, ... below
the trials' last step. When a trial reaches a rung, its eval loss there is ranked among the
losses of every trial that has reached the rung so far, itself included (n of them; rank 1 is
the lowest loss). It goes on when its rank is within the best ceil(n / factor); else it is
stopped. Fewer than `factor` trials at a rung cannot be cut to a 1/factor share, so they all go
on; factor 1 stops nothing. The decision is made once, when the trial arrives (asynchronous: a
later, better trial never stops one that already went on), so no trial waits for another.

Li et al., "A System for Massively Parallel Hyperparameter Tuning" (MLSys 2020) describe the
rule; this is the early-stopping form Katib and Ray Tune offer, written for this project.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

# A sweep whose trials' length is not known here (max_steps 0, data not counted): rungs this far.
MAX_RUNGS = 32


def rung_steps(first: int, factor: int, last_step: int | None) -> list[int]:
    """The rungs' steps: first, first x factor, ... strictly below `last_step` (None: not known,
    MAX_RUNGS of them); none when factor is 1 (nothing is stopped) or first is 0."""
    if factor <= 1 or first <= 0:
        return []
    steps, step = [], first
    while (last_step is None or step < last_step) and len(steps) < MAX_RUNGS:
        steps.append(step)
        step *= factor
    return steps


@dataclasses.dataclass(frozen=True)
class Verdict:
    """A trial's fate at a rung: whether it goes on, and its rank among the n trials there."""

    goes_on: bool
    rank: int
    of: int
    kept: int  # how many of the n go on: ceil(n / factor), or all n below `factor` trials


def judge(loss: float, others: Iterable[float], factor: int) -> Verdict:
    """The verdict on a trial that reached a rung with `loss`, `others` the losses the trials
    before it recorded there. A loss that is not a number (a diverged trial) ranks last."""
    theirs = list(others)
    n = len(theirs) + 1
    worse_than = [x for x in theirs if _below(x, loss)]
    rank = len(worse_than) + 1
    kept = n if factor <= 1 or n < factor else math.ceil(n / factor)
    return Verdict(goes_on=rank <= kept, rank=rank, of=n, kept=kept)


def _below(other: float, loss: float) -> bool:
    """Whether `other` ranks before `loss` (lower is better; NaN after every number; a tie
    goes to the trial that arrived first)."""
    if math.isnan(loss):
        return True
    if math.isnan(other):
        return False
    return other <= loss
