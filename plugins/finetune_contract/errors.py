"""The record of a failed training's root cause, which the trainer writes and the Airflow side
reads: `errors/rank_<N>.json` under the run's output location, one per failing rank.

    {"stage": "train", "type": "ValueError", "message": "...", "rank": 3, "time": 1764563000.5}

`message` is str(exception), cut to MAX_MESSAGE_CHARS; nothing else is recorded (no
environment, no traceback locals). The earliest record is the root cause: the others are mostly
ranks failing in its wake (a collective whose peer died).

A rank that dies without a record of its own (a signal: SIGKILL from the kernel's OOM killer;
an exit code) is recorded for it by what saw it die: on the local target torchrun's agent
(trainer/launch.py, from the ChildFailedError's failures), on eks the pods' container status
(finetune.targets.eks.job). Such a record adds "node", "exit_code" and "signal", and its time
is the earliest the death can have been (what saw it polls), so that the ranks failing in its
wake, which record their own error moments later, come after it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from typing import Any

ERRORS_DIR = "errors"
# Where a failure before the output location is known (parsing the config) is recorded.
ERROR_DIR_ENV = "FINETUNE_ERROR_DIR"
MAX_MESSAGE_CHARS = 2000
# Where a torchrun agent runs, as the run names its nodes (the local target sets it per agent).
NODE_NAME_ENV = "FINETUNE_NODE_NAME"
RECORD_KEYS = ("stage", "type", "message", "rank", "time")
# Kept from a record when present: where and how a rank died that recorded nothing itself.
DEATH_KEYS = ("node", "exit_code", "signal")
# What a signal that ended a training process usually means.
SIGNAL_MEANINGS = {
    "SIGKILL": "usually the kernel's OOM killer (the node's memory at its limit); else a kill -9 "
               "from outside",
    "SIGSEGV": "a crash in native code (a CUDA, NCCL or extension bug, or bad memory)",
    "SIGBUS": "shared memory (/dev/shm) or a memory-mapped file ran out",
    "SIGABRT": "an abort in native code (a C++ assertion, NCCL's watchdog)",
    "SIGTERM": "stopped from outside (a deadline, preemption, eviction or a person)",
    "SIGINT": "interrupted",
}
_SIGNAL_NUMBERS = {"SIGINT": 2, "SIGABRT": 6, "SIGKILL": 9, "SIGBUS": 7, "SIGSEGV": 11,
                   "SIGTERM": 15}


def exit_signal(exit_code: int) -> str | None:
    """The signal that ended a process: a negative code (Python's subprocess, torchrun) or 128 +
    the signal's number (a shell's or a container's); None for a plain exit code."""
    number = -exit_code if exit_code < 0 else exit_code - 128 if exit_code > 128 else None
    names = {n: name for name, n in _SIGNAL_NUMBERS.items()}
    return names.get(number) or (f"signal {number}" if number else None)


def death_record(rank: int | None, exit_code: int, node: str, time_s: float,
                 peak_memory: str = "", reason: str = "") -> dict[str, Any]:
    """The record of a process that died without its own: killed by a signal or exited with a
    code. `reason`: what its container status says (OOMKilled, Evicted); `peak_memory`: the
    run's peak as known, for a SIGKILL."""
    signal = exit_signal(exit_code)
    if signal:
        what = f"killed by {signal} (exit code {exit_code})"
        meaning = SIGNAL_MEANINGS.get(signal, "")
    else:
        what, meaning = f"exited with code {exit_code}", "its log says why"
    if reason == "OOMKilled":
        meaning = "the kernel's OOM killer: the container's memory reached its limit"
    if signal == "SIGKILL" and peak_memory:
        meaning += f"; {peak_memory}"
    message = f"{what}{f' ({reason})' if reason else ''} on node {node}: {meaning}"
    return {"stage": "train", "type": signal or f"exit code {exit_code}",
            "message": message[:MAX_MESSAGE_CHARS], "rank": rank, "time": time_s, "node": node,
            "exit_code": exit_code, "signal": signal}


def describe(record: dict[str, Any]) -> str:
    """One line for a record: who failed and how."""
    who = f"rank {record['rank']}" if record.get("rank") is not None else "a process"
    if "exit_code" in record:
        return f"{who} {record['message']}"
    return f"{who} raised {record['type']}: {record['message']}"


def failure_summary(records: list[dict[str, Any]]) -> str:
    """The first failure by time, then what followed on other ranks: for a task's error."""
    if not records:
        return ""
    first, rest = records[0], records[1:]
    lines = [f"first failure: {describe(first)}"]
    lines += [f"then: {describe(record)}" for record in rest[:7]]
    if len(rest) > 7:
        lines.append(f"then: {len(rest) - 7} more ranks failed")
    return "\n".join(lines) + "\n"


def error_file(rank: int) -> str:
    """The record's path relative to the output location."""
    return f"{ERRORS_DIR}/rank_{rank}.json"


def error_record(error: BaseException, rank: int, stage: str = "train") -> dict[str, Any]:
    return {"stage": stage, "type": type(error).__name__,
            "message": str(error)[:MAX_MESSAGE_CHARS], "rank": rank, "time": time.time()}


def failure_records(texts: Iterable[str]) -> list[dict[str, Any]]:
    """The well-formed records among the files' texts, earliest first."""
    records = []
    for text in texts:
        try:
            record = json.loads(text)
        except ValueError:
            continue  # torn by a process killed while writing it
        if isinstance(record, dict) and set(RECORD_KEYS) <= set(record) \
                and isinstance(record["time"], int | float):
            records.append({key: record[key] for key in (*RECORD_KEYS, *DEATH_KEYS)
                            if key in record})
    return sorted(records, key=lambda record: record["time"])


def root_cause(texts: Iterable[str]) -> dict[str, Any] | None:
    """The earliest well-formed record among the files' texts; None when there is none."""
    records = failure_records(texts)
    return records[0] if records else None
