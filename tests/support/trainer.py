"""Kubeflow Trainer v2 in tests: the test plays the trainer and JobSet controllers for the run's
TrainJob on the emulated cluster (pods with JobSet's labels, rank 0's log, the TrainJob's
conditions), as `tests.support.eks.TrainingOperator` does for a PyTorchJob."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import kubernetes

from finetune.config import RunConfig
from finetune.targets.eks.manifests import (
    LABEL_COMPLETION_INDEX,
    LABEL_JOBSET_NAME,
    LABEL_REPLICATED_JOB,
    LABEL_RESTART_ATTEMPT,
    TRAINER_CONTAINER,
    TRAINER_GROUP,
    TRAINER_VERSION,
    TRAINJOB_PLURAL,
    run_selector,
    trainjob_manifest,
)
from tests.support.eks import EKS_PARAMS, IMAGE, NS, eks_config
from tests.support.kube import Cluster, pod_status

TRAINJOB_PARAMS = {**EKS_PARAMS, "launcher": "trainjob", "rdzv_backend": "c10d"}
RDZV_C10D = {"backend": "c10d", "rdzv_id": "x"}


def trainjob_config(**changes: Any) -> RunConfig:
    """An eks run config with launcher trainjob (validated as eks_config's, then changed)."""
    return dataclasses.replace(eks_config(), launcher="trainjob", rdzv_backend="c10d",
                               **changes)


def pod_name(job: str, rank: int) -> str:
    return f"{job}-node-0-{rank}-x{rank}z"


class TrainerController(threading.Thread):
    """Waits for the run's TrainJob, makes its pods (JobSet's labels), writes rank 0's log and
    moves the TrainJob to `outcome` (Complete or Failed); `oom_rank` is OOMKilled first;
    `unschedulable`: the scheduler's message, the pods stay Pending."""

    def __init__(self, cluster: Cluster, cfg: RunConfig, outcome: str = "Complete",
                 oom_rank: int | None = None, unschedulable: str | None = None):
        super().__init__(daemon=True)
        self.cluster, self.cfg, self.outcome = cluster, cfg, outcome
        self.oom_rank, self.unschedulable = oom_rank, unschedulable

    def run(self) -> None:
        core = kubernetes.client.CoreV1Api(self.cluster.api())
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            jobs = trainjobs_of_run(self.cluster, self.cfg)
            if jobs:
                break
            time.sleep(0.02)
        else:
            return
        name, nodes = jobs[0]["metadata"]["name"], jobs[0]["spec"]["trainer"]["numNodes"]
        for rank in range(nodes):
            core.create_namespaced_pod(NS, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod_name(name, rank), "namespace": NS, "labels": {
                    LABEL_JOBSET_NAME: name, LABEL_REPLICATED_JOB: "node",
                    LABEL_COMPLETION_INDEX: str(rank), LABEL_RESTART_ATTEMPT: "0"}},
                "spec": {"containers": [{"name": TRAINER_CONTAINER, "image": "img"}]},
                "status": pod_status(self.unschedulable)})
        if self.unschedulable:
            return
        set_trainjob_status(self.cluster, name, active=1)
        logs = self.cluster.emulator.pod_logs
        logs[NS, pod_name(name, 0)] = []
        for step in range(1, 4):
            logs[NS, pod_name(name, 0)].append(
                (f"2026-11-29T10:00:0{step}.000000000Z", f"step {step} loss {4 - step}.0"))
            time.sleep(0.15)
        if self.oom_rank is not None:
            pod = pod_name(name, self.oom_rank)
            logs[NS, pod] = [("2026-11-29T10:00:05.000000000Z", "allocating activations")]
            core.patch_namespaced_pod_status(pod, NS, {"status": {
                "phase": "Failed", "containerStatuses": [{
                    "name": TRAINER_CONTAINER, "ready": False, "restartCount": 0,
                    "image": "img", "imageID": "",
                    "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}})
        time.sleep(0.15)
        set_trainjob_status(self.cluster, name, self.outcome)


def set_trainjob_status(cluster: Cluster, name: str, condition: str | None = None,
                        active: int = 0) -> None:
    """The TrainJob's status as the trainer writes it: a condition (Complete, Failed,
    Suspended) and its child Jobs' counts."""
    status: dict[str, Any] = {"jobsStatus": [{"name": "node", "active": active, "ready": active,
                                              "failed": 0, "succeeded": 0, "suspended": 0}]}
    if condition:
        reason = {"Complete": "JobSetCompleted", "Failed": "JobSetFailed"}.get(condition,
                                                                               condition)
        status["conditions"] = [{
            "type": condition, "status": "True", "reason": reason,
            "message": f"TrainJob {name} is {condition}",
            "lastTransitionTime": "2026-11-29T10:00:09Z"}]
    kubernetes.client.CustomObjectsApi(cluster.api()).patch_namespaced_custom_object_status(
        TRAINER_GROUP, TRAINER_VERSION, NS, TRAINJOB_PLURAL, name, {"status": status})


def trainjobs_of_run(cluster: Cluster, cfg: RunConfig) -> list[dict]:
    return kubernetes.client.CustomObjectsApi(cluster.api()).list_namespaced_custom_object(
        TRAINER_GROUP, TRAINER_VERSION, NS, TRAINJOB_PLURAL,
        label_selector=run_selector(cfg))["items"]


def create_trainjob(cluster: Cluster, cfg: RunConfig) -> str:
    manifest = trainjob_manifest(cfg, IMAGE["image"])
    kubernetes.client.CustomObjectsApi(cluster.api()).create_namespaced_custom_object(
        TRAINER_GROUP, TRAINER_VERSION, NS, TRAINJOB_PLURAL, manifest)
    return manifest["metadata"]["name"]
