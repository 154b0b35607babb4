"""The runs page lists eks runs whose outputs are on S3 (moto in server mode): a finished run
with its headline figures and its report.html, a run in progress, and nothing else."""

from __future__ import annotations

import json

import boto3
import pytest

from finetune.report import write_report
from finetune.runs_page import find_run, list_runs, render_runs_page, report_html

BUCKET, PREFIX = "outputs", "runs"
TRAIN = [{"type": "train", "step": s, "loss": 5.0 - s, "lr": 1e-4, "grad_norm": 1.0,
          "tokens": 1000, "tokens_per_s": 2000.0 + s, "tflops_per_device": 1.5, "mfu": 0.4,
          "step_time_s": 0.5, "peak_memory_bytes": 1 << 30} for s in (1, 2, 3)]
EVAL = [{"type": "eval", "step": 0, "eval_loss": 6.0}, {"type": "eval", "step": 3,
                                                         "eval_loss": 3.0}]


@pytest.fixture
def s3_runs(aws, tmp_path):
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket=BUCKET)
    finished = tmp_path / "ft-finished"
    finished.mkdir()
    (finished / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRAIN + EVAL))
    write_report(finished, run_id="manual__finished", status="success",
                 config={"target": "eks", "model": "llama-8b", "nodes": 2, "procs_per_node": 8})
    for path in finished.iterdir():
        s3.upload_file(str(path), BUCKET, f"{PREFIX}/ft-finished/{path.name}")
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/ft-running/metrics.jsonl",
                  Body=json.dumps(TRAIN[0]) + "\n")
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/ft-running/checkpoints/step_00000001/x", Body=b"")
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/not-a-run/notes.txt", Body=b"hello")
    s3.put_object(Bucket=BUCKET, Key=f"{PREFIX}/README", Body=b"top-level file")
    return s3


def test_s3_runs_are_listed_with_status_and_figures(s3_runs):
    rows = {r["name"]: r for r in list_runs([f"s3://{BUCKET}/{PREFIX}/"])}
    assert set(rows) == {"ft-finished", "ft-running"}
    done = rows["ft-finished"]
    assert done["status"] == "success" and done["run_id"] == "manual__finished"
    assert done["dir"] == f"s3://{BUCKET}/{PREFIX}/ft-finished" and done["has_report"]
    assert done["metrics"]["final_eval_loss"] == 3.0
    assert done["config"]["model"] == "llama-8b"
    assert rows["ft-running"]["status"] == "running" and not rows["ft-running"]["has_report"]
    assert rows["ft-running"]["progress"]["step"] == 1  # from its metrics.jsonl on S3
    assert rows["ft-running"]["progress"]["stage"] == "training"
    page = render_runs_page(list(rows.values()), [f"s3://{BUCKET}/{PREFIX}"])
    assert "manual__finished" in page and 'href="runs/ft-finished/report.html"' in page


def test_an_s3_runs_report_is_served_and_only_for_listed_runs(s3_runs):
    dirs = [f"s3://{BUCKET}/{PREFIX}"]
    run_dir = find_run(dirs, "ft-finished")
    page = report_html(run_dir)
    assert page is not None and b"<svg" in page and b"manual__finished" in page
    assert report_html(find_run(dirs, "ft-running")) is None
    assert find_run(dirs, "not-a-run") is None and find_run(dirs, "../outputs") is None
