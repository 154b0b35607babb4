"""The prepare_data stage on the Airflow worker: the run's data set encoded once, before any GPU
node is up (finetune_data.prepared_set does the work; this decides where and whether it is good
enough to pay GPUs for).

The prepared set lives under <output_dir>/prepared_data/<key>, beside the runs, so a later run of
the same data, tokenizer and encoding reuses it. On an s3:// output_dir the set is encoded in a
temporary directory here and uploaded, stats.json last (a prefix without it is not a set). Its
statistics then decide what validate could not know without encoding every row: enough rows for
a step and for the eval split, and a share of skipped rows no larger than max_skipped_fraction
(of each source, for a mixture).
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
from finetune.trainer_config import run_tokenizer_dir, trainer_config
from finetune_contract.data import batches_per_epoch
from finetune_contract.fields import PREPARE_DATA_FILE as RUN_RECORD
from finetune_contract.train_config import TrainConfig

log = logging.getLogger(__name__)


def prepare_run_data(cfg: RunConfig, s3_client: Callable[[], Any] | None = None,
                     num_proc: int | None = None) -> tuple[RunConfig, dict[str, Any]]:
    """Prepared here, on the Airflow worker: (the run config with prepared_data and the counted
    split sizes set, the statistics); ConfigError naming the field when the prepared data
    cannot make the run the user asked."""
    from finetune_data import prepared_set

    train = _prepare_config(cfg)
    try:
        if cfg.output_dir.startswith("s3://"):
            s3 = s3_client() if s3_client else _boto3_s3()
            stats = prepared_set.prepare_to_s3(train, prepared_root(cfg), s3, num_proc,
                                                 log=log.info)
        else:
            stats = prepared_set.prepare(train, prepared_root(cfg), num_proc, log=log.info)
    except ValueError as exc:  # the data: a bad row (file and line), too few usable rows
        # a mixture's source is named as validate names it (mixture[1].dataset)
        raise ConfigError([(getattr(exc, "field", "dataset"), str(exc))]) from None
    record = {**stats, "run_id": cfg.run_id}
    _write_record(cfg, record, s3_client)
    return accept_prepared(cfg, record), record


def _prepare_config(cfg: RunConfig) -> TrainConfig:
    """The trainer config the data is prepared with, its tokenizer resolved here."""
    values = trainer_config(cfg, local_paths=True)
    found = run_tokenizer_dir(cfg, in_pod=False)  # a built-in model's: the demo tokenizer
    # as the trainer resolves it (trainer.config.resolve): a hub model's own tokenizer
    tokenizer = str(found) if found else values["tokenizer"] or values["model"]
    return TrainConfig(**{**values, "tokenizer": tokenizer, "output_dir": _local_run_dir(cfg)})


def prepare_group(cfg: RunConfig) -> str:
    """The run's prepared-data group (finetune_data.prepared_set.group_key): runs of one group
    prepared together share one prepared set."""
    from finetune_data.prepared_set import group_key

    return group_key(_prepare_config(cfg))


def share_prepared(cfg: RunConfig, record: dict[str, Any],
                   s3_client: Callable[[], Any] | None = None) -> RunConfig:
    """The run config of a run that uses the set another run of its group prepared (`record`,
    that run's): the record written in this run's directory too, for its report; ConfigError
    when the set's statistics forbid this run (accept_prepared)."""
    accepted = accept_prepared(cfg, record)
    _write_record(cfg, record, s3_client)
    return accepted


def prepared_root(cfg: RunConfig) -> str:
    """The run's prepared root (finetune_data.prepared_set.prepared_root), a local one resolved as
    the run's paths are."""
    from finetune_data.prepared_set import prepared_root as root_of

    out = cfg.output_dir
    return root_of(out if out.startswith("s3://") else str(resolve_path(out)))


def accept_prepared(cfg: RunConfig, record: dict[str, Any]) -> RunConfig:
    """The run config the later stages get from a prepared set's record (wherever it was
    prepared): prepared_data and the counted split sizes set; ConfigError when its statistics
    forbid the run (data_problems)."""
    problems = data_problems(cfg, record)
    if problems:
        raise ConfigError(problems)
    data_parallel = cfg.parallel_dims.dp_degree
    return dataclasses.replace(
        cfg, prepared_data=record["uri"] if "uri" in record else record["path"],
        counted_train_rows=record["train_rows"],
        counted_batches_per_epoch=batches_per_epoch(record["train_rows"], cfg.micro_batch,
                                                    data_parallel))


def stage_result(cfg: RunConfig, record: dict[str, Any]) -> dict[str, Any]:
    """What the prepare_data stage returns (the later stages' run config), logged with the
    record and the plan its counted steps give."""
    from finetune.run_plan import plan_run, plan_text

    log.info("prepare_data: %s %s in %.1f s: %d rows read, %d kept, %d skipped %s; %d train "
             "and %d eval rows, %d tokens per epoch", record["path"],
             "reused (cache hit)" if record["cache_hit"] else "prepared", record["seconds"],
             record["rows_read"], record["rows_kept"], record["skipped_rows"],
             record["skipped_rows_by_reason"], record["train_rows"], record["eval_rows"],
             record["tokens_per_epoch"])
    log.info("%s", plan_text(cfg, plan_run(cfg)))
    return cfg.to_dict()


def data_problems(cfg: RunConfig, stats: dict[str, Any]) -> list[tuple[str, str]]:
    """What the prepared statistics forbid: too many rows skipped (of a mixture, of any one
    source), too few for one step."""
    problems = []
    for counted, what in [(stats, cfg.dataset)] if not stats.get("sources") else [
            (source, f"mixture[{source['index']}] ({source['name']}, {source['dataset']})")
            for source in stats["sources"]]:
        read, skipped = counted["rows_read"], counted["skipped_rows"]
        if not read or skipped / read <= cfg.max_skipped_fraction:
            continue
        reasons = ", ".join(f"{n} {reason}" for reason, n in
                            sorted(counted["skipped_rows_by_reason"].items()))
        longest = "; ".join(f"{row['where']} ({row['tokens']} tokens, {row['reason']})"
                            for row in counted["longest_skipped_rows"])
        problems.append(("max_skipped_fraction", (
            f"{skipped} of {read} rows of {what} ({skipped / read:.1%}) would be skipped "
            f"({reasons}), more than max_skipped_fraction {cfg.max_skipped_fraction:g}; longest: "
            f"{longest or 'none'}. Raise seq_len, fix the rows, or raise max_skipped_fraction")))
    try:
        batches_per_epoch(stats["train_rows"], cfg.micro_batch, cfg.parallel_dims.dp_degree)
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
