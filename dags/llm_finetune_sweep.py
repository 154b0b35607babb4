"""Sweep: fine-tune many variants of a run as one (learning rates, LoRA ranks, data mixtures,
sequence lengths) and keep the best, from the trigger form, the REST API or
`python -m finetune.cli run --dag llm_finetune_sweep`.

Set the run's fields as for `llm_finetune`, then the Sweep section: the search space (the
fields to vary: a grid, a list of confs, or random samples), the trial budget and how many
trials run at once, and the early-stopping rule's rungs and reduction factor. Each trial's
train takes a slot of the pool `finetune_cluster` (one per training the cluster runs at once:
`airflow pools set finetune_cluster 2 "GPU cluster" --include-deferred` for two trials at
once). docs/user-guide.md, "Sweeps", says what each task does and what the report shows.
"""

from __future__ import annotations

from airflow.sdk import dag

from finetune.assets import model_asset
from finetune.params import dag_params
from finetune.sweep.pipeline import SWEEP_DOC, sweep_pipeline

DAG_ID = "llm_finetune_sweep"
POOL = "finetune_cluster"


@dag(
    dag_id=DAG_ID,
    schedule=None,
    catchup=False,
    params=dag_params(sweep=True),
    tags=["llm", "fine-tuning", "fsdp", "sweep"],
    doc_md=__doc__ + SWEEP_DOC,
)
def llm_finetune_sweep():
    # A promotion adds an event naming the winning trial to the asset `llm_finetune_sweep.model`.
    sweep_pipeline(model_asset=model_asset(DAG_ID), pool=POOL)


llm_finetune_sweep()
