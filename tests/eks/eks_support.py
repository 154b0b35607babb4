"""What the eks tests share: an eks run config, and kmock's KubernetesEmulator (a real HTTP
server) fixed where the eks target relies on the API server, served from its own thread."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import importlib
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import kubernetes
from airflow.sdk.exceptions import TaskDeferred

from finetune.config import RunConfig
from finetune.operators import StageOperator
from finetune.targets.eks.manifests import (
    LABEL_JOB_NAME,
    LABEL_REPLICA_INDEX,
    LABEL_REPLICA_TYPE,
    PYTORCHJOB_GROUP,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
    run_selector,
)
from finetune.targets.eks.target import EksTarget
from finetune.validate import validate_params

EKS_PARAMS = {
    "target": "eks", "cluster_name": "train", "nodegroup": "gpu-p4de",
    "instance_type": "p4de.24xlarge", "namespace": "ml", "image": "1234.dkr.ecr/ft:abc",
    "procs_per_node": 8, "micro_batch": 1, "output_dir": "s3://bucket/runs",
    "hf_token_secret": "hf:token",
}


def eks_config(run_id: str = "manual__2026-11-29T10:00:00+00:00", **changes: Any) -> RunConfig:
    """A validated eks run config; `changes` bypass validation (for sizes the demo data lacks)."""
    cfg = validate_params(EKS_PARAMS, run_id=run_id)
    return dataclasses.replace(cfg, **changes)


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selectors: k=v, k==v, k!=v, k, !k (comma = and)."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            k, v = term.split("!=", 1)
            if labels.get(k) == v:
                return False
        elif "=" in term:
            k, v = re.split("==?", term, maxsplit=1)
            if labels.get(k) != v:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def make_emulator_class() -> type:
    import aiohttp
    import aiohttp.web
    import attrs
    import kmock
    from kmock._internal import rendering

    @attrs.define(kw_only=True)
    class FixedEmulator(kmock.KubernetesEmulator):
        """The emulator plus what the eks target relies on: label selectors on lists, pod logs
        (`timestamps`, `tailLines`), the service proxy to a real etcd, and resourceVersion:
        each write sets a new one, a write naming a stale one fails with 409 Conflict."""

        pod_logs: dict[tuple[str, str], list[tuple[str, str]]] = attrs.field(factory=dict)
        proxies: dict[tuple[str, str], str] = attrs.field(factory=dict)
        # The bearer token of each request, in order (to see tokens being re-minted).
        tokens: list[str] = attrs.field(factory=list)
        # (path regex, HTTP status): the next request to a matching path gets that error once.
        faults: list[tuple[str, int]] = attrs.field(factory=list)
        _version: int = attrs.field(default=0)
        _write_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock)

        async def _handle(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
            auth = request.headers.get("Authorization", "")
            if auth:
                self.tokens.append(auth.removeprefix("Bearer "))
            for i, (pattern, status) in enumerate(self.faults):
                if re.search(pattern, request.url.path):
                    del self.faults[i]
                    return aiohttp.web.json_response(
                        {"kind": "Status", "code": status, "message": "injected fault"},
                        status=status)
            replace = (request.resource is not None and request.name is not None
                       and not request.subresource and request.method == kmock.method.PUT)
            writes = (kmock.action.CREATE, kmock.action.UPDATE)
            if isinstance(request.data, dict) and (replace or (
                    request.resource is not None and request.action in writes)):
                # Check and write as one step: concurrent writers must see each other.
                async with self._write_lock:
                    self._check_and_bump_version(request)
                    if replace:  # kmock has no PUT: a replace is the whole new object
                        return await self._replace(request)
                    return await self._handle_plain(request)
            return await self._handle_plain(request)

        def _stored(self, request: rendering.Request) -> Any:
            key = (request.resource, request.namespace, request.name)
            stored = self.objects[key] if key in self.objects else None
            return None if stored is None or stored.deleted else stored

        def _check_and_bump_version(self, request: rendering.Request) -> None:
            from kmock._internal.k8s import KubernetesObjectConflictError

            meta = request.data.setdefault("metadata", {})
            if request.action != kmock.action.CREATE and meta.get("resourceVersion"):
                stored = self._stored(request)
                current = None if stored is None else (stored.get("metadata") or {}).get(
                    "resourceVersion")
                if current is not None and meta["resourceVersion"] != current:
                    raise KubernetesObjectConflictError(
                        reason="Conflict", message=f"the object has been modified: "
                        f"resourceVersion {meta['resourceVersion']} is not {current}")
            self._version += 1
            meta["resourceVersion"] = str(self._version)

        async def _replace(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
            from kmock._internal.k8s import KubernetesObjectNotFoundError

            stored = self._stored(request)
            if stored is None:
                raise KubernetesObjectNotFoundError()
            stored.create(request.data)
            await self._buses[request.resource].put({"type": "MODIFIED",
                                                     "object": stored.raw})
            return aiohttp.web.json_response(stored.raw)

        async def _handle_plain(self, request: rendering.Request) -> aiohttp.web.StreamResponse:
            path = request.url.path
            proxy = re.match(r"^/api/v1/namespaces/([^/]+)/services/([^/:]+):\d+/proxy(/.*)$",
                             path)
            if proxy and (proxy[1], proxy[2]) in self.proxies:
                return await self._proxy(request, self.proxies[proxy[1], proxy[2]], proxy[3])
            logs = re.match(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)/log$", path)
            if logs and request.method.value.lower() == "get":
                return self._log(request, (logs[1], logs[2]))
            return await super()._handle(request)

        async def _proxy(self, request: rendering.Request, endpoint: str,
                         rest: str) -> aiohttp.web.StreamResponse:
            url = f"http://{endpoint}{rest}"
            async with aiohttp.ClientSession() as session, session.request(
                    request.method.value.upper(), url, params=request.params,
                    data=request.body or None) as resp:
                body = await resp.read()
                return aiohttp.web.Response(status=resp.status, body=body,
                                            content_type="application/json")

        def _log(self, request: rendering.Request,
                 key: tuple[str, str]) -> aiohttp.web.StreamResponse:
            if key not in self.pod_logs:
                return aiohttp.web.json_response(
                    {"kind": "Status", "code": 400, "message": "container is waiting to start"},
                    status=400)
            lines = list(self.pod_logs[key])
            if request.params.get("tailLines"):
                lines = lines[-int(request.params["tailLines"]):]
            stamped = request.params.get("timestamps", "").lower() == "true"
            text = "".join(f"{ts} {line}\n" if stamped else f"{line}\n" for ts, line in lines)
            return aiohttp.web.Response(text=text, content_type="text/plain")

        async def _serve_list(self, request: rendering.Request) -> Any:
            listed = await super()._serve_list(request)
            selector = request.params.get("labelSelector")
            if selector:
                listed["items"] = [
                    o for o in listed["items"]
                    if _selector_matches(selector, o.get("metadata", {}).get("labels") or {})]
            return listed

    return FixedEmulator


class Cluster:
    """The emulator served on loopback from its own event loop thread, and the test's hands."""

    def __init__(self, tmp_path: Path):
        import kmock

        self.emulator = make_emulator_class()()
        for res, namespaced in (("v1/pods", True), ("v1/configmaps", True),
                                ("v1/services", True), ("v1/nodes", False),
                                ("kubeflow.org/v1/pytorchjobs", True)):
            self.emulator.resources[res] = kmock.ResourceInfo(namespaced=namespaced)
        self.loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError("the Kubernetes emulator did not start")
        self.kubeconfig = tmp_path / "kubeconfig"
        self.kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: emu\n"
            f"clusters: [{{name: emu, cluster: {{server: '{self.url}'}}}}]\n"
            "users: [{name: emu, user: {token: test-token}}]\n"
            "contexts: [{name: emu, context: {cluster: emu, user: emu}}]\n")

    def _serve(self, started: threading.Event) -> None:
        import kmock

        async def main() -> None:
            self._stop = asyncio.Event()
            async with self.emulator, kmock.Server(self.emulator) as server:
                self.url = str(server.url).rstrip("/")
                started.set()
                await self._stop.wait()

        self.loop.run_until_complete(main())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        # The server's graceful shutdown waits for idle keep-alive clients: do not wait long.
        self._thread.join(1)

    def api(self) -> Any:
        import kubernetes

        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))


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


def add_nodes(cluster: Cluster, count: int, ready: bool = True, gpus: int = 8) -> None:
    core = kubernetes.client.CoreV1Api(cluster.api())
    for i in range(count):
        core.create_node({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": f"ip-10-0-0-{i}", "labels": {
                "eks.amazonaws.com/nodegroup": "gpu-p4de",
                "node.kubernetes.io/instance-type": "p4de.24xlarge"}},
            "status": {
                "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                "reason": "KubeletReady" if ready else "KubeletNotReady",
                                "message": "" if ready else "container runtime not ready"}],
                "allocatable": {"nvidia.com/gpu": str(gpus), "vpc.amazonaws.com/efa": "4"}},
        })


class TrainingOperator(threading.Thread):
    """Plays the training operator: waits for the run's PyTorchJob, makes its pods, writes the
    leader's log and moves the job to `outcome`."""

    def __init__(self, cluster: Cluster, cfg: RunConfig, outcome: str = "Succeeded",
                 oom_worker: int | None = None):
        super().__init__(daemon=True)
        self.cluster, self.cfg, self.outcome, self.oom_worker = cluster, cfg, outcome, oom_worker
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
        for i in range(workers):
            pod = f"{name}-worker-{i}"
            core.create_namespaced_pod(NS, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod, "namespace": NS, "labels": {
                    LABEL_JOB_NAME: name, LABEL_REPLICA_TYPE: "worker",
                    LABEL_REPLICA_INDEX: str(i)}},
                "spec": {"containers": [{"name": "pytorch", "image": "img"}]},
                "status": {"phase": "Running"}})
            self.created.append(pod)
        self._set(custom, name, "Running")
        logs = self.cluster.emulator.pod_logs
        logs[NS, f"{name}-worker-0"] = []
        for step in range(1, 4):
            logs[NS, f"{name}-worker-0"].append(
                (f"2026-11-29T10:00:0{step}.000000000Z", f"step {step} loss {4 - step}.0"))
            time.sleep(0.15)
        if self.oom_worker is not None:
            pod = f"{name}-worker-{self.oom_worker}"
            logs[NS, pod] = [("2026-11-29T10:00:05.000000000Z", "allocating activations")]
            core.patch_namespaced_pod_status(pod, NS, {"status": {
                "phase": "Failed", "containerStatuses": [{
                    "name": "pytorch", "ready": False, "restartCount": 0, "image": "img",
                    "imageID": "", "state": {"terminated": {"exitCode": 137,
                                                            "reason": "OOMKilled"}}}]}})
        time.sleep(0.15)
        self._set(custom, name, self.outcome)

    def _set(self, custom: Any, name: str, condition: str) -> None:
        custom.patch_namespaced_custom_object_status(
            PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, NS, PYTORCHJOB_PLURAL, name,
            {"status": {"conditions": [{"type": condition, "status": "True",
                                        "message": f"PyTorchJob {name} is {condition}"}]}})


def jobs_of_run(cluster: Cluster, cfg: RunConfig) -> list[dict]:
    custom = kubernetes.client.CustomObjectsApi(cluster.api())
    return custom.list_namespaced_custom_object(
        PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, NS, PYTORCHJOB_PLURAL,
        label_selector=run_selector(cfg))["items"]


IMAGE = {"image": "1234.dkr.ecr/ft:abc", "image_tag": "abc"}
RDZV = {"backend": "etcd-v2", "rdzv_id": "x"}


# -- driving deferrable operators as Airflow does ------------------------------------------


def reloaded(trigger: Any) -> Any:
    """The trigger as the triggerer gets it: serialised to JSON and built again."""
    classpath, kwargs = trigger.serialize()
    module, _, name = classpath.rpartition(".")
    return getattr(importlib.import_module(module), name)(**json.loads(json.dumps(kwargs)))


async def first_event(trigger: Any) -> dict:
    async for event in trigger.run():
        return event.payload
    raise AssertionError("the trigger ended without an event")


def run_deferred(operator: Any, max_defers: int = 200) -> tuple[Any, list[dict]]:
    """Run an operator to the end, each deferral's trigger inline: (result, events). The
    trigger and the resume kwargs go through JSON, as they go through the metadata DB."""
    call, events = functools.partial(operator.execute, {}), []
    for _ in range(max_defers):
        try:
            return call(), events
        except TaskDeferred as deferred:
            event = asyncio.run(first_event(reloaded(deferred.trigger)))
            events.append(event)
            kwargs = json.loads(json.dumps(deferred.kwargs or {}))
            call = functools.partial(getattr(operator, deferred.method_name), {}, event=event,
                                     **kwargs)
    raise AssertionError(f"still deferring after {max_defers} deferrals")


def stage_operator(stage: str, cfg: RunConfig, options: dict[str, Any] | None = None,
                   **inputs: Any) -> StageOperator:
    """The DAG's task for a long stage of the eks target, at the tests' pace."""
    return StageOperator(task_id=stage, stage=stage, run_config=cfg.to_dict(), inputs=inputs,
                         target_options={**FAST, **(options or {})})


def run_stage(stage: str, cfg: RunConfig, **inputs: Any) -> dict:
    """A long stage run as the DAG runs it: its task to the end, every trigger inline."""
    return run_deferred(stage_operator(stage, cfg, **inputs))[0]
