"""collect_metrics and the failed-run report on eks: the trainer's outputs in S3 (moto in server
mode) or on a shared file system, the report stored beside the model."""

from __future__ import annotations

import json

import boto3
import pytest

from finetune.outputs import ReportUnavailable
from tests.support.eks import SCALING, eks_config, scaling, target

TRAIN = [
    {"type": "eval", "step": 0, "eval_loss": 4.0, "time": 1.0},
    *({"type": "train", "step": s, "loss": 4.0 - s / 2, "lr": 1e-3, "grad_norm": 1.0,
       "tokens": 4096, "tokens_per_s": 1000.0 * s, "tflops_per_device": 10.0 * s, "mfu": 0.1 * s,
       "step_time_s": 4.0, "peak_memory_bytes": 2**30, "time": 1.0 + s} for s in (1, 2, 3)),
    {"type": "eval", "step": 3, "eval_loss": 2.5, "time": 9.0},
]
SUMMARY = {"initial_eval_loss": 4.0, "final_eval_loss": 2.5, "steps": 3, "world_size": 16,
           "wall_time_s": 120.0, "tokens_per_s": 2500.0, "resumed_from_step": None}


@pytest.fixture
def bucket(aws):
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="bucket")  # eks_config's output_dir is s3://bucket/runs
    return s3


def put_outputs(s3, cfg, metrics=True):
    prefix = cfg.run_dir.removeprefix("s3://bucket/")
    if metrics:
        body = "".join(json.dumps(r) + "\n" for r in TRAIN) + '{"type": "tr'  # a torn last line
        s3.put_object(Bucket="bucket", Key=f"{prefix}/metrics.jsonl", Body=body.encode())
        s3.put_object(Bucket="bucket", Key=f"{prefix}/summary.json",
                      Body=json.dumps(SUMMARY).encode())
    s3.put_object(Bucket="bucket", Key=f"{prefix}/model/config.json", Body=b"{}")
    return prefix


def read_json(s3, key):
    return json.loads(s3.get_object(Bucket="bucket", Key=key)["Body"].read())


def test_collect_metrics_builds_the_report_from_s3_and_stores_it_beside_the_model(bucket):
    cfg = eks_config()
    prefix = put_outputs(bucket, cfg)

    result = target().collect_metrics(cfg, {"job": "the-job"})

    assert result["run_dir"] == cfg.run_dir and result["status"] == "success"
    assert result["model_dir"] == f"{cfg.run_dir}/model"
    assert result["report_json"] == f"{cfg.run_dir}/report.json"
    assert result["report_html"] == f"{cfg.run_dir}/report.html"
    report = read_json(bucket, f"{prefix}/report.json")
    assert report["metrics"] == result["metrics"]
    assert report["metrics"]["steps"] == 3 and report["metrics"]["world_size"] == 16
    assert report["metrics"]["eval_loss_ratio"] == pytest.approx(2.5 / 4.0)
    assert [p["loss"] for p in report["series"]["train"]] == [3.5, 3.0, 2.5]
    assert report["artifacts"]["model"] == "model"
    assert report["stages"] == {"train": {"job": "the-job"}}
    assert "1 unreadable lines in metrics.jsonl" in report["warnings"]
    html = bucket.get_object(Bucket="bucket", Key=f"{prefix}/report.html")
    assert html["ContentType"].startswith("text/html")
    assert b"<svg" in html["Body"].read()


def test_collect_metrics_without_metrics_in_s3_gives_a_report_that_says_so(bucket):
    cfg = eks_config()
    prefix = put_outputs(bucket, cfg, metrics=False)

    result = target().collect_metrics(cfg, {"job": "the-job"})

    report = read_json(bucket, f"{prefix}/report.json")
    assert "metrics.jsonl missing: no training steps were logged" in report["warnings"]
    assert "summary.json missing: training did not finish" in report["warnings"]
    assert report["metrics"]["steps"] is None and result["metrics"]["steps"] is None


def test_collect_metrics_reads_a_shared_file_system_the_worker_mounts(aws, tmp_path):
    cfg = eks_config(run_dir=str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRAIN))
    result = target().collect_metrics(cfg, {})
    assert result["metrics"]["steps"] == 3 and result["model_dir"] is None
    assert json.loads((tmp_path / "run" / "report.json").read_text())["status"] == "success"


def test_collect_metrics_says_the_report_cannot_be_built_when_the_path_is_not_mounted(aws):
    cfg = eks_config(run_dir="/fsx/not-mounted-here/run")
    with pytest.raises(ReportUnavailable, match="report cannot be built: output directory "
                       "/fsx/not-mounted-here/run is not visible on this Airflow worker"):
        target().collect_metrics(cfg, {})


def test_teardown_after_a_failed_run_stores_a_failed_report_of_the_outputs(
        bucket, nodegroup, cluster):
    cfg, t = eks_config(), target()
    snap = t.snapshot(cfg)
    prefix = put_outputs(bucket, cfg)

    done = t.teardown(cfg, snap)

    assert scaling(nodegroup) == SCALING
    report = read_json(bucket, f"{prefix}/report.json")
    assert report["status"] == "failed" and report["metrics"]["steps"] == 3
    assert done["report"]["status"] == "failed"


def test_teardown_writes_no_report_without_outputs_or_over_collect_metrics_one(
        bucket, nodegroup, cluster):
    cfg, t = eks_config(), target()
    snap = t.snapshot(cfg)
    assert "report" not in t.teardown(cfg, snap)  # the run failed before the trainer wrote
    prefix = put_outputs(bucket, cfg)
    t.collect_metrics(cfg, {})
    assert "report" not in t.teardown(cfg, snap)
    assert read_json(bucket, f"{prefix}/report.json")["status"] == "success"


def test_a_hang_a_restart_survived_reaches_the_report_of_an_s3_run(bucket):
    cfg = eks_config()
    prefix = put_outputs(bucket, cfg)
    hang = {"stage": "train", "type": "TrainingHang", "rank": 3, "time": 5.0,
            "message": "training hang: rank 3 made no progress for 1800 s after step 2"}
    bucket.put_object(Bucket="bucket", Key=f"{prefix}/errors/rank_3.json",
                      Body=json.dumps(hang).encode())
    target().collect_metrics(cfg, {"job": "the-job"})
    report = read_json(bucket, f"{prefix}/report.json")
    assert any(w.startswith(hang["message"]) for w in report["warnings"]), report["warnings"]
