"""What the preflight program (trainer/preflight.py) hands the Airflow side
(finetune/preflight_verdict.py): rank 0's result line in its log, and the files in the run
directory."""

from __future__ import annotations

import json
from typing import Any

RESULT_PREFIX = "PREFLIGHT "
MEASURED_FILE = "preflight_measured.json"  # what was measured (local runs)
PREFLIGHT_FILE = "preflight.json"  # the verdict, node by node (both targets; the report's)


def result_line(text: str) -> dict[str, Any] | None:
    """The measured result in a log (rank 0's `PREFLIGHT {json}` line); None when absent."""
    for line in reversed(text.splitlines()):
        _, sep, payload = line.partition(RESULT_PREFIX)
        if sep and payload.lstrip().startswith("{"):
            return json.loads(payload)
    return None
