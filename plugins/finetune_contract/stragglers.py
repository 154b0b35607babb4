"""Stragglers: ranks whose typical step time exceeds the ranks' median by more than a threshold.

The trainer logs each step's per-rank times as `rank_step_time_s` (a list indexed by rank) in
metrics.jsonl; its summary and the run report flag stragglers with this one rule.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

RANK_STEP_TIMES = "rank_step_time_s"


def rank_medians(per_step: Iterable[Sequence[float]]) -> list[float]:
    """Each rank's median step time over the steps (lists of one time per rank). Steps of a
    different world size than the last one (a run resumed on other nodes) are left out."""
    rows = [list(times) for times in per_step]
    if not rows:
        return []
    width = len(rows[-1])
    columns = list(zip(*(times for times in rows if len(times) == width), strict=True))
    return [statistics.median(times) for times in columns]


def stragglers(per_step: Iterable[Sequence[float]], threshold: float) -> list[dict[str, Any]]:
    """[{"rank", "median_step_time_s", "ranks_median_s", "slower"}] of each rank whose median
    step time exceeds the median of all ranks' medians by more than `threshold` (0.2 = 20%)."""
    medians = rank_medians(per_step)
    if len(medians) < 2:
        return []
    overall = statistics.median(medians)
    return [
        {"rank": rank, "median_step_time_s": median, "ranks_median_s": overall,
         "slower": median / overall - 1}
        for rank, median in enumerate(medians)
        if overall > 0 and median > overall * (1 + threshold)
    ]  # fmt: skip
