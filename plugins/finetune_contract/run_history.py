"""A run's history: each round of its training (a start of the trainer's processes) and what
happened in it, which the trainer appends and the Airflow side reads for the run's goodput and
its count of preemptions. `history.jsonl` in the run's output location, one JSON object a line,
written by rank 0 and never cut back (metrics.jsonl is: a resumed run keeps each step once).

    {"event": "start", "time": T, "ready": T, "world_size": 4, "nodes": 2, "resumed_from_step": 40,
     "load_s": 1.2, "lost_steps": 3, "lost_s": 2.9}
    {"event": "save", "step": 50, "time": T, "seconds": 0.8}
    {"event": "eval", "step": 50, "time": T, "seconds": 0.4}
    {"event": "preempted", "step": 57, "notice": T, "time": T, "save_s": 0.9}
    {"event": "end", "step": 100, "time": T}

start: `time` is when the round's processes started, `ready` when its first step began (model,
data and checkpoint loaded), `lost_*` the steps the round before trained after its last
checkpoint, which this one trains again. preempted: a notice (SIGTERM) reached a rank at
`notice`; the round ended the step it was in, saved it in `save_s` and exited with
PREEMPTED_EXIT_CODE at `time`. end: the last step is done (the export follows).
"""

from __future__ import annotations

import json
from typing import Any

HISTORY_FILE = "history.jsonl"
# What a rank exits with once it has saved the step it was in after a notice: 128 + SIGUSR1,
# the code Kubeflow's training operator keeps for "retry me" (its ExitCode restart policy retries
# 130, 137, 138 and 143; 138 is the one no signal of the kernel's sends), so a preemption is
# retried by the job without counting as a failure, and told apart from a SIGTERM (143) that
# killed a process before it could save.
PREEMPTED_EXIT_CODE = 138
EVENTS = ("start", "save", "eval", "preempted", "end")


def parse_history(text: str) -> list[dict[str, Any]]:
    """The events of a history.jsonl, in order; a line torn by a crash is skipped."""
    events = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(event, dict) and event.get("event") in EVENTS:
            events.append(event)
    return events


def preemptions(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's preemptions: each notice that ended a round with the step it saved."""
    return [e for e in events if e["event"] == "preempted"]
