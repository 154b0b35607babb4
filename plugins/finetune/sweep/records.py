"""What a sweep's trials leave for each other and for a retry, in the sweep's directory (a path
or an s3:// prefix, beside the trials' own run directories):

    rungs/step-<step>/trial-<i>.json   a trial's eval loss at a rung, and the rule's verdict
    trials/trial-<i>.json              a trial's outcome (completed, stopped, failed), once ended
    trials/trial-<i>-rendezvous.json   the rendezvous its training started on (a retry keeps it)

One file per trial per record, each written whole (a local one renamed into place): no trial
writes another's file, so no lock is needed, and a reader sees a record or none.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetune.outputs import read_output, split_s3, write_run_file

RUNGS_DIR, TRIALS_DIR = "rungs", "trials"
_TRIAL_FILE = re.compile(r"trial-(\d+)\.json")


class SweepRecords:
    """The records of the sweep in `sweep_dir`; `s3_client` for an s3:// one."""

    def __init__(self, sweep_dir: str, s3_client: Callable[[], Any]):
        self.sweep_dir, self.s3_client = sweep_dir.rstrip("/"), s3_client

    # -- files ----------------------------------------------------------------------------

    def read(self, name: str) -> dict | None:
        text = read_output(self.sweep_dir, name, self.s3_client)
        if text is None:
            return None
        try:
            data = json.loads(text)
        except ValueError:  # not whole (an S3 object is; a local file is renamed whole)
            return None
        return data if isinstance(data, dict) else None

    def write(self, name: str, data: dict) -> None:
        text = json.dumps(data, indent=1, default=str)
        if self.sweep_dir.startswith("s3://"):
            write_run_file(self.sweep_dir, self.s3_client, name, text)
            return
        path = Path(self.sweep_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)

    def names(self, folder: str) -> list[str]:
        """The file names in `folder` of the sweep directory (none when it is not there)."""
        if not self.sweep_dir.startswith("s3://"):
            path = Path(self.sweep_dir) / folder
            return sorted(p.name for p in path.iterdir() if not p.name.startswith(".")) \
                if path.is_dir() else []
        bucket, prefix = split_s3(self.sweep_dir)
        pages = self.s3_client().get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=f"{prefix}/{folder}/")
        return sorted(obj["Key"].rsplit("/", 1)[-1] for page in pages
                      for obj in page.get("Contents") or [])

    # -- rungs ----------------------------------------------------------------------------

    def rung(self, step: int) -> dict[int, dict]:
        """Trial -> its record at the rung of `step`, for every trial that reached it."""
        folder = f"{RUNGS_DIR}/step-{step}"
        found = {}
        for name in self.names(folder):
            match = _TRIAL_FILE.fullmatch(name)
            record = self.read(f"{folder}/{name}") if match else None
            if record is not None:
                found[int(match[1])] = record
        return found

    def record_rung(self, step: int, trial: int, record: dict) -> None:
        self.write(f"{RUNGS_DIR}/step-{step}/trial-{trial}.json", record)

    # -- trials ---------------------------------------------------------------------------

    def outcome(self, trial: int) -> dict | None:
        """The trial's outcome once its training ended; None before."""
        return self.read(f"{TRIALS_DIR}/trial-{trial}.json")

    def record_outcome(self, trial: int, outcome: dict) -> None:
        self.write(f"{TRIALS_DIR}/trial-{trial}.json", outcome)

    def rendezvous(self, trial: int) -> dict | None:
        return self.read(f"{TRIALS_DIR}/trial-{trial}-rendezvous.json")

    def record_rendezvous(self, trial: int, rendezvous: dict) -> None:
        self.write(f"{TRIALS_DIR}/trial-{trial}-rendezvous.json", rendezvous)

    def forget_rendezvous(self, trial: int) -> None:
        """After the trial's rendezvous is gone (teardown): a later try starts a new one."""
        name = f"{TRIALS_DIR}/trial-{trial}-rendezvous.json"
        if not self.sweep_dir.startswith("s3://"):
            (Path(self.sweep_dir) / name).unlink(missing_ok=True)
            return
        bucket, prefix = split_s3(self.sweep_dir)
        self.s3_client().delete_object(Bucket=bucket, Key=f"{prefix}/{name}")
