"""Deferrable waits of the eks target: they only wait (no decisions), run in the triggerer and
serialise to plain kwargs.

- `NodegroupActiveTrigger`: the EKS node group is ACTIVE again after a scaling update;
- `NodesReadyTrigger`: N nodes of the node group are Ready with the GPUs (and EFA) a worker asks;
- `PyTorchJobTrigger`: the PyTorchJob reached Succeeded or Failed, or `wake_after` passed (the
  task then streams the leader's new log lines and defers again);
- `ImageBuildTrigger`: the trainer image's build (BuildKit Job or CodeBuild) ended.

Kubernetes calls use kubernetes_asyncio; the client is re-opened every `refresh_interval`
seconds so waits of hours outlive an EKS token (valid about 14 minutes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from finetune.kube import TOKEN_REFRESH_S, async_kube_api_client, aws_session
from finetune.manifests import (
    NODEGROUP_LABEL,
    PYTORCHJOB_GROUP,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
)
from finetune.pytorchjob import TERMINAL, job_state

# Node group states from which it does not become ACTIVE by itself.
NODEGROUP_FAILED = ("CREATE_FAILED", "DELETE_FAILED", "DEGRADED", "DELETING")


class KubeClient:
    """A kubernetes_asyncio client that is re-opened (fresh token) every `refresh_interval`."""

    def __init__(self, credentials: dict[str, str], refresh_interval: float):
        self.credentials, self.refresh_interval = credentials, refresh_interval
        self._context: Any = None
        self._opened = 0.0

    async def get(self) -> Any:
        if self._context is None or time.monotonic() - self._opened > self.refresh_interval:
            await self.close()
            self._context = async_kube_api_client(**self.credentials)
            self._api = await self._context.__aenter__()
            self._opened = time.monotonic()
        return self._api

    async def close(self) -> None:
        if self._context is not None:
            context, self._context = self._context, None
            await context.__aexit__(None, None, None)


class NodegroupActiveTrigger(BaseTrigger):
    def __init__(self, *, cluster_name: str, nodegroup: str, aws_conn_id: str = "",
                 poll_interval: float = 15.0, timeout: float = 1800.0):
        super().__init__()
        self.cluster_name, self.nodegroup, self.aws_conn_id = cluster_name, nodegroup, aws_conn_id
        self.poll_interval, self.timeout = poll_interval, timeout

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.NodegroupActiveTrigger", {
            "cluster_name": self.cluster_name, "nodegroup": self.nodegroup,
            "aws_conn_id": self.aws_conn_id, "poll_interval": self.poll_interval,
            "timeout": self.timeout}

    def _describe(self) -> dict[str, Any]:
        eks = aws_session(self.aws_conn_id).client("eks")
        return eks.describe_nodegroup(clusterName=self.cluster_name,
                                      nodegroupName=self.nodegroup)["nodegroup"]

    async def run(self) -> AsyncIterator[TriggerEvent]:
        deadline = time.monotonic() + self.timeout
        while True:
            # boto3 blocks: off the triggerer's event loop.
            ng = await asyncio.to_thread(self._describe)
            status = ng.get("status")
            if status == "ACTIVE":
                yield TriggerEvent({"status": "success", "nodegroup_status": status})
                return
            if status in NODEGROUP_FAILED or time.monotonic() > deadline:
                issues = "; ".join(f"{i.get('code')}: {i.get('message')}"
                                   for i in (ng.get("health") or {}).get("issues") or [])
                message = (f"node group {self.nodegroup} is {status}" if status in
                           NODEGROUP_FAILED else f"node group {self.nodegroup} still {status} "
                           f"after {self.timeout:.0f}s")
                yield TriggerEvent({"status": "error",
                                    "message": message + (f": {issues}" if issues else "")})
                return
            await asyncio.sleep(self.poll_interval)


class NodesReadyTrigger(BaseTrigger):
    def __init__(self, *, credentials: dict[str, str], nodegroup: str, nodes: int, gpus: int,
                 efa: int = 0, poll_interval: float = 15.0, timeout: float = 1800.0,
                 refresh_interval: float = TOKEN_REFRESH_S):
        super().__init__()
        self.credentials, self.nodegroup, self.nodes = credentials, nodegroup, nodes
        self.gpus, self.efa, self.poll_interval = gpus, efa, poll_interval
        self.timeout, self.refresh_interval = timeout, refresh_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.NodesReadyTrigger", {
            "credentials": self.credentials, "nodegroup": self.nodegroup, "nodes": self.nodes,
            "gpus": self.gpus, "efa": self.efa, "poll_interval": self.poll_interval,
            "timeout": self.timeout, "refresh_interval": self.refresh_interval}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from kubernetes_asyncio import client

        from finetune.targets.eks import usable_nodes

        kube = KubeClient(self.credentials, self.refresh_interval)
        deadline = time.monotonic() + self.timeout
        try:
            while True:
                api = await kube.get()
                listed = await client.CoreV1Api(api).list_node(
                    label_selector=f"{NODEGROUP_LABEL}={self.nodegroup}")
                nodes = api.sanitize_for_serialization(listed)["items"]
                usable, summary = usable_nodes(nodes, self.gpus, self.efa)
                if len(usable) >= self.nodes:
                    yield TriggerEvent({"status": "success", "nodes": usable})
                    return
                if time.monotonic() > deadline:
                    yield TriggerEvent({"status": "timeout", "nodes": usable,
                                        "summary": summary})
                    return
                await asyncio.sleep(self.poll_interval)
        finally:
            await kube.close()


class PyTorchJobTrigger(BaseTrigger):
    def __init__(self, *, credentials: dict[str, str], namespace: str, name: str,
                 poll_interval: float = 15.0, wake_after: float = 60.0,
                 refresh_interval: float = TOKEN_REFRESH_S):
        super().__init__()
        self.credentials, self.namespace, self.name = credentials, namespace, name
        self.poll_interval, self.wake_after = poll_interval, wake_after
        self.refresh_interval = refresh_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.PyTorchJobTrigger", {
            "credentials": self.credentials, "namespace": self.namespace, "name": self.name,
            "poll_interval": self.poll_interval, "wake_after": self.wake_after,
            "refresh_interval": self.refresh_interval}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from kubernetes_asyncio import client

        kube = KubeClient(self.credentials, self.refresh_interval)
        wake = time.monotonic() + self.wake_after
        try:
            while True:
                api = await kube.get()
                job = await client.CustomObjectsApi(api).get_namespaced_custom_object(
                    PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, self.namespace, PYTORCHJOB_PLURAL,
                    self.name)
                state, message = job_state(job)
                if state in TERMINAL:
                    yield TriggerEvent({"status": state.lower(), "state": state,
                                        "message": message})
                    return
                if time.monotonic() >= wake:  # back to the task: it streams the log
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

        async with async_kube_api_client(**self.credentials) as api:
            try:
                await client.CustomObjectsApi(api).delete_namespaced_custom_object(
                    PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, self.namespace, PYTORCHJOB_PLURAL,
                    self.name, body=client.V1DeleteOptions(propagation_policy="Foreground"))
            except ApiException as exc:
                if exc.status != 404:
                    raise


class ImageBuildTrigger(BaseTrigger):
    """The image build started by `image_build.start_image` ended, or `timeout` passed.

    `pending` is what start_image returned: a BuildKit Job (read with kubernetes_asyncio, the
    token re-minted as for the other waits) or a CodeBuild build (boto3, off the event loop).
    The event's state is Complete, Failed, or Running when the wait passed the build's deadline
    (wall-clock, so a triggerer restart does not extend it).
    """

    def __init__(self, *, pending: dict[str, Any], credentials: dict[str, str] | None = None,
                 aws_conn_id: str = "", poll_interval: float = 15.0,
                 refresh_interval: float = TOKEN_REFRESH_S):
        super().__init__()
        self.pending, self.credentials, self.aws_conn_id = pending, credentials, aws_conn_id
        self.poll_interval, self.refresh_interval = poll_interval, refresh_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}.ImageBuildTrigger", {
            "pending": self.pending, "credentials": self.credentials,
            "aws_conn_id": self.aws_conn_id, "poll_interval": self.poll_interval,
            "refresh_interval": self.refresh_interval}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from finetune.image_build import codebuild_state, job_state

        kube = KubeClient(self.credentials or {}, self.refresh_interval)
        codebuild = None
        try:
            while True:
                if self.pending["builder"] == "buildkit":
                    from kubernetes_asyncio import client

                    api = await kube.get()
                    job = await client.BatchV1Api(api).read_namespaced_job(
                        self.pending["job"], self.pending["namespace"])
                    state, message = job_state(api.sanitize_for_serialization(job))
                else:
                    if codebuild is None:
                        codebuild = await asyncio.to_thread(
                            lambda: aws_session(self.aws_conn_id).client("codebuild"))
                    state, message = await asyncio.to_thread(
                        codebuild_state, codebuild, self.pending["build_id"])
                if state != "Running" or time.time() > self.pending["deadline"]:
                    yield TriggerEvent({"state": state, "message": message})
                    return
                await asyncio.sleep(self.poll_interval)
        finally:
            await kube.close()
