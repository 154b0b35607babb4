"""The `eks` target: Amazon EKS with the Kubeflow training operator.

- snapshot records the node group's scaling config; teardown restores it and deletes the run's
  PyTorchJob and ConfigMap, whatever happened to the run;
- scale_up raises the node group (never above max_nodes) and waits for ACTIVE, then for the
  run's nodes to be Ready with allocatable GPUs (and EFA) in Kubernetes;
- reset_etcd deletes the run's rendezvous keys through the Kubernetes service proxy (or restarts
  the etcd pod);
- train creates (or, on a retry, adopts) the run's PyTorchJob, streams the leader's log and fails
  with each failed pod's reason.

The waits poll from the task for now; deferrable triggers come later.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
import urllib.parse
from typing import Any

from finetune.config import RunConfig
from finetune.etcd import EtcdError, KeysRequest, delete_rendezvous_keys
from finetune.instance_types import INSTANCE_TYPES
from finetune.kube import aws_session, kube_api_client
from finetune.manifests import (
    CONTAINER_NAME,
    EFA_RESOURCE,
    ETCD_PORT,
    GPU_RESOURCE,
    LABEL_JOB_NAME,
    LABEL_REPLICA_INDEX,
    LABEL_REPLICA_TYPE,
    NODEGROUP_LABEL,
    PYTORCHJOB_GROUP,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
    pytorchjob_manifest,
    rendezvous_host,
    run_selector,
    trainer_configmap_manifest,
)
from finetune.pytorchjob import job_state, pod_failure, split_log
from finetune.targets import Target

log = logging.getLogger(__name__)

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
SCALING_KEYS = ("minSize", "maxSize", "desiredSize")
LOG_TAIL_LINES = 20


def _required(values: dict[str, Any], field: str, what: str) -> list[tuple[str, str]]:
    return [] if values[field] else [(field, f"is required for target eks: {what}")]


def _json(api_client: Any, obj: Any) -> Any:
    """A client model as the API's JSON (camelCase keys), so pure functions read plain dicts."""
    return api_client.sanitize_for_serialization(obj)


def node_readiness(node: dict[str, Any], gpus: int, efa: int) -> tuple[bool, str]:
    """(usable, summary): Ready, schedulable, with the GPUs (and EFA) a worker requests."""
    status = node.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    ready = conditions.get("Ready", {})
    allocatable = status.get("allocatable") or {}
    have_gpus = int(allocatable.get(GPU_RESOURCE, 0))
    have_efa = int(allocatable.get(EFA_RESOURCE, 0))
    ok = (ready.get("status") == "True" and have_gpus >= gpus and have_efa >= efa
          and not (node.get("spec") or {}).get("unschedulable"))
    name = (node.get("metadata") or {}).get("name")
    detail = f"Ready={ready.get('status', 'Unknown')}"
    if ready.get("status") != "True" and (ready.get("reason") or ready.get("message")):
        detail += f" ({ready.get('reason', '')}: {ready.get('message', '')})"
    detail += f", {GPU_RESOURCE}={have_gpus}" + (f", {EFA_RESOURCE}={have_efa}" if efa else "")
    return ok, f"{name}: {detail}"


class EksTarget(Target):
    name = "eks"

    def __init__(self, poll_interval: float = 15.0, nodes_timeout: float = 1800.0,
                 etcd_timeout: float = 300.0, update_retries: int = 20):
        self.poll_interval = poll_interval
        self.nodes_timeout = nodes_timeout
        self.etcd_timeout = etcd_timeout
        self.update_retries = update_retries

    # -- validate ---------------------------------------------------------------------------

    def check(self, values: dict[str, Any]) -> list[tuple[str, str]]:
        errors = _required(values, "cluster_name", "the EKS cluster's name")
        errors += _required(values, "nodegroup", "the managed node group of GPU nodes")
        errors += _required(values, "image", "the trainer image (registry/repository:tag); "
                            "building it in the pipeline is not implemented yet")
        if values["nodes"] > values["max_nodes"]:
            errors.append(("nodes", f"{values['nodes']} exceeds max_nodes = "
                           f"{values['max_nodes']}, the cap on the node group's size"))
        itype = INSTANCE_TYPES[values["instance_type"]]
        if values["procs_per_node"] > itype.gpus:
            errors.append(("procs_per_node", f"{values['procs_per_node']} processes per node, "
                           f"but {itype.name} has {itype.gpus} GPUs; allowed: 1..{itype.gpus}"))
        for field in ("namespace", "etcd_service"):
            if not _DNS_LABEL.match(values[field]):
                errors.append((field, f"{values[field]!r} is not a DNS label (lowercase "
                               "letters, digits and '-', at most 63)"))
        secret = values["hf_token_secret"].partition(":")[0]
        if values["hf_token_secret"] and not _DNS_SUBDOMAIN.match(secret):
            errors.append(("hf_token_secret", f"{secret!r} is not a Secret name; give name or "
                           "name:key"))
        out = values["output_dir"]
        if not (out.startswith("s3://") or out.startswith("/")):
            errors.append(("output_dir", f"{out!r}: on eks give s3://bucket/prefix or an "
                           "absolute path the pods mount"))
        return errors

    # -- clients ----------------------------------------------------------------------------

    def _eks(self, cfg: RunConfig) -> Any:
        return aws_session(cfg.aws_conn_id).client("eks")

    def _kube(self, cfg: RunConfig) -> Any:
        return kube_api_client(kubernetes_conn_id=cfg.kubernetes_conn_id,
                               aws_conn_id=cfg.aws_conn_id, cluster_name=cfg.cluster_name)

    def _describe_nodegroup(self, eks: Any, cfg: RunConfig) -> dict[str, Any]:
        return eks.describe_nodegroup(clusterName=cfg.cluster_name,
                                      nodegroupName=cfg.nodegroup)["nodegroup"]

    # -- stages -----------------------------------------------------------------------------

    def snapshot(self, cfg: RunConfig) -> dict:
        ng = self._describe_nodegroup(self._eks(cfg), cfg)
        scaling = {k: ng["scalingConfig"][k] for k in SCALING_KEYS}
        log.info("node group %s/%s: scaling config %s recorded for teardown", cfg.cluster_name,
                 cfg.nodegroup, scaling)
        return {"target": self.name, "cluster": cfg.cluster_name, "nodegroup": cfg.nodegroup,
                "scaling_config": scaling}

    def scale_up(self, cfg: RunConfig) -> dict:
        eks = self._eks(cfg)
        current = self._describe_nodegroup(eks, cfg)["scalingConfig"]
        desired = max(current["desiredSize"], cfg.nodes)
        if desired > cfg.max_nodes:
            raise RuntimeError(f"node group {cfg.nodegroup} would need {desired} nodes, above "
                               f"max_nodes = {cfg.max_nodes}")
        wanted = {"minSize": current["minSize"], "maxSize": max(current["maxSize"], desired),
                  "desiredSize": desired}
        if wanted != {k: current[k] for k in SCALING_KEYS}:
            log.info("scaling node group %s from %s to %s", cfg.nodegroup, current, wanted)
            self._update_scaling(eks, cfg, wanted)
        eks.get_waiter("nodegroup_active").wait(
            clusterName=cfg.cluster_name, nodegroupName=cfg.nodegroup,
            WaiterConfig={"Delay": max(1, int(self.poll_interval)),
                          "MaxAttempts": max(1, int(self.nodes_timeout / max(self.poll_interval,
                                                                             1)))})
        nodes = self._wait_for_nodes(cfg)
        return {"nodegroup": cfg.nodegroup, "scaling_config": wanted, "nodes": nodes}

    def _update_scaling(self, eks: Any, cfg: RunConfig, scaling: dict[str, int]) -> None:
        for attempt in range(self.update_retries):
            try:
                eks.update_nodegroup_config(clusterName=cfg.cluster_name,
                                            nodegroupName=cfg.nodegroup, scalingConfig=scaling)
                return
            except eks.exceptions.ResourceInUseException:
                # Another update of the node group is in progress: EKS takes one at a time.
                if attempt == self.update_retries - 1:
                    raise
                time.sleep(self.poll_interval)

    def _wait_for_nodes(self, cfg: RunConfig) -> list[str]:
        import kubernetes

        itype = INSTANCE_TYPES[cfg.instance_type]
        efa = itype.efa if itype.efa else 0
        api = self._kube(cfg)
        core = kubernetes.client.CoreV1Api(api)
        deadline = time.monotonic() + self.nodes_timeout
        while True:
            nodes = _json(api, core.list_node(
                label_selector=f"{NODEGROUP_LABEL}={cfg.nodegroup}"))["items"]
            states = [node_readiness(n, cfg.procs_per_node, efa) for n in nodes]
            usable = [s.split(":", 1)[0] for ok, s in states if ok]
            if len(usable) >= cfg.nodes:
                log.info("%d node(s) Ready with %s: %s", len(usable), GPU_RESOURCE, usable)
                return usable
            if time.monotonic() > deadline:
                summary = "; ".join(s for _, s in states) or "no nodes registered"
                raise TimeoutError(
                    f"only {len(usable)} of {cfg.nodes} node(s) of node group {cfg.nodegroup} "
                    f"are Ready with {cfg.procs_per_node} allocatable {GPU_RESOURCE}"
                    f"{' and ' + EFA_RESOURCE if efa else ''} after {self.nodes_timeout:.0f}s: "
                    f"{summary}")
            log.info("waiting for nodes: %d of %d usable", len(usable), cfg.nodes)
            time.sleep(self.poll_interval)

    def build_image(self, cfg: RunConfig) -> dict:
        # Building and pushing the image (issue 5) is not implemented: the run names one.
        tag = cfg.image.rsplit(":", 1)[1] if ":" in cfg.image.rsplit("/", 1)[-1] else "latest"
        log.info("using trainer image %s", cfg.image)
        return {"image": cfg.image, "image_tag": tag, "built": False}

    def reset_etcd(self, cfg: RunConfig) -> dict:
        host, port = rendezvous_host(cfg)
        result = {"backend": cfg.rdzv_backend, "endpoint": f"{host}:{port}",
                  "rdzv_id": cfg.rdzv_id, "deleted_keys": 0}
        if cfg.rdzv_backend == "c10d":
            log.info("c10d rendezvous on worker 0 (%s): no etcd to reset", host)
            return result
        api = self._kube(cfg)
        if cfg.etcd_reset == "restart":
            self._restart_etcd(api, cfg)
            return {**result, "restarted_etcd": True}
        deleted = delete_rendezvous_keys(
            proxy_keys_request(api, cfg.namespace, cfg.etcd_service), cfg.rdzv_id)
        log.info("rendezvous id %s: deleted %d stale key(s) on etcd service %s/%s", cfg.rdzv_id,
                 len(deleted), cfg.namespace, cfg.etcd_service)
        return {**result, "deleted_keys": len(deleted)}

    def _restart_etcd(self, api: Any, cfg: RunConfig) -> None:
        """Delete the etcd service's pods and wait for a new one to be Ready (empty store)."""
        import kubernetes

        core = kubernetes.client.CoreV1Api(api)
        service = _json(api, core.read_namespaced_service(cfg.etcd_service, cfg.namespace))
        selector = ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items())
        pods = _json(api, core.list_namespaced_pod(cfg.namespace,
                                                   label_selector=selector))["items"]
        old = {p["metadata"]["uid"] for p in pods}
        for pod in pods:
            core.delete_namespaced_pod(pod["metadata"]["name"], cfg.namespace)
        log.info("deleted etcd pod(s) %s; waiting for the replacement", sorted(old))
        deadline = time.monotonic() + self.etcd_timeout
        while time.monotonic() < deadline:
            for pod in _json(api, core.list_namespaced_pod(
                    cfg.namespace, label_selector=selector))["items"]:
                conditions = (pod.get("status") or {}).get("conditions") or []
                if pod["metadata"]["uid"] not in old and any(
                        c["type"] == "Ready" and c["status"] == "True" for c in conditions):
                    return
            time.sleep(self.poll_interval)
        raise TimeoutError(f"etcd ({cfg.namespace}/{cfg.etcd_service}) has no Ready pod "
                           f"{self.etcd_timeout:.0f}s after the restart")

    def train(self, cfg: RunConfig, image: dict, rendezvous: dict) -> dict:
        import kubernetes

        api = self._kube(cfg)
        custom = kubernetes.client.CustomObjectsApi(api)
        core = kubernetes.client.CoreV1Api(api)
        started = time.time()
        _apply_configmap(core, trainer_configmap_manifest(cfg))
        name, adopted = self._create_or_adopt_job(custom, cfg, image["image"])
        after, state, message = "", "Pending", ""
        while True:
            job = custom.get_namespaced_custom_object(
                PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, cfg.namespace, PYTORCHJOB_PLURAL, name)
            after = self._stream_leader_log(api, core, cfg, name, after)
            new_state, message = job_state(job)
            if new_state != state:
                log.info("PyTorchJob %s: %s %s", name, new_state, message)
                state = new_state
            if state in ("Succeeded", "Failed"):
                break
            time.sleep(self.poll_interval)
        if state == "Failed":
            raise RuntimeError(self._failure_report(api, core, cfg, name, message))
        return {"job": name, "namespace": cfg.namespace, "adopted": adopted,
                "wall_time_s": round(time.time() - started, 1), "image": image["image"],
                "image_tag": image.get("image_tag"),
                "rendezvous": {k: rendezvous[k] for k in ("backend", "rdzv_id")}}

    def _create_or_adopt_job(self, custom: Any, cfg: RunConfig, image: str) -> tuple[str, bool]:
        """Never two jobs for one run: a retry adopts the job its earlier try created."""
        import kubernetes

        existing = custom.list_namespaced_custom_object(
            PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, cfg.namespace, PYTORCHJOB_PLURAL,
            label_selector=run_selector(cfg))["items"]
        live = [j for j in existing if not j["metadata"].get("deletionTimestamp")]
        if live:
            job = live[0]
            name = job["metadata"]["name"]
            state, _ = job_state(job)
            if state != "Failed":
                log.info("adopting PyTorchJob %s (%s) created by an earlier try", name, state)
                return name, True
            # A retry of a failed job runs it again (from its last checkpoint).
            log.info("PyTorchJob %s failed in an earlier try: deleting it to start again", name)
            self._delete_job(custom, cfg, name, wait=True)
        manifest = pytorchjob_manifest(cfg, image)
        try:
            custom.create_namespaced_custom_object(
                PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, cfg.namespace, PYTORCHJOB_PLURAL, manifest)
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:
                raise
            log.info("PyTorchJob %s already exists: adopting it", manifest["metadata"]["name"])
            return manifest["metadata"]["name"], True
        log.info("created PyTorchJob %s/%s: %d node(s) x %d GPU(s), image %s", cfg.namespace,
                 manifest["metadata"]["name"], cfg.nodes, cfg.procs_per_node, image)
        return manifest["metadata"]["name"], False

    def _delete_job(self, custom: Any, cfg: RunConfig, name: str, wait: bool = False) -> bool:
        import kubernetes

        try:
            custom.delete_namespaced_custom_object(
                PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, cfg.namespace, PYTORCHJOB_PLURAL, name,
                body=kubernetes.client.V1DeleteOptions(propagation_policy="Foreground"))
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return False
            raise
        deadline = time.monotonic() + self.etcd_timeout
        while wait and time.monotonic() < deadline:
            try:
                custom.get_namespaced_custom_object(
                    PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, cfg.namespace, PYTORCHJOB_PLURAL, name)
            except kubernetes.client.ApiException as exc:
                if exc.status == 404:
                    break
                raise
            time.sleep(self.poll_interval)
        return True

    def _leader_pod(self, api: Any, core: Any, cfg: RunConfig, name: str) -> str | None:
        selector = (f"{LABEL_JOB_NAME}={name},{LABEL_REPLICA_TYPE}=worker,"
                    f"{LABEL_REPLICA_INDEX}=0")
        pods = _json(api, core.list_namespaced_pod(cfg.namespace,
                                                   label_selector=selector))["items"]
        return pods[0]["metadata"]["name"] if pods else None

    def _stream_leader_log(self, api: Any, core: Any, cfg: RunConfig, name: str,
                           after: str) -> str:
        """Copy worker 0's log lines newer than timestamp `after` into the task log."""
        import kubernetes

        pod = self._leader_pod(api, core, cfg, name)
        if pod is None:
            return after
        try:
            text = pod_log(core, pod, cfg.namespace, timestamps=True,
                           since_seconds=max(1, math.ceil(self.poll_interval * 4))
                           if after else None)
        except kubernetes.client.ApiException as exc:
            if exc.status in (400, 404):  # not started yet, or gone
                return after
            raise
        lines, after = split_log(text, after)
        for line in lines:
            log.info("[worker 0] %s", line)
        return after

    def _failure_report(self, api: Any, core: Any, cfg: RunConfig, name: str,
                        message: str) -> str:
        import kubernetes

        pods = _json(api, core.list_namespaced_pod(
            cfg.namespace, label_selector=f"{LABEL_JOB_NAME}={name}"))["items"]
        parts = [f"PyTorchJob {cfg.namespace}/{name} failed: {message}"]
        for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
            reason = pod_failure(pod)
            if reason is None:
                continue
            pod_name = pod["metadata"]["name"]
            parts.append(f"pod {pod_name}: {reason}")
            try:
                tail = pod_log(core, pod_name, cfg.namespace, tail_lines=LOG_TAIL_LINES)
            except kubernetes.client.ApiException:
                tail = ""
            if tail.strip():
                parts.append(f"  last lines of {pod_name}:\n" + "\n".join(
                    "    " + line for line in tail.splitlines()[-LOG_TAIL_LINES:]))
        return "\n".join(parts)

    def collect_metrics(self, cfg: RunConfig, trained: dict) -> dict:
        # Reading the trainer's metrics from the output location is a later step.
        log.warning("eks: metrics are in %s (collecting them into a report is not implemented "
                    "yet)", cfg.run_dir)
        return {"status": "success", "run_dir": cfg.run_dir, "job": trained.get("job"),
                "metrics": None}

    def teardown(self, cfg: RunConfig, snapshot: dict) -> dict:
        """Delete the run's job and ConfigMap, restore the node group; every step is tried."""
        done: dict[str, Any] = {}
        problems: list[str] = []
        try:
            done["deleted"] = self._delete_run_objects(cfg)
        except Exception as exc:  # the node group must be restored even so
            problems.append(f"deleting the run's Kubernetes objects failed: {exc}")
        try:
            done["scaling_config"] = self._restore_scaling(cfg, snapshot)
        except Exception as exc:
            problems.append(f"restoring node group {cfg.nodegroup} failed: {exc}")
        log.info("teardown: %s", done)
        if problems:
            raise RuntimeError("teardown incomplete: " + "; ".join(problems))
        return done

    def _delete_run_objects(self, cfg: RunConfig) -> list[str]:
        import kubernetes

        api = self._kube(cfg)
        custom = kubernetes.client.CustomObjectsApi(api)
        core = kubernetes.client.CoreV1Api(api)
        deleted = []
        for job in custom.list_namespaced_custom_object(
                PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, cfg.namespace, PYTORCHJOB_PLURAL,
                label_selector=run_selector(cfg))["items"]:
            if self._delete_job(custom, cfg, job["metadata"]["name"]):
                deleted.append(f"pytorchjob/{job['metadata']['name']}")
        for cm in core.list_namespaced_config_map(cfg.namespace,
                                                  label_selector=run_selector(cfg)).items:
            try:
                core.delete_namespaced_config_map(cm.metadata.name, cfg.namespace)
                deleted.append(f"configmap/{cm.metadata.name}")
            except kubernetes.client.ApiException as exc:
                if exc.status != 404:
                    raise
        return deleted

    def _restore_scaling(self, cfg: RunConfig, snapshot: dict) -> dict[str, int]:
        eks = self._eks(cfg)
        recorded = snapshot["scaling_config"]
        current = self._describe_nodegroup(eks, cfg)["scalingConfig"]
        if {k: current[k] for k in SCALING_KEYS} != recorded:
            log.info("restoring node group %s from %s to %s", cfg.nodegroup, current, recorded)
            self._update_scaling(eks, cfg, dict(recorded))
        return dict(recorded)


def pod_log(core: Any, pod: str, namespace: str, **options: Any) -> str:
    """The training container's log as text."""
    # Raw body: the client (36.x) turns a non-JSON text answer into the repr of its bytes.
    resp = core.read_namespaced_pod_log(pod, namespace, container=CONTAINER_NAME,
                                        _preload_content=False, **options)
    return resp.data.decode("utf-8", errors="replace")


def _apply_configmap(core: Any, manifest: dict[str, Any]) -> None:
    import kubernetes

    meta = manifest["metadata"]
    try:
        core.create_namespaced_config_map(meta["namespace"], manifest)
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise
        core.replace_namespaced_config_map(meta["name"], meta["namespace"], manifest)


def proxy_keys_request(api: Any, namespace: str, service: str,
                       timeout: float = 10.0) -> KeysRequest:
    """etcd v2 keys API calls through the Kubernetes API server's service proxy."""
    import kubernetes

    base = f"/api/v1/namespaces/{namespace}/services/{service}:{ETCD_PORT}/proxy/v2/keys"

    def request(method: str, key: str, query: dict[str, str] | None) -> dict | None:
        try:
            resp = api.call_api(base + urllib.parse.quote(key), method,
                                query_params=list((query or {}).items()),
                                header_params={"Accept": "application/json"},
                                auth_settings=["BearerToken"], _preload_content=False,
                                _return_http_data_only=True, _request_timeout=timeout)
        except kubernetes.client.ApiException as exc:
            try:
                body = json.loads(exc.body or b"{}")
            except ValueError:
                body = {}
            if exc.status == 404 and body.get("errorCode") == 100:  # etcd: key not found
                return None
            raise EtcdError(f"etcd {method} {key} through the service proxy {namespace}/"
                            f"{service} failed: HTTP {exc.status} {str(exc.body)[:300]}") from exc
        return json.loads(resp.data)

    return request

