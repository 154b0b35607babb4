"""The run's history (finetune_contract.run_history): rank 0 appends each round's start, its
saves, evals, a preemption and the end to history.jsonl in the run's output location, uploading
it for an s3:// one, so the Airflow side can account for every second the nodes were paid."""

from __future__ import annotations

import json
import time
from typing import Any

import psutil

from finetune_contract.run_history import EVENTS, HISTORY_FILE, parse_history
from trainer.storage import RunOutput


def process_started() -> float:
    """When this process started, as the kernel records it: its imports are start-up too."""
    try:
        return psutil.Process().create_time()
    except psutil.Error:
        return time.time()


class RunHistory:
    def __init__(self, output: RunOutput, rank: int):
        self.output, self.rank = output, rank
        self.path = output.dir / HISTORY_FILE
        output.fetch(HISTORY_FILE)  # an s3:// run's earlier rounds, to append to

    def append(self, event: str, **fields: Any) -> None:
        assert event in EVENTS, event
        if self.rank != 0:
            return
        record = {"event": event, "time": time.time(), **fields}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        self.output.sync(HISTORY_FILE)

    def events(self) -> list[dict[str, Any]]:
        """What rank 0 has recorded so far (the earlier rounds' included)."""
        return parse_history(self.path.read_text()) if self.path.is_file() else []
