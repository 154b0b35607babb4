"""The eks target's deferrable waits: they only wait (no decisions), run in the triggerer and
serialise to plain kwargs.

`PollingTrigger` owns the loop every wait shares: look (`poll`), fire the event the look calls
for (`done`), else fire the deadline's event once the deadline has passed (`timed_out`), else
sleep `poll_interval` and look again. Each trigger below says what it looks at and when it is
done:

- `NodegroupActiveTrigger`: the EKS node group is ACTIVE again after a scaling update;
- `NodesReadyTrigger`: N nodes of the node group are Ready with the GPUs (and EFA) a worker asks;
- `JobTrigger` (alias `PyTorchJobTrigger`): the run's job (a PyTorchJob or a TrainJob, named by
  its launcher) reached Succeeded or Failed, or its deadline passed (where the task enforces
  it), or its wake-up time came (the task then streams the leader's new log lines and defers
  again);
- `ImageBuildTrigger`: the trainer image's build (BuildKit Job or CodeBuild) ended;
- `BatchJobTrigger`: a batch/v1 Job of the run (the prepare_data pod's) completed or failed,
  or its deadline passed.

A wait of a run that holds nodes carries its `reservation` (reservations.Renewal) and renews
it at its first look and every quarter of its ttl after (the loop every wait shares): a wait of
hours (capacity_wait_s, a build, a node replaced) never lets it expire, while a run whose task
is gone stops renewing it.

Every deadline (and the job's wake-up time) is wall-clock epoch seconds in the kwargs, computed
once when the task defers: a triggerer restart rebuilds the trigger from them and does not
extend it. A trigger serialises every argument of its `__init__`, read back from the attribute
of the same name. Transient API errors are retried (`clients.retry_transient`). Kubernetes calls
use kubernetes_asyncio; the client is re-opened every `refresh_interval` seconds so waits of
hours outlive an EKS token (valid about 14 minutes).
"""

from __future__ import annotations

import asyncio
import inspect
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
from finetune.targets.eks.reservations import Renewal, renew_reservation, renewal_interval

# Node group states from which it does not become ACTIVE by itself.
NODEGROUP_FAILED = ("CREATE_FAILED", "DELETE_FAILED", "DEGRADED", "DELETING")


class PollingTrigger(BaseTrigger):
    """Look, fire or sleep, until an event: the loop of every wait here.

    A subclass sets `deadline` (epoch seconds; 0: none) and `poll_interval`, and says what it
    looks at (`poll`), the event that look calls for or None to look again (`done`), and the
    event once the deadline has passed (`timed_out`). A wait that reads the cluster sets
    `credentials` and `refresh_interval` and reads through `kube()`. Every subclass takes
    `reservation`: the run's node reservation to keep live while it waits (None: none held).
    """

    deadline: float = 0.0
    poll_interval: float = 15.0
    credentials: dict[str, str] | None = None
    refresh_interval: float = TOKEN_REFRESH_S
    reservation: Renewal | None = None

    def __init__(self) -> None:
        super().__init__()
        self._kube: KubeClient | None = None

    def serialize(self) -> tuple[str, dict[str, Any]]:
        arguments = inspect.signature(type(self).__init__).parameters
        return f"{type(self).__module__}.{type(self).__qualname__}", {
            name: getattr(self, name) for name in arguments if name != "self"}

    async def poll(self) -> Any:
        """One look at what the trigger waits for."""
        raise NotImplementedError

    def done(self, seen: Any) -> dict[str, Any] | None:
        """The event `seen` calls for; None to look again."""
        raise NotImplementedError

    def timed_out(self, seen: Any) -> dict[str, Any]:
        """The event once the deadline has passed, from the last look."""
        raise NotImplementedError

    def passed(self) -> bool:
        return bool(self.deadline) and time.time() > self.deadline

    def kube(self) -> KubeClient:
        """The cluster's client for this run of the trigger (opened at its first call)."""
        if self._kube is None:
            self._kube = KubeClient(self.credentials or {}, self.refresh_interval)
        return self._kube

    async def run(self) -> AsyncIterator[TriggerEvent]:
        renewed = None
        try:
            while True:
                if self.reservation and (renewed is None or time.monotonic() - renewed >=
                                         renewal_interval(self.reservation)):
                    renewed = time.monotonic()  # kubernetes and boto3 block: off the loop
                    await asyncio.to_thread(renew_reservation, self.reservation)
                seen = await self.poll()
                event = self.done(seen)
                if event is None and self.passed():
                    event = self.timed_out(seen)
                if event is not None:
                    yield TriggerEvent(event)
                    return
                await asyncio.sleep(self.poll_interval)
        finally:
            if self._kube is not None:
                kube, self._kube = self._kube, None
                await kube.close()


class NodegroupActiveTrigger(PollingTrigger):
    """Reads describe_nodegroup itself rather than running boto3's `nodegroup_active` waiter:
    the waiter fails only on CREATE_FAILED (a DEGRADED or DELETING node group would be waited
    out to the deadline instead of named at once with its health issues), hands a throttled
    call back as a WaiterError that `retry_transient` cannot tell from a real failure, and the
    amazon provider's async form of it (`AwsBaseWaiterTrigger`) needs aiobotocore and counts
    attempts, not a wall-clock deadline."""

    def __init__(self, *, cluster_name: str, nodegroup: str, deadline: float,
                 aws_conn_id: str = "", poll_interval: float = 15.0,
                 reservation: Renewal | None = None):
        super().__init__()
        self.cluster_name, self.nodegroup, self.aws_conn_id = cluster_name, nodegroup, aws_conn_id
        self.deadline, self.poll_interval = deadline, poll_interval
        self.reservation = reservation

    @retry_transient
    def _describe(self) -> dict[str, Any]:
        eks = aws_session(self.aws_conn_id).client("eks")
        return eks.describe_nodegroup(clusterName=self.cluster_name,
                                      nodegroupName=self.nodegroup)["nodegroup"]

    async def poll(self) -> dict[str, Any]:
        return await asyncio.to_thread(self._describe)  # boto3 blocks: off the event loop

    def done(self, ng: dict[str, Any]) -> dict[str, Any] | None:
        if ng.get("status") == "ACTIVE":
            return {"status": "success", "nodegroup_status": "ACTIVE"}
        if ng.get("status") in NODEGROUP_FAILED:
            return self._error(ng, f"node group {self.nodegroup} is {ng.get('status')}")
        return None

    def timed_out(self, ng: dict[str, Any]) -> dict[str, Any]:
        return self._error(ng, f"node group {self.nodegroup} still {ng.get('status')} at its "
                           "deadline")

    @staticmethod
    def _error(ng: dict[str, Any], message: str) -> dict[str, Any]:
        issues = "; ".join(f"{i.get('code')}: {i.get('message')}"
                           for i in (ng.get("health") or {}).get("issues") or [])
        return {"status": "error", "message": message + (f": {issues}" if issues else "")}


class NodesReadyTrigger(PollingTrigger):
    """`instance_types`: the node group's (a spot group has several); `instance_type`: the one
    type a trigger stored before there could be several."""

    def __init__(self, *, credentials: dict[str, str], nodegroup: str, nodes: int, gpus: int,
                 deadline: float, efa: int = 0, instance_type: str = "",
                 devices_grace_s: float = 300.0, poll_interval: float = 15.0,
                 refresh_interval: float = TOKEN_REFRESH_S,
                 instance_types: list[str] | None = None, reservation: Renewal | None = None):
        super().__init__()
        self.credentials, self.nodegroup, self.nodes = credentials, nodegroup, nodes
        self.gpus, self.efa, self.instance_type = gpus, efa, instance_type
        self.instance_types = list(instance_types or ([instance_type] if instance_type else []))
        self.devices_grace_s = devices_grace_s
        self.deadline, self.poll_interval = deadline, poll_interval
        self.refresh_interval, self.reservation = refresh_interval, reservation

    @retry_transient
    async def poll(self) -> list[dict[str, Any]]:
        from kubernetes_asyncio import client

        api = await self.kube().get()
        listed = await client.CoreV1Api(api).list_node(
            label_selector=f"{NODEGROUP_LABEL}={self.nodegroup}")
        return api.sanitize_for_serialization(listed)["items"]

    def done(self, nodes: list[dict[str, Any]]) -> dict[str, Any] | None:
        usable, _ = usable_nodes(nodes, self.gpus, self.efa, self.instance_types)
        if len(usable) >= self.nodes:
            return {"status": "success", "nodes": usable}
        missing = missing_devices(nodes, self.gpus, self.efa, self.instance_types,
                                  self.devices_grace_s, time.time())
        if missing:  # waiting on would only wait out the deadline
            return {"status": "devices", "nodes": usable, "message": missing}
        return None

    def timed_out(self, nodes: list[dict[str, Any]]) -> dict[str, Any]:
        usable, summary = usable_nodes(nodes, self.gpus, self.efa, self.instance_types)
        return {"status": "timeout", "nodes": usable, "summary": summary}


class JobTrigger(PollingTrigger):
    """`launcher`: pytorchjob or trainjob (launchers.LAUNCHERS); `deadline`: epoch seconds after
    which the event says so (0: none, the job ends itself at its activeDeadlineSeconds)."""

    def __init__(self, *, credentials: dict[str, str], namespace: str, name: str,
                 wake_at: float, poll_interval: float = 15.0,
                 refresh_interval: float = TOKEN_REFRESH_S, launcher: str = "pytorchjob",
                 deadline: float = 0.0, reservation: Renewal | None = None):
        super().__init__()
        self.credentials, self.namespace, self.name = credentials, namespace, name
        self.wake_at, self.poll_interval = wake_at, poll_interval
        self.refresh_interval, self.reservation = refresh_interval, reservation
        self.launcher, self.deadline = launcher, deadline

    @retry_transient
    async def poll(self) -> tuple[str, str]:
        from kubernetes_asyncio import client

        launcher = LAUNCHERS[self.launcher]
        api = await self.kube().get()
        return launcher.state(await client.CustomObjectsApi(api).get_namespaced_custom_object(
            launcher.group, launcher.version, self.namespace, launcher.plural, self.name))

    def done(self, seen: tuple[str, str]) -> dict[str, Any] | None:
        state, message = seen
        if state in TERMINAL:
            return {"status": state.lower(), "state": state, "message": message}
        # Back to the task, which streams the log; a passed deadline's event comes first.
        if time.time() >= self.wake_at and not self.passed():
            return {"status": "running", "state": state, "message": message}
        return None

    def timed_out(self, seen: tuple[str, str]) -> dict[str, Any]:
        state, message = seen  # the task stops the job
        return {"status": "deadline", "state": state, "message": message}

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


read_codebuild = retry_transient(codebuild_state)


class CompletionTrigger(PollingTrigger):
    """A wait on something that runs to Complete or Failed (a batch Job, a build): its event
    is its state and message once it no longer runs, or Running at the deadline."""

    def done(self, seen: tuple[str, str]) -> dict[str, Any] | None:
        return None if seen[0] == "Running" else self.timed_out(seen)

    def timed_out(self, seen: tuple[str, str]) -> dict[str, Any]:
        state, message = seen
        return {"state": state, "message": message}


class ImageBuildTrigger(CompletionTrigger):
    """The image build started by `image_build.start_image` ended, or its deadline passed.

    `pending` is what start_image returned: a BuildKit Job (read with kubernetes_asyncio, the
    token re-minted as for the other waits) or a CodeBuild build (boto3, off the event loop).
    The event's state is Complete, Failed, or Running when the wait passed the deadline.
    """

    def __init__(self, *, pending: dict[str, Any], deadline: float,
                 credentials: dict[str, str] | None = None, aws_conn_id: str = "",
                 poll_interval: float = 15.0, refresh_interval: float = TOKEN_REFRESH_S,
                 reservation: Renewal | None = None):
        super().__init__()
        self.pending, self.credentials, self.aws_conn_id = pending, credentials, aws_conn_id
        self.deadline, self.poll_interval = deadline, poll_interval
        self.refresh_interval, self.reservation = refresh_interval, reservation
        self._codebuild: Any = None

    async def poll(self) -> tuple[str, str]:
        if self.pending["builder"] == "buildkit":
            return await read_batch_job(self.kube(), self.pending["namespace"],
                                        self.pending["job"])
        if self._codebuild is None:
            self._codebuild = await asyncio.to_thread(
                lambda: aws_session(self.aws_conn_id).client("codebuild"))
        return await asyncio.to_thread(read_codebuild, self._codebuild,
                                       self.pending["build_id"])


class BatchJobTrigger(CompletionTrigger):
    """A batch/v1 Job (the prepare_data pod's) Complete or Failed, or `deadline` (epoch seconds)
    passed: the event's state is Complete, Failed, or Running at the deadline. A mark-failed
    while deferred deletes the Job (and its pod)."""

    def __init__(self, *, credentials: dict[str, str], namespace: str, name: str,
                 deadline: float, poll_interval: float = 15.0,
                 refresh_interval: float = TOKEN_REFRESH_S, reservation: Renewal | None = None):
        super().__init__()
        self.credentials, self.namespace, self.name = credentials, namespace, name
        self.deadline, self.poll_interval = deadline, poll_interval
        self.refresh_interval, self.reservation = refresh_interval, reservation

    async def poll(self) -> tuple[str, str]:
        return await read_batch_job(self.kube(), self.namespace, self.name)

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
