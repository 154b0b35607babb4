"""The evaluation job: trainer.evaluate as a one-GPU job of the run's launcher (PyTorchJob or
TrainJob) on the run's nodes, created or, on a retry, adopted; once it ends, its failure with
the pods' reasons, or its result from evaluation.json beside the model. Teardown deletes it
with the run's other jobs (`job.delete_run_jobs`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from finetune.config import RunConfig
from finetune.outputs import evaluation_result, read_output
from finetune.targets.base import StageFailed
from finetune.targets.eks import job
from finetune.targets.eks.launchers import launcher_for
from finetune_contract.fields import EVALUATION_FILE

log = logging.getLogger(__name__)


def start_evaluation_job(api: Any, cfg: RunConfig, image: str, champion_uri: str) -> str:
    """Create the run's evaluation job (an earlier try's is adopted); its name."""
    import kubernetes

    launcher = launcher_for(cfg)
    manifest = launcher.evaluation_manifest(cfg, image, champion_uri)
    name = manifest["metadata"]["name"]
    custom = kubernetes.client.CustomObjectsApi(api)
    try:
        custom.create_namespaced_custom_object(launcher.group, launcher.version,
                                               cfg.namespace, launcher.plural, manifest)
        log.info("created %s %s/%s: trainer.evaluate", launcher.kind, cfg.namespace, name)
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise
        log.info("adopting %s %s/%s an earlier try created", launcher.kind, cfg.namespace,
                 name)
    return name


def evaluation_outcome(api: Any, cfg: RunConfig, name: str, event: dict, started: float,
                       s3_client: Callable[[], Any]) -> dict:
    """What evaluate returns once the job ended (`event`, JobTrigger's): evaluation.json's
    figures; a failed job, or one that wrote no evaluation.json, fails with why."""
    launcher = launcher_for(cfg)
    if event["status"] == "failed":
        raise StageFailed("evaluation failed: " + job.failure_report(
            api, cfg.namespace, name, event["message"], launcher))
    text = read_output(cfg.run_dir, EVALUATION_FILE, s3_client)
    if text is None:
        raise StageFailed(f"{launcher.kind} {name} succeeded but {cfg.run_dir} has no "
                           f"{EVALUATION_FILE}")
    return evaluation_result(json.loads(text), f"{cfg.run_dir.rstrip('/')}/"
                             f"{EVALUATION_FILE}", time.time() - started)
