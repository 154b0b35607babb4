"""A run's report where the trainer's outputs are not on this machine: an s3:// run directory, or
a shared file system the Airflow worker may or may not mount; and what the trainer records there
while it runs (its failures, its history of rounds and preemptions).

The trainer writes the same layout either way (trainer/storage.py): metrics.jsonl, summary.json,
model/, checkpoints/. The report is built from downloaded copies of the first two and its
report.json and report.html go back beside the model.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetune.report import (
    METRICS_FILE,
    MODEL_DIR,
    REPORT_HTML,
    REPORT_JSON,
    SUMMARY_FILE,
    add_sections,
    write_report,
)
from finetune.report.run_files import load_history
from finetune_contract.errors import ERRORS_DIR, failure_records
from finetune_contract.fields import EVALUATION_FILE
from finetune_contract.preflight_result import PREFLIGHT_FILE
from finetune_contract.run_history import (
    HISTORY_FILE,
    NOTICES_DIR,
    parse_history,
    with_startup_notices,
)


class ReportUnavailable(RuntimeError):
    """The trainer's outputs cannot be read from here, so no report can be built."""


def split_s3(uri: str) -> tuple[str, str]:
    """(bucket, key prefix without slashes at either end) of `s3://bucket/prefix`."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix.strip("/")


def _not_found(error: Exception) -> bool:
    code = getattr(error, "response", {}).get("Error", {}).get("Code")
    return code in ("404", "NoSuchKey", "NotFound")


def has_outputs(run_dir: str, s3_client: Callable[[], Any]) -> bool:
    """Whether the trainer left anything in the run directory (an S3 prefix or a path)."""
    if not run_dir.startswith("s3://"):
        path = Path(run_dir)
        return path.is_dir() and any(path.iterdir())
    bucket, prefix = split_s3(run_dir)
    s3 = s3_client()
    found = s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/", MaxKeys=1)
    return found.get("KeyCount", 0) > 0


def _json_keys(s3: Any, bucket: str, folder: str) -> list[str]:
    """The keys of the .json files under an S3 folder prefix, every page of the listing (one
    list_objects_v2 stops at 1,000 keys: a run of more ranks has more error records)."""
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{folder}/")
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])
            if obj["Key"].endswith(".json")]


def trainer_failures(run_dir: str, s3_client: Callable[[], Any]) -> list[dict]:
    """The trainer's records of its failing ranks (finetune_contract/errors.py), earliest
    first, from the run directory (a path or an S3 prefix)."""
    if not run_dir.startswith("s3://"):
        files = sorted((Path(run_dir) / ERRORS_DIR).glob("rank_*.json"))
        return failure_records(path.read_text(errors="replace") for path in files)
    bucket, prefix = split_s3(run_dir)
    s3 = s3_client()
    keys = _json_keys(s3, bucket, f"{prefix}/{ERRORS_DIR}")
    return failure_records(s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode(
        errors="replace") for key in keys)


def trainer_root_cause(run_dir: str, s3_client: Callable[[], Any]) -> dict | None:
    """The first of the trainer's failure records by time; None when no rank wrote one."""
    records = trainer_failures(run_dir, s3_client)
    return records[0] if records else None


def write_run_file(run_dir: str, s3_client: Callable[[], Any], name: str, text: str) -> str:
    """Write `name` in the run directory (a path or an S3 prefix); its location."""
    if not run_dir.startswith("s3://"):
        path = Path(run_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
        return str(path / name)
    bucket, prefix = split_s3(run_dir)
    s3_client().put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=text.encode(),
                           ContentType="application/json")
    return f"s3://{bucket}/{prefix}/{name}"


def report_exists(run_dir: str, s3_client: Callable[[], Any]) -> bool:
    if not run_dir.startswith("s3://"):
        return (Path(run_dir) / REPORT_JSON).is_file()
    bucket, prefix = split_s3(run_dir)
    s3 = s3_client()
    try:
        s3.head_object(Bucket=bucket, Key=f"{prefix}/{REPORT_JSON}")
        return True
    except Exception as error:
        if _not_found(error):
            return False
        raise


def build_report(run_dir: str, s3_client: Callable[[], Any], **report_args: Any) -> dict:
    """Write report.json and report.html for the run in `run_dir`; return its `summary`.
    `report_args` go to finetune.report.write_report. Raises ReportUnavailable when the outputs
    are out of reach."""
    if not run_dir.startswith("s3://"):
        path = Path(run_dir)
        if not path.is_dir():
            raise ReportUnavailable(
                f"the report cannot be built: output directory {run_dir} is not visible on this "
                "Airflow worker; mount the shared file system here or use an s3:// output_dir")
        report = write_report(path, **report_args)
        return summary(run_dir, report, (path / MODEL_DIR).is_dir())

    s3 = s3_client()
    bucket, prefix = split_s3(run_dir)
    with tempfile.TemporaryDirectory(prefix="finetune-report-") as tmp:
        work = Path(tmp)
        for name in (METRICS_FILE, SUMMARY_FILE, PREFLIGHT_FILE, EVALUATION_FILE, HISTORY_FILE):
            try:
                body = s3.get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"].read()
                (work / name).write_bytes(body)
            except Exception as error:
                if not _not_found(error):
                    raise  # no access, no bucket: not something the report may hide
        # The trainer's error records (root causes, hangs a restart survived) and the nodes'
        # notices before a round's first step (the history's preemptions) for the report.
        for folder, starts in ((ERRORS_DIR, "rank_"), (NOTICES_DIR, "")):
            for key in _json_keys(s3, bucket, f"{prefix}/{folder}"):
                name = key.rsplit("/", 1)[-1]
                if name.startswith(starts):
                    (work / folder).mkdir(exist_ok=True)
                    (work / folder / name).write_bytes(
                        s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        listed = s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/{MODEL_DIR}/", MaxKeys=1)
        model = listed.get("KeyCount", 0) > 0
        if model:
            (work / MODEL_DIR).mkdir()  # write_report lists model/ when the directory is there
        report = write_report(work, **report_args)
        for name, content_type in ((REPORT_JSON, "application/json"),
                                   (REPORT_HTML, "text/html; charset=utf-8")):
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=(work / name).read_bytes(),
                          ContentType=content_type)
    return summary(run_dir, report, model)


def summary(run_dir: str, report: dict, model: bool) -> dict:
    """What collect_metrics returns (to XCom) on every target."""
    base = run_dir.rstrip("/")
    return {"status": report["status"], "run_dir": run_dir,
            "model_dir": f"{base}/{MODEL_DIR}" if model else None,
            "report_json": f"{base}/{REPORT_JSON}", "report_html": f"{base}/{REPORT_HTML}",
            "metrics": report["metrics"]}


def evaluation_result(evaluation: dict, location: str, wall_time_s: float) -> dict:
    """What the evaluate stage returns (to XCom): where evaluation.json is and its headline
    figures (the samples stay in the file and the report)."""
    return {"evaluation": location, "loss": evaluation.get("loss"),
            "perplexity": evaluation.get("perplexity"), "tasks": evaluation.get("tasks", {}),
            "champion_measured": evaluation.get("champion") is not None,
            "wall_time_s": round(wall_time_s, 1)}


def read_output(run_dir: str, name: str, s3_client: Callable[[], Any]) -> str | None:
    """A file of the run directory (a path or an S3 prefix) as text; None when missing."""
    if not run_dir.startswith("s3://"):
        path = Path(run_dir) / name
        return path.read_text(encoding="utf-8") if path.is_file() else None
    bucket, prefix = split_s3(run_dir)
    try:
        body = s3_client().get_object(Bucket=bucket, Key=f"{prefix}/{name}")["Body"].read()
    except Exception as error:
        if _not_found(error):
            return None
        raise
    return body.decode("utf-8", errors="replace")


def run_history(run_dir: str, s3_client: Callable[[], Any]) -> list[dict] | None:
    """The trainer's history of the run (finetune_contract.run_history: history.jsonl with the
    nodes' notices before a round's first step), as far as written; None where the run
    directory is a path this machine does not mount."""
    if not run_dir.startswith("s3://"):
        return load_history(Path(run_dir)) if Path(run_dir).is_dir() else None
    events = parse_history(read_output(run_dir, HISTORY_FILE, s3_client) or "")
    bucket, prefix = split_s3(run_dir)
    s3 = s3_client()
    keys = _json_keys(s3, bucket, f"{prefix}/{NOTICES_DIR}")
    return with_startup_notices(events, (s3.get_object(Bucket=bucket, Key=key)["Body"].read()
                                         .decode("utf-8", errors="replace") for key in keys))


def add_report_sections(run_dir: str, s3_client: Callable[[], Any], **sections: Any) -> dict:
    """report.add_sections on the run's report, where it is (a path or an S3 prefix)."""
    if not run_dir.startswith("s3://"):
        return add_sections(Path(run_dir), **sections)
    bucket, prefix = split_s3(run_dir)
    s3 = s3_client()
    with tempfile.TemporaryDirectory(prefix="finetune-report-") as tmp:
        work = Path(tmp)
        (work / REPORT_JSON).write_bytes(
            s3.get_object(Bucket=bucket, Key=f"{prefix}/{REPORT_JSON}")["Body"].read())
        report = add_sections(work, **sections)
        for name, content_type in ((REPORT_JSON, "application/json"),
                                   (REPORT_HTML, "text/html; charset=utf-8")):
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=(work / name).read_bytes(),
                          ContentType=content_type)
    return report
