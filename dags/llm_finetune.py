"""Fine-tune an open decoder-only LLM (Llama, Qwen, Mistral, Gemma, Phi, OLMo) with PyTorch
FSDP2, end to end, from the trigger form, the REST API or `make run`.

Choose a preset, the target (`local`: this machine; `eks`: Amazon EKS) and the training
parameters in the trigger form.
"""

from __future__ import annotations

from airflow.sdk import dag

from finetune.assets import model_asset
from finetune.params import dag_params
from finetune.pipeline import PIPELINE_DOC, finetune_pipeline

DAG_ID = "llm_finetune"


@dag(
    dag_id=DAG_ID,
    schedule=None,
    catchup=False,
    params=dag_params(),
    tags=["llm", "fine-tuning", "fsdp"],
    doc_md=__doc__ + PIPELINE_DOC,
)
def llm_finetune():
    # Every success adds an event (with the report summary) to the asset `llm_finetune.model`.
    finetune_pipeline(model_asset=model_asset(DAG_ID))


llm_finetune()
