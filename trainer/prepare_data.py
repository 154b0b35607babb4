"""The prepare_data stage in a pod of its own (the eks target's prepare_on pod): the run's data set
encoded on a CPU node with the one function the Airflow worker uses (finetune_data.prepared_set),
so a small Airflow worker never encodes a large data set.

python -m trainer.prepare_data --config CONFIG.json --prepared-root s3://B/P/prepared_data \
    --record s3://B/P/RUN/prepare_data.json [--num-proc N]

Writes the set to <prepared-root>/<key>/ (stats.json last: a prefix without it is not a set; a
key already there is reused), then the stage's record (the statistics, time, cache hit) to
--record, which the task reads once the pod has succeeded. A failure's first cause goes to the
container's termination message (the pod's status names it) before the process exits non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from finetune_contract.errors import MAX_MESSAGE_CHARS
from trainer.config import load_config
from trainer.storage import is_s3

# Kubernetes' default terminationMessagePath (the Job's manifest names it).
TERMINATION_LOG = Path(os.environ.get("FINETUNE_TERMINATION_LOG", "/dev/termination-log"))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="the run's trainer config (JSON)")
    parser.add_argument("--prepared-root", required=True,
                        help="s3:// prefix the prepared sets live under (one per key)")
    parser.add_argument("--record", required=True,
                        help="s3:// URI of the stage's record in the run directory")
    parser.add_argument("--num-proc", type=int, default=None,
                        help="encoding processes (default: the cores this process may use)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """Prepare (or reuse) the set and write the record; the record."""
    import boto3
    from finetune_data.prepared_set import prepare_to_s3

    for what, uri in (("--prepared-root", args.prepared_root), ("--record", args.record)):
        if not is_s3(uri):
            raise ValueError(f"{what} must be an s3:// URI, got {uri[:80]!r}")
    config = load_config(args.config)
    s3 = boto3.client("s3")
    stats = prepare_to_s3(config, args.prepared_root, s3, args.num_proc, log=print)
    record = {**stats, "run_id": os.environ.get("FINETUNE_RUN_ID", "")}
    bucket, _, key = args.record.removeprefix("s3://").partition("/")
    s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(record, indent=1).encode(),
                  ContentType="application/json")
    print(f"prepare_data: record written to {args.record}", flush=True)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except Exception as error:
        cause = f"{type(error).__name__}: {error}"[:MAX_MESSAGE_CHARS]
        try:
            TERMINATION_LOG.write_text(cause)
        except OSError:  # not in a pod: the log says it
            pass
        print(f"prepare_data failed: {cause}", file=sys.stderr, flush=True)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
