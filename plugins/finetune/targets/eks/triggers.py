"""The eks target's deferrable waits: they only wait (no decisions), run in the triggerer and
serialise to plain kwargs.

- `NodegroupActiveTrigger`: the EKS node group is ACTIVE again after a scaling update;
- `NodesReadyTrigger`: N nodes of the node group are Ready with the GPUs (and EFA) a worker asks;
- `JobTrigger` (alias `PyTorchJobTrigger`): the run's job (a PyTorchJob or a TrainJob, named by
  its launcher) reached Succeeded or Failed, or its deadline passed (where the task enforces
  it), or its wake-up time came (the task then streams the leader's new log lines and defers
  again);
- `ImageBuildTrigger`: the trainer image's build (BuildKit Job or CodeBuild) ended;
- `BatchJobTrigger`: a batch/v1 Job of the run (the prepare_data pod's) completed or failed,
  or its deadline passed.

Every deadline (and the job's wake-up time) is wall-clock epoch seconds in the kwargs, computed
once when the task defers: a triggerer restart rebuilds the trigger from them and does not
extend it. Transient API errors are retried (`clients.retry_transient`). Kubernetes calls use
kubernetes_asyncio; the client is re-opened every `refresh_interval` seconds so waits of hours
outlive an EKS token (valid about 14 minutes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from finetune.targets.eks.clients import (
    TOKEN_REFRESH_S,
    KubeClient,
    async_kube_api_client,
    aws_session,
    retry_transient,
)
from finetune.targets.eks.image_build import build_job_state, codebuild_state
from finetune.targets.eks.launchers import LAUNCHERS, TERMINAL
from finetune.targets.eks.manifests import NODEGROUP_LABEL
from finetune.targets.eks.nodegroup import missing_devices, usable_nodes

# Node group states from which it does not become ACTIVE by itself.
NODEGROUP_FAILED = ("CREATE_FAILED", "DELETE_FAILED", "DEGRADED", "DELETING")


def _passed(deadline: float) -> bool:
    return time.time() > deadline


class NodegroupActiveTrigger(BaseTrigger):
    def __init__(self, *, cluster_name: str, nodegroup: str, deadline: float,
                 aws_conn_id: str = "", poll_interval: float = 15.0):
        super().__init__()
        self.cluster_name, self.nodegroup, self.aws_conn_id = cluster_name, nodegroup, aws_conn_id
        self.deadline, self.poll_interval = deadline, poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.NodegroupActiveTrigger", {
            "cluster_name": self.cluster_name, "nodegroup": self.nodegroup,
            "deadline": self.deadline, "aws_conn_id": self.aws_conn_id,
            "poll_interval": self.poll_interval}

    @retry_transient
    def _describe(self) -> dict[str, Any]:
        eks = aws_session(self.aws_conn_id).client("eks")
        return eks.describe_nodegroup(clusterName=self.cluster_name,
                                      nodegroupName=self.nodegroup)["nodegroup"]

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            # boto3 blocks: off the triggerer's event loop.
            ng = await asyncio.to_thread(self._describe)
            status = ng.get("status")
            if status == "ACTIVE":
                yield TriggerEvent({"status": "success", "nodegroup_status": status})
                return
            if status in NODEGROUP_FAILED or _passed(self.deadline):
                issues = "; ".join(f"{i.get('code')}: {i.get('message')}"
                                   for i in (ng.get("health") or {}).get("issues") or [])
                message = (f"node group {self.nodegroup} is {status}" if status in
                           NODEGROUP_FAILED else f"node group {self.nodegroup} still {status} "
                           "at its deadline")
                yield TriggerEvent({"status": "error",
                                    "message": message + (f": {issues}" if issues else "")})
                return
            await asyncio.sleep(self.poll_interval)


class NodesReadyTrigger(BaseTrigger):
    def __init__(self, *, credentials: dict[str, str], nodegroup: str, nodes: int, gpus: int,
                 deadline: float, efa: int = 0, instance_type: str = "",
                 devices_grace_s: float = 300.0, poll_interval: float = 15.0,
                 refresh_interval: float = TOKEN_REFRESH_S):
        super().__init__()
        self.credentials, self.nodegroup, self.nodes = credentials, nodegroup, nodes
        self.gpus, self.efa, self.instance_type = gpus, efa, instance_type
        self.devices_grace_s = devices_grace_s
        self.deadline, self.poll_interval = deadline, poll_interval
        self.refresh_interval = refresh_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.NodesReadyTrigger", {
            "credentials": self.credentials, "nodegroup": self.nodegroup, "nodes": self.nodes,
            "gpus": self.gpus, "deadline": self.deadline, "efa": self.efa,
            "instance_type": self.instance_type, "devices_grace_s": self.devices_grace_s,
            "poll_interval": self.poll_interval,
            "refresh_interval": self.refresh_interval}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from kubernetes_asyncio import client

        kube = KubeClient(self.credentials, self.refresh_interval)

        @retry_transient
        async def list_nodes() -> list[dict[str, Any]]:
            api = await kube.get()
            listed = await client.CoreV1Api(api).list_node(
                label_selector=f"{NODEGROUP_LABEL}={self.nodegroup}")
            return api.sanitize_for_serialization(listed)["items"]

        try:
            while True:
                nodes = await list_nodes()
                usable, summary = usable_nodes(nodes, self.gpus, self.efa, self.instance_type)
                if len(usable) >= self.nodes:
                    yield TriggerEvent({"status": "success", "nodes": usable})
                    return
                missing = missing_devices(nodes, self.gpus, self.efa, self.instance_type,
                                          self.devices_grace_s, time.time())
                if missing:  # waiting on would only wait out the deadline
                    yield TriggerEvent({"status": "devices", "nodes": usable,
                                        "message": missing})
                    return
                if _passed(self.deadline):
                    yield TriggerEvent({"status": "timeout", "nodes": usable,
                                        "summary": summary})
                    return
                await asyncio.sleep(self.poll_interval)
        finally:
            await kube.close()


class JobTrigger(BaseTrigger):
    """`launcher`: pytorchjob or trainjob (launchers.LAUNCHERS); `deadline`: epoch seconds after
    which the event says so (0: none, the job ends itself at its activeDeadlineSeconds)."""

    def __init__(self, *, credentials: dict[str, str], namespace: str, name: str,
                 wake_at: float, poll_interval: float = 15.0,
                 refresh_interval: float = TOKEN_REFRESH_S, launcher: str = "pytorchjob",
                 deadline: float = 0.0):
        super().__init__()
        self.credentials, self.namespace, self.name = credentials, namespace, name
        self.wake_at, self.poll_interval = wake_at, poll_interval
        self.refresh_interval = refresh_interval
        self.launcher, self.deadline = launcher, deadline

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.JobTrigger", {
            "credentials": self.credentials, "namespace": self.namespace, "name": self.name,
            "wake_at": self.wake_at, "poll_interval": self.poll_interval,
            "refresh_interval": self.refresh_interval, "launcher": self.launcher,
            "deadline": self.deadline}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from kubernetes_asyncio import client

        kube = KubeClient(self.credentials, self.refresh_interval)
        launcher = LAUNCHERS[self.launcher]

        @retry_transient
        async def read_job() -> dict[str, Any]:
            api = await kube.get()
            return await client.CustomObjectsApi(api).get_namespaced_custom_object(
                launcher.group, launcher.version, self.namespace, launcher.plural, self.name)

        try:
            while True:
                state, message = launcher.state(await read_job())
                if state in TERMINAL:
                    yield TriggerEvent({"status": state.lower(), "state": state,
                                        "message": message})
                    return
                if self.deadline and _passed(self.deadline):  # the task stops the job
                    yield TriggerEvent({"status": "deadline", "state": state,
                                        "message": message})
                    return
                if time.time() >= self.wake_at:  # back to the task: it streams the log
                    yield TriggerEvent({"status": "running", "state": state,
                                        "message": message})
                    return
                await asyncio.sleep(self.poll_interval)
        finally:
            await kube.close()

    async def on_kill(self) -> None:
        """The task was marked failed (or cleared) while deferred: stop the training."""
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        launcher = LAUNCHERS[self.launcher]
        async with async_kube_api_client(**self.credentials) as api:
            try:
                await client.CustomObjectsApi(api).delete_namespaced_custom_object(
                    launcher.group, launcher.version, self.namespace, launcher.plural,
                    self.name, body=client.V1DeleteOptions(propagation_policy="Foreground"))
            except ApiException as exc:
                if exc.status != 404:
                    raise


# The name earlier versions serialised (a trigger row stored then still loads).
PyTorchJobTrigger = JobTrigger


@retry_transient
async def read_batch_job(kube: KubeClient, namespace: str, name: str) -> tuple[str, str]:
    """(Complete | Failed | Running, message) of a batch/v1 Job (image_build.build_job_state)."""
    from kubernetes_asyncio import client

    api = await kube.get()
    job = await client.BatchV1Api(api).read_namespaced_job(name, namespace)
    return build_job_state(api.sanitize_for_serialization(job))


class ImageBuildTrigger(BaseTrigger):
    """The image build started by `image_build.start_image` ended, or its deadline passed.

    `pending` is what start_image returned: a BuildKit Job (read with kubernetes_asyncio, the
    token re-minted as for the other waits) or a CodeBuild build (boto3, off the event loop).
    The event's state is Complete, Failed, or Running when the wait passed the deadline.
    """

    def __init__(self, *, pending: dict[str, Any], deadline: float,
                 credentials: dict[str, str] | None = None, aws_conn_id: str = "",
                 poll_interval: float = 15.0, refresh_interval: float = TOKEN_REFRESH_S):
        super().__init__()
        self.pending, self.credentials, self.aws_conn_id = pending, credentials, aws_conn_id
        self.deadline, self.poll_interval = deadline, poll_interval
        self.refresh_interval = refresh_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.ImageBuildTrigger", {
            "pending": self.pending, "deadline": self.deadline,
            "credentials": self.credentials, "aws_conn_id": self.aws_conn_id,
            "poll_interval": self.poll_interval, "refresh_interval": self.refresh_interval}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        kube = KubeClient(self.credentials or {}, self.refresh_interval)
        codebuild = None

        async def read_build_job() -> tuple[str, str]:
            return await read_batch_job(kube, self.pending["namespace"], self.pending["job"])

        read_codebuild = retry_transient(codebuild_state)
        try:
            while True:
                if self.pending["builder"] == "buildkit":
                    state, message = await read_build_job()
                else:
                    if codebuild is None:
                        codebuild = await asyncio.to_thread(
                            lambda: aws_session(self.aws_conn_id).client("codebuild"))
                    state, message = await asyncio.to_thread(
                        read_codebuild, codebuild, self.pending["build_id"])
                if state != "Running" or _passed(self.deadline):
                    yield TriggerEvent({"state": state, "message": message})
                    return
                await asyncio.sleep(self.poll_interval)
        finally:
            await kube.close()


class BatchJobTrigger(BaseTrigger):
    """A batch/v1 Job (the prepare_data pod's) Complete or Failed, or `deadline` (epoch seconds)
    passed: the event's state is Complete, Failed, or Running at the deadline. A mark-failed
    while deferred deletes the Job (and its pod)."""

    def __init__(self, *, credentials: dict[str, str], namespace: str, name: str,
                 deadline: float, poll_interval: float = 15.0,
                 refresh_interval: float = TOKEN_REFRESH_S):
        super().__init__()
        self.credentials, self.namespace, self.name = credentials, namespace, name
        self.deadline, self.poll_interval = deadline, poll_interval
        self.refresh_interval = refresh_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.BatchJobTrigger", {
            "credentials": self.credentials, "namespace": self.namespace, "name": self.name,
            "deadline": self.deadline, "poll_interval": self.poll_interval,
            "refresh_interval": self.refresh_interval}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        kube = KubeClient(self.credentials, self.refresh_interval)
        try:
            while True:
                state, message = await read_batch_job(kube, self.namespace, self.name)
                if state != "Running" or _passed(self.deadline):
                    yield TriggerEvent({"state": state, "message": message})
                    return
                await asyncio.sleep(self.poll_interval)
        finally:
            await kube.close()

    async def on_kill(self) -> None:
        """The task was marked failed (or cleared) while deferred: stop the pod."""
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        async with async_kube_api_client(**self.credentials) as api:
            try:
                await client.BatchV1Api(api).delete_namespaced_job(
                    self.name, self.namespace, propagation_policy="Background")
            except ApiException as exc:
                if exc.status != 404:
                    raise
