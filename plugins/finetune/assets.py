"""Airflow Assets: the model a fine-tuning DAG produces, for downstream DAGs to schedule on.

One asset per DAG (a stable identity: evaluation or deployment DAGs name it in `schedule`);
each event's extra says which run made the model, where it is, and the run's headline figures.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from airflow.sdk import Asset

from finetune.config import RunConfig


def model_asset(dag_id: str) -> Asset:
    """The model `dag_id`'s runs produce (`x-` is Airflow's scheme for custom URIs)."""
    return Asset(name=f"{dag_id}.model", uri=f"x-finetune://{dag_id}/model", group="model")


def model_asset_uri(cfg: RunConfig) -> str:
    """Where this run's Hugging Face model is: file:// on this machine, else s3:// or a path
    the trainer's pods mount."""
    model = f"{cfg.run_dir.rstrip('/')}/model"
    return Path(model).as_uri() if cfg.target == "local" else model


def model_event_extra(cfg: RunConfig, summary: dict[str, Any]) -> dict[str, Any]:
    """The model asset event's extra: the run, its preset, the model and the report summary."""
    return {"run_id": cfg.run_id, "preset": cfg.preset, "preset_version": cfg.preset_version,
            "model": cfg.model, "model_uri": model_asset_uri(cfg),
            "status": summary.get("status"), "report_json": summary.get("report_json"),
            "metrics": summary.get("metrics", {})}
