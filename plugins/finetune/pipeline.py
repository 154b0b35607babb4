"""The fine-tuning task graph, shared by every DAG that runs it (llm_finetune and the scheduled
retraining DAG): call `finetune_pipeline()` inside a `@dag` function; `PIPELINE_DOC` says what
its tasks do (the DAGs' doc_md, which the Airflow UI shows).
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Mapping
from typing import Any

from airflow.sdk import Asset, Variable, get_current_context, task

from finetune.operators import StageOperator
from finetune.targets.base import Stage

log = logging.getLogger(__name__)

# Markdown; tests/dags/test_llm_finetune.py holds it to the DAG's tasks.
PIPELINE_DOC = """
```
validate -> prepare_data -> snapshot (setup) -> scale_up -> build_image + rendezvous
  -> preflight -> train -> evaluate -> collect_metrics -> promote
find_champion -> evaluate, promote
teardown (whenever the setup ran)
```

- **validate**: the params become one typed run config; a bad value fails here, naming it.
- **prepare_data**: the data set encoded once (or an identical one reused), before any node.
- **snapshot**: records what teardown restores (the node group's size on eks).
- **scale_up**: the run's nodes, waited for until Ready with their GPUs.
- **build_image**: the trainer image, built and pushed unless its content hash is in ECR.
- **rendezvous**: a clean rendezvous for torchrun (the run's etcd keys deleted, or c10d).
- **preflight**: every node's GPUs and bus bandwidth checked; a bad node is named.
- **train**: torchrun on every node (a PyTorchJob or TrainJob on eks).
- **find_champion**: the model the registry promoted last, to measure this one against.
- **evaluate**: held-out loss, samples and benchmark tasks, beside the champion's.
- **collect_metrics**: report.json and report.html (with GPU metrics) beside the model.
- **promote**: the model becomes the champion when it beats it by the margin.
- **teardown**: stops what the run started and gives the nodes back, after any failure too.
"""

# The stages a new try resumes instead of repeating, retried when a try is lost with its
# worker, scheduler or the whole of Airflow (Airflow's default is no retry): scale_up (the
# reservation and the node group's size are set, not added), build_image (content-addressed:
# a tag in ECR is skipped, a running build Job adopted), preflight (checks the nodes again),
# train (reattaches to the running training or takes a finished one's result),
# collect_metrics (rewrites the report) and teardown (every step is idempotent). validate and
# snapshot are retried by no one: they fail the same way again. rendezvous neither: it clears
# the store a running training uses.
# A stage's definite verdict (a training that failed by itself, capacity that did not come,
# an image not in ECR: `targets.base.StageFailed`) is not retried: the nodes go back at once.
# Five retries, 30 s doubling to at most 10 minutes: about 15 minutes of Airflow coming back,
# during which a try whose start meets no api-server is killed by its supervisor.
# FINETUNE_RETRY_DELAY_S: another first delay (the restart tests' shorter one).
RESUMABLE = {"retries": 5, "retry_exponential_backoff": 2.0,
             "retry_delay": datetime.timedelta(
                 seconds=float(os.environ.get("FINETUNE_RETRY_DELAY_S", "30"))),
             "max_retry_delay": datetime.timedelta(minutes=10)}


def _s3_client(cfg):
    """S3 through the run's AWS connection: an s3:// run directory's report and evaluation."""
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    return S3Hook(aws_conn_id=cfg.aws_conn_id).get_conn()


def _target(run_config: dict):
    from finetune.targets import run_target

    return run_target(run_config)


def run_conf(context: Mapping[str, Any], base_conf: Mapping[str, Any] | None,
             conf_variable: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(params, given) for validate_params.

    Without a base conf or Variable: the DAG's params and the conf the run was triggered with.
    With them: the DAG file's conf <- the Variable's (read when the run starts, a JSON object)
    <- what a manual trigger set on purpose.
    """
    given = dict(context["dag_run"].conf or {})
    if base_conf is None and conf_variable is None:
        return dict(context["params"]), given
    from finetune_contract.parameters import defaults
    from finetune_contract.presets import explicit_fields

    conf = dict(base_conf or {})
    if conf_variable:
        conf.update(variable_conf(conf_variable))
    conf.update(explicit_fields(given, defaults()))
    return conf, conf


def variable_conf(name: str) -> dict[str, Any]:
    """The conf an Airflow Variable holds (a JSON object); {} when there is no such Variable.

    Read raw and parsed here: with deserialize_json, a value that is not JSON is logged by the
    secrets backend lookup and then reads as missing, and the run would train the DAG file's
    conf without a word.
    """
    import json

    from finetune.config import ConfigError

    raw = Variable.get(name, default=None)
    if raw is None:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ConfigError([(f"Variable {name}", f"is not valid JSON ({exc}); it must hold a JSON "
                            "object of run params")]) from None
    if not isinstance(value, dict):
        raise ConfigError([(f"Variable {name}", "must hold a JSON object of run params, got a "
                            f"JSON {type(value).__name__}")])
    return value


# -- the stages' work as tasks run it, shared by every DAG (finetune.sweep.pipeline too) -------


def find_champion_of(run_config: dict) -> dict:
    """The DAG's champion in the MLflow registry ({} when none), for evaluate to measure."""
    from finetune.config import RunConfig
    from finetune.tracking import champion

    return champion(RunConfig.from_dict(run_config), get_current_context()["dag"].dag_id)


def collect_run_metrics(run_config: dict, trained: dict) -> dict:
    """collect_metrics: the run's report (report.json and report.html) beside its model."""
    target, cfg = _target(run_config)
    return target.collect_metrics(cfg, trained)


def promote_model(run_config: dict, summary: dict, champion_found: dict,
                  model_asset: Asset | None, event_extra: dict | None = None,
                  mlflow_run: dict | None = None) -> dict:
    """Track the run in MLflow and promote its model when it beats the champion; only a
    promotion adds the model asset event (`event_extra` added to its extra); a rejection skips
    the task. mlflow_run: the MLflow run to track it in (a sweep's trial's child run)."""
    from airflow.sdk.exceptions import AirflowSkipException

    from finetune.assets import model_asset_uri, model_event_extra
    from finetune.config import RunConfig
    from finetune.tracking import promote_run

    cfg = RunConfig.from_dict(run_config)
    result = promote_run(cfg, get_current_context()["dag"].dag_id, summary, champion_found,
                         model_asset_uri(cfg), s3_client=lambda: _s3_client(cfg),
                         **({"mlflow_run": mlflow_run} if mlflow_run else {}))
    promotion = result["promotion"]
    if promotion["decision"] == "rejected":
        raise AirflowSkipException(f"not promoted: {promotion['reason'] or ''} "
                                   f"({promotion['metric']} {promotion['challenger']} vs "
                                   f"champion {promotion['champion']})")
    if model_asset is not None:
        events = get_current_context()["outlet_events"]
        events[model_asset].extra.update({**model_event_extra(cfg, summary), **result,
                                          **(event_extra or {})})
    return result


def tear_down(run_config: dict, snapshot_result: dict) -> dict:
    """teardown: what the run started stopped and deleted, its nodes given back."""
    target, cfg = _target(run_config)
    return target.teardown(cfg, snapshot_result)


def finetune_pipeline(*, base_conf: Mapping[str, Any] | None = None,
                      conf_variable: str | None = None, pool: str | None = None,
                      model_asset: Asset | None = None) -> None:
    """Add the stages to the DAG being defined.

    base_conf, conf_variable: the run's conf from the DAG file and an Airflow Variable (see
    `run_conf`); pool: the pool `train` runs in (one slot per concurrent training on the
    cluster); model_asset: gets an event with the report summary when the run succeeds.
    """

    @task
    def validate() -> dict:
        """Params -> one typed, immutable run config; every bad value fails here."""
        from finetune.run_plan import plan_run, plan_text
        from finetune.validate import config_table, validate_params

        context = get_current_context()
        params, given = run_conf(context, base_conf, conf_variable)
        cfg = validate_params(params, run_id=context["run_id"],
                              dag_id=context["dag_run"].dag_id, given=given)
        log.info("the run will use these values (a field left at its built-in default takes "
                 "the preset's value):\n%s", config_table(cfg))
        log.info("%s", plan_text(cfg, plan_run(cfg)))
        return cfg.to_dict()

    @task
    def snapshot(run_config: dict) -> dict:
        """Setup: record what teardown restores (the node group's scaling config on eks)."""
        target, cfg = _target(run_config)
        return target.snapshot(cfg)

    @task(task_id="rendezvous")
    def clean_rendezvous(run_config: dict) -> dict:
        """The run's rendezvous made clean: its etcd keys deleted (or etcd restarted), or a
        fresh c10d store where there is no etcd; returns its endpoint, backend and id."""
        target, cfg = _target(run_config)
        return target.rendezvous(cfg)

    @task
    def find_champion(run_config: dict) -> dict:
        """The DAG's champion in the MLflow registry ({} when none), for evaluate to measure."""
        return find_champion_of(run_config)

    @task(**RESUMABLE)
    def collect_metrics(run_config: dict, trained: dict) -> dict:
        return collect_run_metrics(run_config, trained)

    @task(outlets=[model_asset] if model_asset is not None else [])
    def promote(run_config: dict, summary: dict, champion_found: dict) -> dict:
        """Track the run in MLflow and promote its model when it beats the champion; only a
        promotion adds the model asset event (a rejection skips this task)."""
        return promote_model(run_config, summary, champion_found, model_asset)

    @task(**RESUMABLE)
    def teardown(run_config: dict, snapshot_result: dict) -> dict:
        return tear_down(run_config, snapshot_result)

    # The data set encoded once (packed, split) before any GPU node is up, or reused when an
    # identical one was; its statistics decide whether the run can go on. Its result is the run
    # config with the prepared set and the counted split sizes (the plan's steps). On eks it may
    # run as a pod of its own (prepare_on), which the task waits for deferred.
    cfg = StageOperator(task_id="prepare_data", stage=Stage.PREPARE_DATA,
                        run_config=validate()).output
    snap = snapshot(cfg)
    # The long stages: a target that waits (eks) defers them, no worker slot held.
    up = StageOperator(task_id="scale_up", stage=Stage.SCALE_UP, run_config=cfg, **RESUMABLE)
    snap >> up
    image = StageOperator(task_id="build_image", stage=Stage.BUILD_IMAGE, run_config=cfg,
                          **RESUMABLE)
    rendezvous = clean_rendezvous(cfg)
    up >> [image, rendezvous]
    # Every node checked before it trains; a bad one is named, cordoned or replaced.
    checked = StageOperator(task_id="preflight", stage=Stage.PREFLIGHT, run_config=cfg,
                            inputs={"image": image.output, "rendezvous": rendezvous},
                            **RESUMABLE)
    trained = StageOperator(task_id="train", stage=Stage.TRAIN, run_config=cfg,
                            inputs={"image": image.output, "rendezvous": rendezvous},
                            **RESUMABLE, **({"pool": pool} if pool else {}))
    checked >> trained
    champion_found = find_champion(cfg)
    evaluated = StageOperator(task_id="evaluate", stage=Stage.EVALUATE, run_config=cfg,
                              inputs={"trained": trained.output, "image": image.output,
                                      "champion": champion_found})
    metrics = collect_metrics(cfg, trained.output)
    evaluated >> metrics
    promote(cfg, metrics, champion_found)
    metrics >> teardown(cfg, snap).as_teardown(setups=snap)
