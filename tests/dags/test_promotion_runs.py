"""The quality loop through real DAG runs on the local target and a real MLflow server: a first
promotion, a rejection (fewer steps) and a second promotion (more steps)."""

from __future__ import annotations

import json

import pytest

from finetune.demo import run_dag, task_results
from finetune.names import run_dir_name

SHORT = {"seq_len": 96, "eval_interval": 0, "checkpoint_interval": 0, "warmup_steps": 4,
         "procs_per_node": 2, "sample_prompts": 3}


def model_events(dag_id: str) -> int:
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import func, select

    with create_session() as session:
        return session.scalar(select(func.count()).select_from(AssetEvent).join(
            AssetModel, AssetEvent.asset_id == AssetModel.id).where(
            AssetModel.name == f"{dag_id}.model"))


@pytest.mark.slow
def test_runs_promote_a_first_model_reject_a_worse_one_and_promote_a_better_one(
        mlflow_server, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("AIRFLOW__FINETUNE__MLFLOW_TRACKING_URI", mlflow_server)
    events_before = model_events("llm_finetune")
    reports = []
    for steps in (24, 6, 60):
        dag_run = run_dag({**SHORT, "max_steps": steps, "output_dir": str(tmp_path)})
        states = task_results(dag_run)
        assert str(dag_run.state) == "success", states
        reports.append(json.loads((tmp_path / run_dir_name(dag_run.run_id) /
                                   "report.json").read_text()))
        assert states["promote"] == ("skipped" if steps == 6 else "success"), states
    first, worse, better = (r["promotion"] for r in reports)
    assert first["decision"] == "first" and first["champion"] is None
    assert worse["decision"] == "rejected" and worse["challenger"] > worse["champion"]
    assert better["decision"] == "promoted" and better["challenger"] < better["champion"]
    # measured on the same eval set: the champion's loss in run 3 is run 1's own
    assert better["champion"] == pytest.approx(first["challenger"], rel=1e-4)
    # only the two promotions added a model asset event
    assert model_events("llm_finetune") - events_before == 2

    evaluation = reports[2]["evaluation"]
    assert len(evaluation["samples"]) == 3
    assert all(s["prompt"].strip().startswith("### Instruction") and s["reference"]
               for s in evaluation["samples"])
    assert 0 <= evaluation["tasks"]["demo_instructions"]["acc"] <= 1
    assert evaluation["perplexity"] == pytest.approx(2.718281828 ** evaluation["loss"], rel=1e-3)

    client = MlflowClient(mlflow_server)
    champion = client.get_model_version_by_alias("llm_finetune", "champion")
    assert champion.run_id == reports[2]["tracking"]["run_id"]
    assert champion.version == "2"
    assert all(r["tracking"]["run_id"] for r in reports)  # the rejected run is tracked too
