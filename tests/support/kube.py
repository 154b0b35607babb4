"""Kubernetes for the tests: kmock's KubernetesEmulator (a real HTTP server the official client
talks to) fixed where the eks target relies on the API server, served from its own thread."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest


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
                                ("kubeflow.org/v1/pytorchjobs", True),
                                ("trainer.kubeflow.org/v1alpha1/trainjobs", True)):
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


def pod_status(unschedulable: str | None = None) -> dict[str, Any]:
    """A training pod's status as the operators' stand-ins make it: Running, or Pending with
    the scheduler's `unschedulable` message for the last 700 s."""
    if not unschedulable:
        return {"phase": "Running"}
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 700))
    return {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": unschedulable, "lastTransitionTime": since}]}


def add_nodes(cluster: Cluster, count: int, ready: bool = True, gpus: int = 8, efa: int = 4,
              ready_for: float = 0.0, nodegroup: str = "gpu-p4de",
              instance_type: str = "p4de.24xlarge", first: int = 0) -> None:
    """`count` nodes of the node group (the p4de one unless named), ip-10-0-0-`first` on;
    `ready_for`: seconds since they became Ready."""
    core = kubernetes.client.CoreV1Api(cluster.api())
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - ready_for))
    for i in range(first, first + count):
        core.create_node({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": f"ip-10-0-0-{i}", "labels": {
                "eks.amazonaws.com/nodegroup": nodegroup,
                "node.kubernetes.io/instance-type": instance_type}},
            "status": {
                "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                "reason": "KubeletReady" if ready else "KubeletNotReady",
                                "message": "" if ready else "container runtime not ready",
                                "lastTransitionTime": since}],
                "allocatable": {"nvidia.com/gpu": str(gpus), "vpc.amazonaws.com/efa": str(efa)}},
        })


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """The emulator, reached by the eks target through FINETUNE_KUBECONFIG."""
    c = Cluster(tmp_path)
    monkeypatch.setenv("FINETUNE_KUBECONFIG", str(c.kubeconfig))
    yield c
    c.close()
