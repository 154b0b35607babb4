"""An s3:// data set is looked at before any node is scaled: an empty one fails the run there.

validate makes no cloud call, so scale_up does this first (finetune.targets). The objects are the
ones the trainer reads (trainer/data.py download_s3 and data_files): the object at the key, else
the data files under the key as a prefix, hidden and `_` files left out.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from finetune.config import ConfigError
from finetune_contract.fields import quoted
from finetune_contract.rules import split_s3

DATA_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
_MISSING = ("404", "NoSuchKey", "NotFound")


def _data_file(relative: str, dataset_format: str) -> bool:
    path = PurePosixPath(relative)
    if any(part.startswith((".", "_")) for part in path.parts):
        return False
    builder = DATA_SUFFIXES.get(path.suffix.lower())
    wanted = "json" if dataset_format in ("jsonl", "json") else dataset_format
    return builder is not None and (dataset_format == "auto" or builder == wanted)


def _list_objects(s3: Any, bucket: str, prefix: str) -> list[dict[str, Any]]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [obj for page in pages for obj in page.get("Contents", [])]


def s3_dataset_problem(uri: str, dataset_format: str, s3: Any) -> str | None:
    """What makes the s3:// data set unusable (missing, unreadable, empty), or None."""
    from botocore.exceptions import ClientError

    try:
        split_s3(uri)  # the contract's one rule of what S3 takes
    except ValueError as exc:
        return str(exc)
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    try:
        if key and not key.endswith("/"):
            try:
                size = s3.head_object(Bucket=bucket, Key=key)["ContentLength"]
                return None if size else f"{quoted(uri)} is an empty object (0 bytes)"
            except ClientError as error:
                if error.response["Error"]["Code"] not in _MISSING:
                    raise
            key += "/"  # no such object: a prefix, as the trainer reads it
        objects = [obj for obj in _list_objects(s3, bucket, key) if not obj["Key"].endswith("/")]
    except ClientError as error:
        return (f"{quoted(uri)} cannot be read from Airflow ({error.response['Error']['Code']}: "
                f"{error.response['Error'].get('Message', '')}); it needs s3:ListBucket and "
                "s3:GetObject on the data set (containers/k8s/iam-policy.json)")
    if not objects:
        return f"{quoted(uri)}: no object has that key or is under that prefix"
    files = [obj for obj in objects if _data_file(obj["Key"][len(key):], dataset_format)]
    if not files:
        return (f"{quoted(uri)}: no data files under the prefix ({', '.join(DATA_SUFFIXES)}"
                f"{'' if dataset_format == 'auto' else f' of dataset_format {dataset_format}'}; "
                "hidden and _ files are skipped)")
    if not any(obj["Size"] for obj in files):
        return f"{quoted(uri)}: every data file under the prefix is empty (0 bytes)"
    return None


def check_s3_dataset(uri: str, dataset_format: str, s3: Any) -> None:
    """Raise ConfigError naming `dataset` when the s3:// data set is missing or empty."""
    problem = s3_dataset_problem(uri, dataset_format, s3)
    if problem:
        raise ConfigError([("dataset", problem)])
