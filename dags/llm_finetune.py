"""Fine-tune a Llama-class model with PyTorch FSDP, end to end.

validate -> snapshot (setup) -> scale_up -> build_image + reset_etcd -> train -> collect_metrics,
and teardown, which runs whenever the setup ran: after a success, after any stage failed, and
after a run is marked failed. Choose the target (`local`: this machine; `eks`: Amazon EKS) and
the training parameters in the trigger form.
"""

from __future__ import annotations

from airflow.sdk import dag, get_current_context, task

from finetune.operators import ScaleUpOperator, TrainOperator
from finetune.params import dag_params


def _target(run_config: dict):
    from finetune.targets import run_target

    return run_target(run_config)


@dag(
    dag_id="llm_finetune",
    schedule=None,
    catchup=False,
    params=dag_params(),
    tags=["llm", "fine-tuning", "fsdp"],
    doc_md=__doc__,
)
def llm_finetune():
    @task
    def validate() -> dict:
        """Params -> one typed, immutable run config; every bad value fails here."""
        from finetune.config import validate_params

        context = get_current_context()
        cfg = validate_params(dict(context["params"]), run_id=context["run_id"])
        return cfg.to_dict()

    @task
    def snapshot(run_config: dict) -> dict:
        """Setup: record what teardown restores (the node group's scaling config on eks)."""
        target, cfg = _target(run_config)
        return target.snapshot(cfg)

    @task
    def build_image(run_config: dict) -> dict:
        target, cfg = _target(run_config)
        return target.build_image(cfg)

    @task
    def reset_etcd(run_config: dict) -> dict:
        target, cfg = _target(run_config)
        return target.reset_etcd(cfg)

    @task
    def collect_metrics(run_config: dict, trained: dict) -> dict:
        target, cfg = _target(run_config)
        return target.collect_metrics(cfg, trained)

    @task
    def teardown(run_config: dict, snapshot_result: dict) -> dict:
        target, cfg = _target(run_config)
        return target.teardown(cfg, snapshot_result)

    cfg = validate()
    snap = snapshot(cfg)
    # On eks both wait deferred (no worker slot held); elsewhere they run in the task.
    up = ScaleUpOperator(task_id="scale_up", run_config=cfg)
    snap >> up
    image, rendezvous = build_image(cfg), reset_etcd(cfg)
    up >> [image, rendezvous]
    trained = TrainOperator(task_id="train", run_config=cfg, image=image,
                            rendezvous=rendezvous)
    metrics = collect_metrics(cfg, trained.output)
    metrics >> teardown(cfg, snap).as_teardown(setups=snap)


llm_finetune()
