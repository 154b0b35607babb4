"""The prepare_data stage on the Airflow worker: the run's data set encoded once, before any GPU
node is up (finetune_data.prepare does the work; this decides where and whether it is good
enough to pay GPUs for).

The prepared set lives under <output_dir>/prepared_data/<key>, beside the runs, so a later run of
the same data, tokenizer and encoding reuses it. On an s3:// output_dir the set is encoded in a
temporary directory here and uploaded, stats.json last (a prefix without it is not a set). Its
statistics then decide what validate could not know without encoding every row: enough rows for
a step and for the eval split, and a share of skipped rows no larger than max_skipped_fraction.
The run's record of it (statistics, time, cache hit) is <run_dir>/prepare_data.json.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetune.config import ConfigError, RunConfig, resolve_path
from finetune.report import PREPARE_DATA_FILE as RUN_RECORD
from finetune.trainer_config import trainer_config
from finetune_contract.data import batches_per_epoch
from finetune_contract.fields import TrainConfig

log = logging.getLogger(__name__)



def prepare_run_data(cfg: RunConfig, s3_client: Callable[[], Any] | None = None,
                     num_proc: int | None = None) -> tuple[RunConfig, dict[str, Any]]:
    """(the run config with prepared_data and the counted split sizes set, the statistics);
    ConfigError naming the field when the prepared data cannot make the run the user asked."""
    from finetune_data import prepare

    from finetune.validate import run_tokenizer_dir

    values = trainer_config(cfg, local_paths=True)
    found = run_tokenizer_dir(cfg, in_pod=False)  # a built-in model's: the demo tokenizer
    # as the trainer resolves it (trainer.config.resolve): a hub model's own tokenizer
    tokenizer = str(found) if found else values["tokenizer"] or values["model"]
    train = TrainConfig(**{**values, "tokenizer": tokenizer, "output_dir": _local_run_dir(cfg)})
    try:
        if cfg.output_dir.startswith("s3://"):
            stats = _prepare_on_s3(cfg, train, s3_client, num_proc)
        else:
            stats = prepare.prepare(train, resolve_path(cfg.output_dir) / prepare.PREPARED_DIR,
                                    num_proc, log=log.info)
    except ValueError as exc:  # the data: a bad row (file and line), too few usable rows
        raise ConfigError([("dataset", str(exc))]) from None
    record = {**stats, "run_id": cfg.run_id}
    _write_record(cfg, record, s3_client)
    problems = data_problems(cfg, stats)
    if problems:
        raise ConfigError(problems)
    data_parallel = cfg.world_size // cfg.tp_degree
    cfg = dataclasses.replace(
        cfg, prepared_data=stats["uri"] if "uri" in stats else stats["path"],
        counted_train_rows=stats["train_rows"],
        counted_batches_per_epoch=batches_per_epoch(stats["train_rows"], cfg.micro_batch,
                                                    data_parallel))
    return cfg, record


def data_problems(cfg: RunConfig, stats: dict[str, Any]) -> list[tuple[str, str]]:
    """What the prepared statistics forbid: too many rows skipped, too few for one step."""
    problems = []
    read, skipped = stats["rows_read"], stats["skipped_rows"]
    if read and skipped / read > cfg.max_skipped_fraction:
        reasons = ", ".join(f"{n} {reason}" for reason, n in
                            sorted(stats["skipped_rows_by_reason"].items()))
        longest = "; ".join(f"{row['where']} ({row['tokens']} tokens, {row['reason']})"
                            for row in stats["longest_skipped_rows"])
        problems.append(("max_skipped_fraction", (
            f"{skipped} of {read} rows of {cfg.dataset} ({skipped / read:.1%}) would be skipped "
            f"({reasons}), more than max_skipped_fraction {cfg.max_skipped_fraction:g}; longest: "
            f"{longest or 'none'}. Raise seq_len, fix the rows, or raise max_skipped_fraction")))
    try:
        batches_per_epoch(stats["train_rows"], cfg.micro_batch, cfg.world_size // cfg.tp_degree)
    except ValueError as exc:
        what = "sequences (packed)" if stats["packing"] else "rows"
        problems.append(("micro_batch", f"the prepared data set has {stats['train_rows']} "
                         f"training {what}: {exc}"))
    return problems


def _local_run_dir(cfg: RunConfig) -> str:
    """Where an s3:// data set is downloaded to on this worker (the run dir, or a temp dir)."""
    if cfg.output_dir.startswith("s3://"):
        return str(Path(tempfile.gettempdir()) / "finetune" / cfg.run_name)
    return cfg.run_dir


def _prepare_on_s3(cfg: RunConfig, train: TrainConfig, s3_client: Callable[[], Any] | None,
                   num_proc: int | None) -> dict[str, Any]:
    """Prepared here, uploaded to <output_dir>/prepared_data/<key>/ (stats.json last)."""
    from botocore.exceptions import ClientError
    from finetune_data import prepare

    s3 = s3_client() if s3_client else _boto3_s3()
    bucket, _, prefix = cfg.output_dir.removeprefix("s3://").partition("/")
    base = f"{prefix.strip('/')}/{prepare.PREPARED_DIR}".lstrip("/")
    key = prepare.prepare_key(train, prepare.local_dataset(train))
    stats_key = f"{base}/{key}/{prepare.STATS_FILE}"
    uri = f"s3://{bucket}/{base}/{key}"
    try:
        stats = json.loads(s3.get_object(Bucket=bucket, Key=stats_key)["Body"].read())
        log.info("prepare_data: cache hit: %s holds this data set, tokenizer and encoding; "
                 "reused, nothing encoded", uri)
        return {**stats, "uri": uri, "path": uri, "cache_hit": True, "seconds": 0.0}
    except ClientError as error:
        if error.response["Error"]["Code"] not in ("NoSuchKey", "404", "NotFound"):
            raise
    with tempfile.TemporaryDirectory(prefix="prepare-") as staging:
        stats = prepare.prepare(train, staging, num_proc, log=log.info)
        local = Path(stats["path"])
        files = sorted(p for p in local.rglob("*") if p.is_file() and p.name != prepare.STATS_FILE)
        for path in [*files, local / prepare.STATS_FILE]:  # stats.json last: the set is whole
            s3.upload_file(str(path), bucket, f"{base}/{key}/{path.relative_to(local)}")
    log.info("prepare_data: uploaded %s", uri)
    return {**stats, "uri": uri, "path": uri}


def _boto3_s3() -> Any:
    import boto3

    return boto3.client("s3")


def _write_record(cfg: RunConfig, record: dict[str, Any],
                  s3_client: Callable[[], Any] | None) -> None:
    body = json.dumps(record, indent=1)
    if cfg.run_dir.startswith("s3://"):
        s3 = s3_client() if s3_client else _boto3_s3()
        bucket, _, prefix = cfg.run_dir.removeprefix("s3://").partition("/")
        s3.put_object(Bucket=bucket, Key=f"{prefix.strip('/')}/{RUN_RECORD}", Body=body.encode())
        return
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_RECORD).write_text(body)
