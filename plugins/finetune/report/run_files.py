"""What the report reads from a run directory: the trainer's `metrics.jsonl` (train, eval and
data records, a step logged again after a resume counted once) and `summary.json`, the
evaluation, the hang records, and any other JSON object file of the run; a missing or
unreadable file is said, never an exception. A number that is not finite reads as None.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from finetune_contract.errors import ERRORS_DIR
from finetune_contract.run_history import (
    HISTORY_FILE,
    NOTICES_DIR,
    parse_history,
    with_startup_notices,
)

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
MODEL_DIR = "model"
REPORT_JSON = "report.json"
REPORT_HTML = "report.html"


def load_metrics(path: Path) -> tuple[list[dict], list[dict], int]:
    """Read `metrics.jsonl` -> (train records, eval records, unreadable line count).

    Records are sorted by step; when a step appears more than once (a resumed run logs it
    again) the last record wins. A missing file reads as empty.
    """
    path = Path(path)
    if not path.is_file():
        return [], [], 0
    with path.open(encoding="utf-8", errors="replace") as f:
        train, evals, bad_lines, _ = parse_metrics(f)
    return train, evals, bad_lines


def parse_metrics(lines: Iterable[str]) -> tuple[list[dict], list[dict], int, dict | None]:
    """metrics.jsonl's lines -> (train records, eval records, unreadable line count, the last
    data record: rows and max_steps), as load_metrics reads them."""
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    data = None
    bad_lines = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad_lines += 1
            continue
        step = record.get("step") if isinstance(record, dict) else None
        # bool is an int subclass; a record without an integer step cannot be placed
        if not isinstance(step, int) or isinstance(step, bool):
            bad_lines += 1
            continue
        if record.get("type") == "train":
            train[step] = record
        elif record.get("type") == "eval":
            evals[step] = record
        elif record.get("type") == "data":
            data = record
        # other record types are the trainer's business, not unreadable
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)], bad_lines, data


def load_history(run_dir: Path) -> list[dict]:
    """The trainer's history of the run (finetune_contract.run_history): history.jsonl with the
    nodes' records of notices before a round's first step; [] when there is none."""
    path = run_dir / HISTORY_FILE
    events = parse_history(path.read_text(errors="replace")) if path.is_file() else []
    notices = sorted((run_dir / NOTICES_DIR).glob("*.json"))
    return with_startup_notices(events, (p.read_text(errors="replace") for p in notices))


def read_object(path: Path) -> tuple[dict | None, str | None]:
    """A JSON object file of the run -> (object or None, why it is unusable or None); a missing
    file is (None, None)."""
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"{path.name} unreadable ({exc})"
    if not isinstance(data, dict):
        return None, f"{path.name} is not an object"
    return data, None


def load_summary(path: Path) -> tuple[dict | None, str | None]:
    """Read `summary.json` -> (summary or None, warning or None)."""
    if not path.is_file():
        return None, f"{SUMMARY_FILE} missing: training did not finish"
    summary, problem = read_object(path)
    if problem:
        return None, f"{problem}: metrics computed from {METRICS_FILE}"
    return summary, None


def finite(value: Any) -> float | int | None:
    """The value if it is a finite number, else None (JSON has no NaN, and None is honest)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def load_evaluation(path: Path) -> tuple[dict | None, str | None]:
    """The report's `evaluation` from trainer/evaluate.py's file: (section, warning); none for
    a run that failed before evaluate, or a report written before it."""
    data, problem = read_object(path)
    if data is None:
        return None, problem
    keep = ("loss", "perplexity", "loss_by_source", "samples", "tasks", "higher_is_better",
            "champion", "eval_set", "eval_rows", "wall_time_s")
    return {key: data.get(key) for key in keep}, None


def hang_notes(run_dir: Path) -> list[str]:
    """The TrainingHang records (trainer/watchdog.py) the run left, also when a restart went on
    to succeed: which rank hung, and where the dumps are."""
    notes = []
    for path in sorted((Path(run_dir) / ERRORS_DIR).glob("rank_*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8", errors="replace"))
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(record, dict) and record.get("type") == "TrainingHang":
            notes.append(f"{record.get('message')} (stacks and collective traces in hangs/)")
    return notes
