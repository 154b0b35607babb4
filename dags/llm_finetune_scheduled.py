"""Retrain a model on a schedule and whenever its data set changes.

A run starts at `CRON` and whenever the data set asset gets an event (an upstream DAG with the
asset as an outlet, `POST /api/v2/assets/events`, or an asset watcher). It fine-tunes with the
preset and overrides in `CONF`; the Airflow Variable `llm_finetune_scheduled` (a JSON object of
the same shape, read when a run starts) overrides them without editing this file. A successful
run adds an event with the report summary to the model asset, which evaluation and deployment
DAGs schedule on. One run at a time; `train` takes a slot of the pool `finetune_cluster`
(create it: `airflow pools set finetune_cluster 1 "GPU cluster" --include-deferred`).
"""

from __future__ import annotations

from airflow.sdk import Asset, AssetOrTimeSchedule, CronTriggerTimetable, dag

from finetune.assets import model_asset
from finetune.pipeline import PIPELINE_DOC, finetune_pipeline

DAG_ID = "llm_finetune_scheduled"
# Edit these three for your deployment (or set the Variable).
DATASET = Asset(name="finetune_dataset", uri="s3://finetune-data/instructions/",
                group="dataset")
CRON = "0 3 * * 0"  # Sundays 03:00 UTC
CONF = {"preset": "tiny-local"}
CONF_VARIABLE = DAG_ID
POOL = "finetune_cluster"


@dag(
    dag_id=DAG_ID,
    schedule=AssetOrTimeSchedule(timetable=CronTriggerTimetable(CRON, timezone="UTC"),
                                 assets=DATASET),
    catchup=False,
    max_active_runs=1,
    tags=["llm", "fine-tuning", "fsdp", "scheduled"],
    doc_md=__doc__ + PIPELINE_DOC,
)
def llm_finetune_scheduled():
    finetune_pipeline(base_conf=CONF, conf_variable=CONF_VARIABLE, pool=POOL,
                      model_asset=model_asset(DAG_ID))


llm_finetune_scheduled()
