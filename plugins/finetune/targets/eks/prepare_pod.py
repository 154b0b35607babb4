"""The prepare_data pod (prepare_on pod): a batch/v1 Job of the trainer image that encodes the
run's data set in a CPU pod of its own, before any GPU node is up. Started (or adopted from an
earlier try), its failure told first cause first, the record it wrote beside the run's outputs
read back for the stage, and deleted with its pod whatever happened (teardown deletes one left).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from finetune.config import RunConfig
from finetune.outputs import read_output
from finetune.targets.base import StageFailed
from finetune.targets.eks.clients import create_or_replace
from finetune.targets.eks.image_build import (
    JOB_NAME_LABEL,
    create_or_adopt_batch_job,
    delete_batch_job,
)
from finetune.targets.eks.job import list_pods, log_tail, pod_death, pod_failure
from finetune.targets.eks.manifests import (
    LABEL_PROGRAM,
    PREPARE,
    PREPARE_DEADLINE_S,
    prepare_job_manifest,
    run_selector,
    trainer_configmap_manifest,
)
from finetune_contract.fields import PREPARE_DATA_FILE

log = logging.getLogger(__name__)


def start_prepare_job(api: Any, cfg: RunConfig, image: str) -> str:
    """The trainer's ConfigMap (the pod reads the run's trainer config from it) and the
    prepare_data Job, created, or adopted from an earlier try while it runs (a failed one is
    replaced); its name."""
    import kubernetes

    core = kubernetes.client.CoreV1Api(api)
    create_or_replace(core.create_namespaced_config_map, core.replace_namespaced_config_map,
                      trainer_configmap_manifest(cfg))
    manifest = prepare_job_manifest(cfg, image)
    create_or_adopt_batch_job(kubernetes.client.BatchV1Api(api), manifest, "prepare_data Job")
    name = manifest["metadata"]["name"]
    log.info("prepare_data Job %s/%s: %s CPU(s), %d GiB, image %s", cfg.namespace, name,
             cfg.prepare_cpu, cfg.prepare_memory_gib, image)
    return name


def prepare_pods(api: Any, cfg: RunConfig, name: str) -> list[dict[str, Any]]:
    return list_pods(api, cfg.namespace, f"{JOB_NAME_LABEL}={name}")


def prepare_failure(api: Any, cfg: RunConfig, name: str, message: str) -> str:
    """Why the prepare_data Job failed, the first cause first: its container's own message
    (trainer.prepare_data writes the error there), else how the pod died (OOMKilled, evicted,
    an exit code, an image that cannot be pulled); then each pod's reason and log tail."""
    import kubernetes

    core = kubernetes.client.CoreV1Api(api)
    pods = sorted(prepare_pods(api, cfg, name),
                  key=lambda p: p["metadata"].get("creationTimestamp") or "")
    first = ""
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated") or {}
            if term.get("exitCode") and term.get("message") and term.get("reason") != "OOMKilled":
                first = term["message"].strip().splitlines()[-1]
                break
        if not first:
            death = pod_death(pod)
            first = death["message"] if death else ""
        if not first:
            first = pod_failure(pod) or ""
        if first:
            break
    parts = [f"prepare_data pod failed: {first or message or 'no pod of the Job was found'}",
             f"batch Job {cfg.namespace}/{name}: {message or 'failed'}"]
    for pod in pods:
        pod_name = pod["metadata"]["name"]
        phase = (pod.get("status") or {}).get("phase")
        parts.append(f"pod {pod_name}: {pod_failure(pod) or phase}")
        tail = log_tail(core, pod_name, cfg.namespace)
        if tail:
            parts.append(tail)
    return "\n".join(parts)


def delete_prepare_job(api: Any, cfg: RunConfig) -> list[str]:
    """Delete the run's prepare_data Job and its pod (found by the run's and the program's
    labels); what was deleted."""
    import kubernetes

    batch = kubernetes.client.BatchV1Api(api)
    try:
        jobs = batch.list_namespaced_job(
            cfg.namespace, label_selector=f"{run_selector(cfg)},{LABEL_PROGRAM}={PREPARE}").items
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:  # no batch API served: no Job was made
            return []
        raise
    deleted = []
    for found in jobs:
        if delete_batch_job(batch, cfg.namespace, found.metadata.name):
            deleted.append(f"job/{found.metadata.name}")
    # Background propagation leaves the pod to the garbage collector: delete it too, so nothing
    # of the run runs on after its teardown.
    core = kubernetes.client.CoreV1Api(api)
    for found in jobs:
        for pod in prepare_pods(api, cfg, found.metadata.name):
            try:
                core.delete_namespaced_pod(pod["metadata"]["name"], cfg.namespace)
                deleted.append(f"pod/{pod['metadata']['name']}")
            except kubernetes.client.ApiException as exc:
                if exc.status != 404:
                    raise
    return deleted


def prepared_record(api: Any, cfg: RunConfig, name: str, event: dict,
                    s3_client: Callable[[], Any]) -> dict:
    """The record the pod wrote (the prepared set's statistics), once its Job ended (`event`,
    BatchJobTrigger's); a Job that failed or ran out of time fails with why. The Job and its
    pod are deleted whatever happened (nothing of the stage runs on)."""
    try:
        if event["state"] != "Complete":
            message = event["message"] if event["state"] == "Failed" else (
                f"no result after PREPARE_DEADLINE_S = {PREPARE_DEADLINE_S} s: deleted it")
            raise StageFailed(prepare_failure(api, cfg, name, message))
        text = read_output(cfg.run_dir, PREPARE_DATA_FILE, s3_client)
        record = json.loads(text) if text else None
        if not record or record.get("run_id") != cfg.run_id:
            raise StageFailed(f"prepare_data Job {cfg.namespace}/{name} succeeded but "
                               f"{cfg.run_dir} has no {PREPARE_DATA_FILE} of this run")
    finally:
        delete_prepare_job(api, cfg)
    return record
