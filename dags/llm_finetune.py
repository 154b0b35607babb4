"""Fine-tune a Llama-class model with PyTorch FSDP, end to end.

validate -> prepare_data -> snapshot (setup) -> scale_up -> build_image + rendezvous -> preflight
-> train -> collect_metrics,
and teardown, which runs whenever the setup ran: after a success, after any stage failed, and
after a run is marked failed. Choose a preset, the target (`local`: this machine; `eks`: Amazon
EKS) and the training parameters in the trigger form.
"""

from __future__ import annotations

from airflow.sdk import dag

from finetune.assets import model_asset
from finetune.params import dag_params
from finetune.pipeline import finetune_pipeline

DAG_ID = "llm_finetune"


@dag(
    dag_id=DAG_ID,
    schedule=None,
    catchup=False,
    params=dag_params(),
    tags=["llm", "fine-tuning", "fsdp"],
    doc_md=__doc__,
)
def llm_finetune():
    # Every success adds an event (with the report summary) to the asset `llm_finetune.model`.
    finetune_pipeline(model_asset=model_asset(DAG_ID))


llm_finetune()
