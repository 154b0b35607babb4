"""The root cause of a failed training, as the trainer saw it: one JSON record per failing rank.

A rank whose training raises writes `errors/rank_<N>.json` (the format is the run contract's:
finetune_contract/errors.py) into the run's output location and re-raises. For an s3:// output
the file is written to the local staging directory (the layout trainer/storage.py gives every
output) and uploaded from there by the failing rank itself. A failure before the output
location is known (parsing the config) goes to the directory named by FINETUNE_ERROR_DIR, when
set. `read_root_cause` returns the earliest record of a run.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from finetune_contract.errors import (
    ERRORS_DIR,
    error_file,
    error_record,
    root_cause,
)
from trainer.storage import S3Prefix, is_s3, staging_dir


def write_root_cause(output_dir: str, error: BaseException, rank: int) -> None:
    """Record `error` as this rank's failure under output_dir (a directory or s3:// URI)."""
    name = error_file(rank)
    local = (staging_dir(output_dir) if is_s3(output_dir) else Path(output_dir)) / name
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_text(json.dumps(error_record(error, rank)) + "\n")
    if is_s3(output_dir):
        # Not RunOutput.sync: that uploads from rank 0 only, and any rank may fail first.
        S3Prefix(output_dir).upload_file(local, name)


@contextmanager
def root_cause_recorded(output_dir: str | None, rank: int) -> Iterator[None]:
    """Record an exception escaping the block under output_dir (if any), then re-raise it."""
    try:
        yield
    except Exception as error:
        if output_dir:
            try:
                write_root_cause(output_dir, error, rank)
            except Exception as failed:  # the training's exception matters more: keep it
                print(f"could not record the error in {output_dir}: {failed!r}", file=sys.stderr)
        raise


def read_root_cause(output_dir: str) -> dict[str, Any] | None:
    """The earliest error record under output_dir (a directory or s3:// URI), None if none."""
    return root_cause(_error_texts(output_dir))


def _error_texts(output_dir: str) -> list[str]:
    if is_s3(output_dir):
        prefix = S3Prefix(output_dir)
        return [
            prefix.client.get_object(Bucket=prefix.bucket, Key=prefix.key(name))["Body"]
            .read()
            .decode()
            for name in prefix.list_files(ERRORS_DIR)
            if name.endswith(".json")
        ]
    return [path.read_text() for path in sorted(Path(output_dir, ERRORS_DIR).glob("rank_*.json"))]
