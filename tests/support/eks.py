"""The eks target in tests: a validated eks run config, the target with short timeouts, the
node group in moto, and the test playing the training operator on the emulated cluster."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import boto3
import kubernetes
import pytest

from finetune.config import RunConfig
from finetune.operators import StageOperator
from finetune.targets.eks.manifests import (
    LABEL_JOB_NAME,
    LABEL_REPLICA_INDEX,
    LABEL_REPLICA_TYPE,
    PYTORCHJOB_GROUP,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
    pytorchjob_manifest,
    run_selector,
)
from finetune.targets.eks.target import EksTarget
from finetune.validate import validate_params
from tests.support.deferral import run_deferred
from tests.support.kube import Cluster, pod_status

EKS_PARAMS = {
    "target": "eks", "cluster_name": "train", "nodegroup": "gpu-p4de",
    "instance_type": "p4de.24xlarge", "namespace": "ml", "image": "1234.dkr.ecr/ft:abc",
    "procs_per_node": 8, "micro_batch": 1, "output_dir": "s3://bucket/runs",
    "hf_token_secret": "hf:token",
}


def eks_config(run_id: str = "manual__2026-11-29T10:00:00+00:00", **changes: Any) -> RunConfig:
    """A validated eks run config; `changes` bypass validation (for sizes the demo data lacks)."""
    return dataclasses.replace(validated_eks_params(run_id), **changes)


@functools.lru_cache(maxsize=1024)
def validated_eks_params(run_id: str) -> RunConfig:
    """EKS_PARAMS through validate, once per run id: validate tokenizes the demo data set (about
    0.3 s a call), and the manifest tests build thousands of configs (RunConfig is frozen)."""
    return validate_params(EKS_PARAMS, run_id=run_id)


NS = "ml"
SCALING = {"minSize": 0, "maxSize": 2, "desiredSize": 0}


def scaling(eks: Any) -> dict[str, int]:
    return eks.describe_nodegroup(clusterName="train",
                                  nodegroupName="gpu-p4de")["nodegroup"]["scalingConfig"]


# The eks target's pace in tests: fast polls, short limits.
FAST = {"poll_interval": 0.05, "nodes_timeout": 3.0, "etcd_timeout": 3.0, "update_retries": 3,
        "wake_after": 0.2}


def target() -> EksTarget:
    return EksTarget(**FAST)


class TrainingOperator(threading.Thread):
    """Plays the training operator: waits for the run's PyTorchJob, makes its pods, writes the
    leader's log and moves the job to `outcome`.

    `preemptions`: rounds in which every worker saved its step after a notice and exited 138,
    the job Restarting for `hold_s`, then its pods made again and Running (restartPolicy
    ExitCode); `on_preempted(n)` is called first in round n (the trainer's history record).
    `lost_workers`: the last workers' nodes are gone, their pods Pending, unschedulable.
    `release`: the job stays Running, its log written, until the test sets it (a test that
    needs the task to find it running, whatever the machine's speed)."""

    def __init__(self, cluster: Cluster, cfg: RunConfig, outcome: str = "Succeeded",
                 oom_worker: int | None = None, unschedulable: str | None = None,
                 preemptions: int = 0, on_preempted: Callable[[int], None] | None = None,
                 lost_workers: int = 0, hold_s: float = 0.5,
                 release: threading.Event | None = None):
        super().__init__(daemon=True)
        self.cluster, self.cfg, self.outcome, self.oom_worker = cluster, cfg, outcome, oom_worker
        # The scheduler's message for pods it cannot place (they stay Pending, the job Created).
        self.unschedulable = unschedulable
        self.preemptions, self.on_preempted = preemptions, on_preempted
        self.lost_workers, self.hold_s, self.release = lost_workers, hold_s, release
        self.created: list[str] = []

    def run(self) -> None:
        api = self.cluster.api()
        custom, core = kubernetes.client.CustomObjectsApi(api), kubernetes.client.CoreV1Api(api)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            jobs = custom.list_namespaced_custom_object(
                PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, NS, PYTORCHJOB_PLURAL,
                label_selector=run_selector(self.cfg))["items"]
            if jobs:
                break
            time.sleep(0.02)
        else:
            return
        name = jobs[0]["metadata"]["name"]
        workers = jobs[0]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]
        self._make_pods(core, name, workers)
        if self.unschedulable:
            self._set(custom, name, "Created")
            return
        self._set(custom, name, "Running")
        logs = self.cluster.emulator.pod_logs
        logs[NS, f"{name}-worker-0"] = []
        for step in range(1, 4):
            logs[NS, f"{name}-worker-0"].append(
                (f"2026-11-29T10:00:0{step}.000000000Z", f"step {step} loss {4 - step}.0"))
            time.sleep(0.15)
        for round_ in range(1, self.preemptions + 1):
            if self.on_preempted:
                self.on_preempted(round_)
            for i in range(workers):
                core.patch_namespaced_pod_status(f"{name}-worker-{i}", NS, {"status": {
                    "phase": "Failed", "containerStatuses": [{
                        "name": "pytorch", "ready": False, "restartCount": 0, "image": "img",
                        "imageID": "", "state": {"terminated": {
                            "exitCode": 138, "reason": "Error",
                            "finishedAt": f"2026-11-29T10:0{round_}:00Z"}}}]}})
            self._set(custom, name, "Restarting", since=f"2026-11-29T10:0{round_}:00Z")
            time.sleep(self.hold_s)
            for i in range(workers):  # ExitCode: the operator deletes them and makes new ones
                core.delete_namespaced_pod(f"{name}-worker-{i}", NS)
            self._make_pods(core, name, workers)
            self._set(custom, name, "Running")
            time.sleep(self.hold_s)
        if self.oom_worker is not None:
            pod = f"{name}-worker-{self.oom_worker}"
            logs[NS, pod] = [("2026-11-29T10:00:05.000000000Z", "allocating activations")]
            core.patch_namespaced_pod_status(pod, NS, {"status": {
                "phase": "Failed", "containerStatuses": [{
                    "name": "pytorch", "ready": False, "restartCount": 0, "image": "img",
                    "imageID": "", "state": {"terminated": {"exitCode": 137,
                                                            "reason": "OOMKilled"}}}]}})
        time.sleep(0.15)
        if self.release is not None:
            self.release.wait(60)
        self._set(custom, name, self.outcome)

    def _make_pods(self, core: Any, name: str, workers: int) -> None:
        for i in range(workers):
            pod = f"{name}-worker-{i}"
            lost = i >= workers - self.lost_workers
            placed = not self.unschedulable and not lost
            core.create_namespaced_pod(NS, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod, "namespace": NS, "labels": {
                    LABEL_JOB_NAME: name, LABEL_REPLICA_TYPE: "worker",
                    LABEL_REPLICA_INDEX: str(i)}},
                # worker i on node ip-10-0-0-i (tests.support.kube.add_nodes) once placed
                "spec": {"containers": [{"name": "pytorch", "image": "img"}],
                         **({"nodeName": f"ip-10-0-0-{i}"} if placed else {})},
                "status": pod_status(self.unschedulable or (
                    "0/2 nodes are available: 2 Insufficient nvidia.com/gpu" if lost else None))})
            self.created.append(pod)

    def _set(self, custom: Any, name: str, condition: str, since: str = "") -> None:
        custom.patch_namespaced_custom_object_status(
            PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, NS, PYTORCHJOB_PLURAL, name,
            {"status": {"conditions": [{"type": condition, "status": "True",
                                        "message": f"PyTorchJob {name} is {condition}",
                                        **({"lastTransitionTime": since} if since else {})}]}})


def jobs_of_run(cluster: Cluster, cfg: RunConfig) -> list[dict]:
    custom = kubernetes.client.CustomObjectsApi(cluster.api())
    return custom.list_namespaced_custom_object(
        PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, NS, PYTORCHJOB_PLURAL,
        label_selector=run_selector(cfg))["items"]


IMAGE = {"image": "1234.dkr.ecr/ft:abc", "image_tag": "abc"}
RDZV = {"backend": "etcd-v2", "rdzv_id": "x"}


def stage_operator(stage: str, cfg: RunConfig, options: dict[str, Any] | None = None,
                   **inputs: Any) -> StageOperator:
    """The DAG's task for a long stage of the eks target, at the tests' pace."""
    return StageOperator(task_id=stage, stage=stage, run_config=cfg.to_dict(), inputs=inputs,
                         target_options={**FAST, **(options or {})})


def run_stage(stage: str, cfg: RunConfig, **inputs: Any) -> dict:
    """A long stage run as the DAG runs it: its task to the end, every trigger inline."""
    return run_deferred(stage_operator(stage, cfg, **inputs))[0]


def train_operator(cfg: Any) -> StageOperator:
    return stage_operator("train", cfg, image=IMAGE, rendezvous=RDZV)


def train_beside(cluster: Any, cfg: Any, **operator: Any) -> Any:
    """The train stage run to its end (run_deferred's result) while a TrainingOperator with
    `operator`'s settings plays the cluster's side."""
    from tests.support.deferral import run_deferred

    played = TrainingOperator(cluster, cfg, **operator)
    played.start()
    try:
        return run_deferred(train_operator(cfg))
    finally:
        played.join(5)


def set_condition(cluster: Any, name: str, condition: str) -> None:
    kubernetes.client.CustomObjectsApi(cluster.api()).patch_namespaced_custom_object_status(
        PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, NS, PYTORCHJOB_PLURAL, name,
        {"status": {"conditions": [{"type": condition, "status": "True",
                                    "message": f"PyTorchJob {name} is {condition}"}]}})


def create_job(cluster: Any, cfg: Any) -> str:
    manifest = pytorchjob_manifest(cfg, IMAGE["image"])
    kubernetes.client.CustomObjectsApi(cluster.api()).create_namespaced_custom_object(
        PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, NS, PYTORCHJOB_PLURAL, manifest)
    return manifest["metadata"]["name"]


@pytest.fixture
def nodegroup(aws: str) -> Any:
    """The cluster and its GPU node group in moto (scaled to zero)."""
    eks = boto3.client("eks")
    eks.create_cluster(name="train", roleArn="arn:aws:iam::123456789012:role/eks",
                       resourcesVpcConfig={"subnetIds": ["subnet-1"]})
    eks.create_nodegroup(clusterName="train", nodegroupName="gpu-p4de",
                         nodeRole="arn:aws:iam::123456789012:role/node", subnets=["subnet-1"],
                         scalingConfig=SCALING, instanceTypes=["p4de.24xlarge"])
    return eks


@pytest.fixture
def task_log() -> Any:
    """What the eks target writes to the task log (Airflow's logging does not reach caplog)."""
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("finetune")
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def the_nodegroups_asg(nodegroup: Any, instances: int) -> tuple[Any, str, list[str]]:
    """moto names the node group's Auto Scaling group but does not create it: create it."""
    asg_name = nodegroup.describe_nodegroup(clusterName="train", nodegroupName="gpu-p4de")[
        "nodegroup"]["resources"]["autoScalingGroups"][0]["name"]
    ec2, autoscaling = boto3.client("ec2"), boto3.client("autoscaling")
    vpc = ec2.create_vpc(CidrBlock="10.0.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.0.0.0/24")["Subnet"]["SubnetId"]
    template = ec2.create_launch_template(LaunchTemplateName="gpu", LaunchTemplateData={
        "ImageId": "ami-12c6146b", "InstanceType": "p4de.24xlarge"})["LaunchTemplate"]
    autoscaling.create_auto_scaling_group(
        AutoScalingGroupName=asg_name, MinSize=0, MaxSize=8, DesiredCapacity=instances,
        LaunchTemplate={"LaunchTemplateId": template["LaunchTemplateId"]},
        VPCZoneIdentifier=subnet)
    ids = [i["InstanceId"] for i in autoscaling.describe_auto_scaling_groups(
        AutoScalingGroupNames=[asg_name])["AutoScalingGroups"][0]["Instances"]]
    return autoscaling, asg_name, sorted(ids)
