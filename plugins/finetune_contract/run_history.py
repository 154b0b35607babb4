"""A run's history: each round of its training (a start of the trainer's processes) and what
happened in it, which the trainer appends and the Airflow side reads for the run's goodput and
its count of preemptions. `history.jsonl` in the run's output location, one JSON object a line,
written by rank 0 and never cut back (metrics.jsonl is: a resumed run keeps each step once).

    {"event": "start", "time": T, "started": T, "world_size": 4, "nodes": 2,
     "resumed_from_step": 40, "load_s": 1.2, "lost_steps": 3, "lost_s": 2.9}
    {"event": "save", "step": 50, "time": T, "seconds": 0.8}
    {"event": "eval", "step": 50, "time": T, "seconds": 0.4}
    {"event": "preempted", "step": 57, "notice": T, "time": T, "save_s": 0.9}
    {"event": "end", "step": 100, "time": T}

start: `time` is when the round's first step began (model, data and checkpoint loaded), `started`
when its processes started, `lost_*` the steps the round before trained after its last
checkpoint, which this one trains again. preempted: a notice (SIGTERM) reached a rank at
`notice`; the round ended the step it was in, saved it in `save_s` and exited with
PREEMPTED_EXIT_CODE at `time`. end: the last step is done (the export follows).

A notice before the round's first step (while the model loads) ends the round with nothing to
save, and rank 0 has written nothing of that round (its start comes with its first step) and
may be on another node: each node that got one records it itself, after its workers exited
(trainer/launch.py), in `notices/<node>-<notice ms>.json` beside history.jsonl:

    {"event": "preempted", "step": null, "notice": T, "time": T, "save_s": 0.0,
     "before_first_step": true, "node": "ft-x-worker-1", "started": T}

`started`: when that node's workers started. `with_startup_notices` merges these records into
the history, one preempted event per round (a notice that reached several nodes in the same
start-up is one preemption), so every reader counts a preemption by the one rule, `preemptions`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

HISTORY_FILE = "history.jsonl"
# Each node's record of a notice that came before its round's first step (see above).
NOTICES_DIR = "notices"
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
    """The run's preemptions: each notice that ended a round, with the step it saved or (merged
    by with_startup_notices) before the round's first step."""
    return [e for e in events if e["event"] == "preempted"]


def startup_notice(node: str, notice: float, started: float | None,
                   ended: float) -> dict[str, Any]:
    """A node's record of a notice at `notice` that came before its round's first step; its
    workers started at `started` and had exited by `ended`."""
    return {"event": "preempted", "step": None, "notice": notice, "time": ended, "save_s": 0.0,
            "before_first_step": True, "node": node, "started": started}


def startup_notice_file(record: dict[str, Any]) -> str:
    """Where a start-up notice's record goes, relative to the run directory: one file a node
    and notice, so nodes never write the same file."""
    node = re.sub(r"[^A-Za-z0-9._-]+", "_", record["node"]).strip("_") or "node"
    return f"{NOTICES_DIR}/{node}-{round(record['notice'] * 1000)}.json"


def with_startup_notices(events: list[dict[str, Any]],
                         records: Iterable[str]) -> list[dict[str, Any]]:
    """The history's events with the nodes' start-up notices (the texts of their records) merged
    in by time. The records of one round are one preempted event (`nodes`: the nodes it
    reached): taken in the order of their notices, a record joins the round the one before it
    is in when its node's workers had started before that round's first notice; else it
    begins a round of its own. A record torn, or not of a start-up notice, is skipped."""
    noticed: list[dict[str, Any]] = []
    for record in sorted((r for r in map(_startup_record, records) if r),
                         key=lambda r: r["notice"]):
        current = noticed[-1] if noticed else None
        if current is not None and record["started"] is not None \
                and record["started"] < current["notice"]:
            current["nodes"] = sorted({*current["nodes"], record["node"]})
            current["time"] = max(current["time"], record["time"])
        else:
            noticed.append({**{k: v for k, v in record.items() if k != "node"},
                            "nodes": [record["node"]]})
    noticed.sort(key=lambda e: e["time"])
    merged: list[dict[str, Any]] = []
    for event in events:  # the history's own order kept, each notice placed by its time
        at = event.get("time")
        while noticed and isinstance(at, int | float) and noticed[0]["time"] <= at:
            merged.append(noticed.pop(0))
        merged.append(event)
    return [*merged, *noticed]


def _startup_record(text: str) -> dict[str, Any] | None:
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict) or record.get("event") != "preempted" \
            or record.get("before_first_step") is not True:
        return None
    times = [record.get(k) for k in ("notice", "time")]
    if not all(isinstance(t, int | float) and not isinstance(t, bool) for t in times):
        return None
    started = record.get("started")
    return {**record, "node": str(record.get("node") or "?"), "step": record.get("step"),
            "save_s": 0.0, "started": started if isinstance(started, int | float) else None}
