"""What a local run's later tasks need from its earlier ones, kept as JSON records in
<run_dir>/state/: the resources scale_up measured, the etcd the rendezvous stage started, the
training train started (its agents, when, with which config, and the try that follows it) and
how far its logs were copied. A retry and teardown read them; no XCom is needed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from finetune.config import RunConfig


def write_state(cfg: RunConfig, name: str, data: dict) -> None:
    """Atomic: a reader (a later try, teardown) sees the old record or the new, never a part;
    the temporary file is this process's own, so a stale try writing at once cannot mix in."""
    directory = Path(cfg.run_dir) / "state"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
    with tmp.open("w") as f:
        f.write(json.dumps(data, indent=2))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def read_state(cfg: RunConfig, name: str) -> dict | None:
    """The record `name` of the run, None when no task wrote one."""
    path = Path(cfg.run_dir) / "state" / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None
