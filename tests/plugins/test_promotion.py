"""Promotion and tracking (plugins/finetune/tracking.py): the decision, and MLflow's runs,
registry and alias through a real `mlflow server` (local and S3 artifacts)."""

from __future__ import annotations

import json

import pytest

from finetune.report import write_report
from finetune.tracking import decide, metric_of, promote_run, shown_uri
from finetune.validate import validate_params
from tests.support.aws import new_bucket
from tests.support.mlflow import start_mlflow, stop_mlflow


@pytest.mark.parametrize(("challenger", "champion", "margin", "higher", "decision"), [
    (2.0, None, 0.0, False, "first"),
    (2.0, 2.5, 0.1, False, "promoted"),
    (2.45, 2.5, 0.1, False, "rejected"),  # better, but not by the margin
    (2.6, 2.5, 0.0, False, "rejected"),
    (0.8, 0.5, 0.2, True, "promoted"),
    (0.5, 0.5, 0.0, True, "rejected"),  # a tie is no improvement
    (None, 2.5, 0.0, False, "rejected"),
])
def test_a_model_is_promoted_only_when_it_beats_the_champion_by_the_margin(
        challenger, champion, margin, higher, decision):
    assert decide(challenger, champion, margin, higher) == decision


def test_the_promotion_metric_is_read_from_loss_perplexity_or_a_task_with_its_direction():
    evaluation = {"loss": 2.0, "perplexity": 7.4, "tasks": {"demo_instructions": {"acc": 0.5}},
                  "higher_is_better": {"demo_instructions": {"acc": True}}}
    assert metric_of(evaluation, "eval_loss") == (2.0, False)
    assert metric_of(evaluation, "perplexity") == (7.4, False)
    assert metric_of(evaluation, "demo_instructions.acc") == (0.5, True)
    assert metric_of(evaluation, "demo_instructions.f1") == (None, True)


def test_a_tracking_uri_is_shown_without_its_credentials():
    assert shown_uri("https://user:s3cret@mlflow.example:5000/x") == "https://mlflow.example:5000/x"
    assert shown_uri("sqlite:////tmp/mlflow.db") == "sqlite:////tmp/mlflow.db"


@pytest.mark.parametrize(("conf", "field"), [
    ({"eval_tasks": "demo_instructions,hellaswag"}, "eval_tasks"),
    ({"eval_dataset": "no/such/eval.jsonl"}, "eval_dataset"),
    ({"promotion_metric": "mmlu.acc"}, "promotion_metric"),
    ({"eval_tasks": "", "promotion_metric": "demo_instructions.acc"}, "promotion_metric"),
])
def test_validate_refuses_evaluation_params_that_cannot_run_naming_the_field(conf, field, tmp_path):
    from finetune.config import ConfigError

    with pytest.raises(ConfigError) as err:
        validate_params({"output_dir": str(tmp_path), **conf}, run_id="r")
    assert field in {f for f, _ in err.value.errors}, err.value.errors


def run_with_evaluation(tmp_path, run_id: str, loss: float, **conf):
    """A validated run config and its run dir holding a report with an evaluation."""
    cfg = validate_params({"output_dir": str(tmp_path), **conf}, run_id=run_id)
    run_dir = tmp_path / cfg.run_name
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "model" / "config.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text(
        json.dumps({"type": "train", "step": 1, "loss": 3.0, "lr": 0.001, "mfu": 0.1}) + "\n")
    (run_dir / "evaluation.json").write_text(json.dumps({
        "loss": loss, "perplexity": 2.718 ** loss, "samples": [
            {"prompt": "What is 1 plus 1?", "reference": "2", "output": "2"}],
        "tasks": {"demo_instructions": {"acc": 0.5}},
        "higher_is_better": {"demo_instructions": {"acc": True}}, "champion": None}))
    write_report(run_dir, run_id=run_id, status="success", config=cfg.to_dict())
    return cfg, run_dir


def _no_s3():
    raise AssertionError("local run directories")


@pytest.mark.slow
def test_an_unreachable_tracking_server_leaves_the_run_unpromoted_and_the_report_warns(
        tmp_path, monkeypatch):
    from finetune.etcd import free_port
    from finetune.tracking import champion

    monkeypatch.setenv("AIRFLOW__FINETUNE__MLFLOW_TRACKING_URI",
                       f"http://127.0.0.1:{free_port()}")
    cfg, run_dir = run_with_evaluation(tmp_path, "r1", 2.0)
    found = champion(cfg, "llm_finetune")
    assert "cannot be reached" in found["unavailable"]
    result = promote_run(cfg, "llm_finetune", {}, found, (run_dir / "model").as_uri(), _no_s3)
    assert result["promotion"]["decision"] == "rejected"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["promotion"]["decision"] == "rejected"
    assert report["tracking"]["run_id"] is None
    assert any("MLflow" in w and "cannot be reached" in w for w in report["warnings"])


def _promote(tmp_path, run_id: str, loss: float, model_name: str):
    from finetune.tracking import champion

    cfg, run_dir = run_with_evaluation(tmp_path, run_id, loss)
    found = champion(cfg, model_name)
    return promote_run(cfg, model_name, {}, found, (run_dir / "model").as_uri(), _no_s3), \
        run_dir


@pytest.mark.slow
def test_mlflow_server_tracks_runs_and_moves_the_champion_alias_only_on_promotion(
        mlflow_server, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("AIRFLOW__FINETUNE__MLFLOW_TRACKING_URI", mlflow_server)
    first, _ = _promote(tmp_path, "r1", 2.0, "promo")
    worse, _ = _promote(tmp_path, "r2", 2.5, "promo")
    better, run_dir = _promote(tmp_path, "r3", 1.5, "promo")
    assert [r["promotion"]["decision"] for r in (first, worse, better)] == \
        ["first", "rejected", "promoted"]
    assert better["promotion"]["champion"] == 2.0  # version 1's logged loss
    client = MlflowClient(mlflow_server)
    champion = client.get_model_version_by_alias("promo", "champion")
    assert champion.version == "2" and champion.run_id == better["tracking"]["run_id"]
    run = client.get_run(better["tracking"]["run_id"])
    assert run.data.params["promotion_margin"] == "0.0"
    assert run.data.metrics["eval/loss"] == 1.5
    assert run.data.metrics["eval/demo_instructions.acc"] == 0.5
    assert [m.value for m in client.get_metric_history(run.info.run_id, "mfu")] == [0.1]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"report.json", "report.html", "evaluation.json", "model"} <= artifacts
    rejected = client.get_run(worse["tracking"]["run_id"])
    assert rejected.data.tags["promotion"] == "rejected"
    report = json.loads((run_dir / "report.json").read_text())
    assert report["tracking"]["run_id"] == run.info.run_id
    assert report["promotion"]["version"] == "2"


@pytest.mark.slow
def test_mlflow_server_with_s3_artifacts_stores_the_run_s_report_in_the_bucket(
        moto_endpoint, tmp_path, monkeypatch):
    from tests.support.aws import moto_env

    s3, bucket = new_bucket(monkeypatch, moto_endpoint)
    home = tmp_path / "mlflow"
    home.mkdir()
    proc, url = start_mlflow(home, f"s3://{bucket}/mlflow", env=moto_env(moto_endpoint))
    try:
        monkeypatch.setenv("AIRFLOW__FINETUNE__MLFLOW_TRACKING_URI", url)
        result, _ = _promote(tmp_path, "r1", 2.0, "promo-s3")
    finally:
        stop_mlflow(proc)
    assert result["promotion"]["decision"] == "first"
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    run_id = result["tracking"]["run_id"]
    assert any(k.endswith(f"{run_id}/artifacts/report.json") for k in keys), keys
    assert any(k.endswith(f"{run_id}/artifacts/model/config.json") for k in keys), keys


def test_the_contract_s_eval_tasks_are_the_task_files_shipped_in_trainer_eval_tasks():
    import yaml

    from finetune import REPO_ROOT
    from finetune_contract.fields import EVAL_TASKS

    names = set()
    for path in (REPO_ROOT / "trainer" / "eval_tasks").glob("*.yaml"):
        # `!function` tags are the harness's own: read the plain keys only
        text = "\n".join(line for line in path.read_text().splitlines() if "!function" not in line)
        names.add(yaml.safe_load(text)["task"])
    assert names == set(EVAL_TASKS)
