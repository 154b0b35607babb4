"""The record of a failed training's root cause, which the trainer writes and the Airflow side
reads: `errors/rank_<N>.json` under the run's output location, one per failing rank.

    {"stage": "train", "type": "ValueError", "message": "...", "rank": 3, "time": 1764563000.5}

`message` is str(exception), cut to MAX_MESSAGE_CHARS; nothing else is recorded (no
environment, no traceback locals). The earliest record is the root cause: the others are mostly
ranks failing in its wake (a collective whose peer died).
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
RECORD_KEYS = ("stage", "type", "message", "rank", "time")


def error_file(rank: int) -> str:
    """The record's path relative to the output location."""
    return f"{ERRORS_DIR}/rank_{rank}.json"


def error_record(error: BaseException, rank: int, stage: str = "train") -> dict[str, Any]:
    return {"stage": stage, "type": type(error).__name__,
            "message": str(error)[:MAX_MESSAGE_CHARS], "rank": rank, "time": time.time()}


def root_cause(texts: Iterable[str]) -> dict[str, Any] | None:
    """The earliest well-formed record among the files' texts; None when there is none."""
    records = []
    for text in texts:
        try:
            record = json.loads(text)
        except ValueError:
            continue  # torn by a process killed while writing it
        if isinstance(record, dict) and set(RECORD_KEYS) <= set(record):
            records.append({key: record[key] for key in RECORD_KEYS})
    return min(records, key=lambda record: record["time"], default=None)
