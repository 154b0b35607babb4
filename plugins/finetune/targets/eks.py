"""The `eks` target: Amazon EKS with the Kubeflow training operator.

- snapshot records the node group's scaling config (and the shared baseline); teardown deletes
  the run's PyTorchJob and ConfigMap and removes the run's node reservation, giving back only
  what no other live run reserved, whatever happened to the run (finetune.reservations);
- scale_up reserves the run's nodes, sizes the node group to baseline + live reservations
  (never above max_nodes) and waits for ACTIVE, then for the run's nodes to be Ready with
  allocatable GPUs (and EFA) in Kubernetes;
- reset_etcd deletes the run's rendezvous keys through the Kubernetes service proxy (or restarts
  the etcd pod);
- train creates (or, on a retry, adopts) the run's PyTorchJob, streams the leader's log and fails
  with each failed pod's reason.

scale_up and train poll from the task here; the DAG's operators (finetune.operators) call the
same steps and wait deferred in triggers (finetune.triggers) instead.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import re
import time
import urllib.parse
from typing import Any

from finetune.config import RunConfig
from finetune.etcd import EtcdError, KeysRequest, delete_rendezvous_keys
from finetune.gpu_metrics import (
    job_pod_regex,
    missing_section,
    prometheus_endpoint,
    prometheus_gpu_metrics,
)
from finetune.image_build import finish_image, image_param_errors, provide_image, start_image
from finetune.instance_types import INSTANCE_TYPES
from finetune.kube import aws_session, create_or_replace, kube_api_client
from finetune.manifests import (
    APP,
    CONTAINER_NAME,
    EFA_RESOURCE,
    ETCD_PORT,
    GPU_RESOURCE,
    LABEL_APP,
    LABEL_JOB_NAME,
    LABEL_REPLICA_INDEX,
    LABEL_REPLICA_TYPE,
    LABEL_RUN,
    NODEGROUP_LABEL,
    PYTORCHJOB_GROUP,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
    pytorchjob_manifest,
    rendezvous_host,
    run_selector,
    trainer_configmap_manifest,
)
from finetune.outputs import build_report, has_outputs, report_exists
from finetune.pytorchjob import job_state, pod_failure, split_log
from finetune.reservations import (
    RESERVATION_TTL_S,
    SCALING_KEYS,
    ReservationStore,
    live_reservations,
    record_baseline,
    release,
    renew,
    reserve,
    wanted_scaling,
)
from finetune.s3_dataset import check_s3_dataset
from finetune.targets import Target

log = logging.getLogger(__name__)

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
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


def kube_credentials(cfg: RunConfig) -> dict[str, str]:
    """Where the cluster's credentials come from (kube.kube_api_client); serialisable."""
    return {"kubernetes_conn_id": cfg.kubernetes_conn_id, "aws_conn_id": cfg.aws_conn_id,
            "cluster_name": cfg.cluster_name}


def usable_nodes(nodes: list[dict[str, Any]], gpus: int, efa: int) -> tuple[list[str], str]:
    """(names of the usable nodes, a summary of every node's state) for a timeout message."""
    states = [node_readiness(n, gpus, efa) for n in nodes]
    usable = [s.split(":", 1)[0] for ok, s in states if ok]
    return usable, "; ".join(s for _, s in states) or "no nodes registered"


def _seconds_since(timestamp: str) -> int:
    """Seconds since a pod log's RFC 3339 timestamp, with a margin for clock skew."""
    then = datetime.datetime.fromisoformat(timestamp[:19]).replace(tzinfo=datetime.UTC)
    return max(1, math.ceil((datetime.datetime.now(datetime.UTC) - then).total_seconds()) + 30)


class EksTarget(Target):
    name = "eks"

    def __init__(self, poll_interval: float = 15.0, nodes_timeout: float = 1800.0,
                 etcd_timeout: float = 300.0, update_retries: int = 20,
                 reservation_ttl: float = RESERVATION_TTL_S):
        self.poll_interval = poll_interval
        self.nodes_timeout = nodes_timeout
        self.etcd_timeout = etcd_timeout
        self.update_retries = update_retries
        self.reservation_ttl = reservation_ttl

    # -- validate ---------------------------------------------------------------------------

    def check(self, values: dict[str, Any]) -> list[tuple[str, str]]:
        errors = _required(values, "cluster_name", "the EKS cluster's name")
        errors += _required(values, "nodegroup", "the managed node group of GPU nodes")
        errors += image_param_errors(values)
        if values["nodes"] > values["max_nodes"]:
            errors.append(("nodes", f"{values['nodes']} exceeds max_nodes = "
                           f"{values['max_nodes']}, the cap on the node group's size"))
        itype = INSTANCE_TYPES[values["instance_type"]]
        if values["procs_per_node"] > itype.gpus:
            errors.append(("procs_per_node", f"{values['procs_per_node']} processes per node, "
                           f"but {itype.name} has {itype.gpus} GPUs; allowed: 1..{itype.gpus}"))
        if values["float8"] and not itype.float8:
            errors.append(("float8", f"{itype.name}'s GPUs have no float8 tensor cores (compute "
                           "capability < 8.9); choose a p5, p5e, p5en or g6 instance_type or set "
                           "float8 to false"))
        for field in ("namespace", "etcd_service"):
            if not _DNS_LABEL.match(values[field]):
                errors.append((field, f"{values[field]!r} is not a DNS label (lowercase "
                               "letters, digits and '-', at most 63)"))
        out = values["output_dir"]
        if not (out.startswith("s3://") or out.startswith("/")):
            errors.append(("output_dir", f"{out!r}: on eks give s3://bucket/prefix or an "
                           "absolute path the pods mount"))
        return errors

    # -- clients ----------------------------------------------------------------------------

    def _eks(self, cfg: RunConfig) -> Any:
        return aws_session(cfg.aws_conn_id).client("eks")

    def _kube(self, cfg: RunConfig) -> Any:
        return kube_api_client(**kube_credentials(cfg))

    def _describe_nodegroup(self, eks: Any, cfg: RunConfig) -> dict[str, Any]:
        return eks.describe_nodegroup(clusterName=cfg.cluster_name,
                                      nodegroupName=cfg.nodegroup)["nodegroup"]

    def _reservations(self, cfg: RunConfig) -> ReservationStore:
        import kubernetes

        return ReservationStore(kubernetes.client.CoreV1Api(self._kube(cfg)), cfg.namespace,
                                cfg.cluster_name, cfg.nodegroup)

    def _current_scaling(self, eks: Any, cfg: RunConfig) -> dict[str, int]:
        scaling = self._describe_nodegroup(eks, cfg)["scalingConfig"]
        return {k: scaling[k] for k in SCALING_KEYS}

    # -- stages -----------------------------------------------------------------------------

    def snapshot(self, cfg: RunConfig) -> dict:
        eks = self._eks(cfg)
        scaling = self._current_scaling(eks, cfg)
        log.info("node group %s/%s: scaling config %s recorded for teardown", cfg.cluster_name,
                 cfg.nodegroup, scaling)
        try:  # the shared baseline, unless runs hold reservations; best effort: a setup
            self._reservations(cfg).update(
                lambda state: record_baseline(state, self._current_scaling(eks, cfg)))
        except Exception as exc:
            log.warning("could not record the node group's baseline in the cluster (scale_up "
                        "records it): %s", exc)
        return {"target": self.name, "cluster": cfg.cluster_name, "nodegroup": cfg.nodegroup,
                "scaling_config": scaling}

    def scale_up(self, cfg: RunConfig) -> dict:
        """The polling form; the deferrable operator calls request_nodes and the triggers."""
        eks = self._eks(cfg)
        wanted = self.request_nodes(cfg)
        eks.get_waiter("nodegroup_active").wait(
            clusterName=cfg.cluster_name, nodegroupName=cfg.nodegroup,
            WaiterConfig={"Delay": max(1, int(self.poll_interval)),
                          "MaxAttempts": max(1, int(self.nodes_timeout / max(self.poll_interval,
                                                                             1)))})
        nodes = self._wait_for_nodes(cfg)
        return {"nodegroup": cfg.nodegroup, "scaling_config": wanted, "nodes": nodes}

    def request_nodes(self, cfg: RunConfig) -> dict[str, int]:
        """Reserve the run's nodes and size the node group for every live reservation.

        An s3:// data set that is missing or empty fails here first, before any node is asked.
        """
        if cfg.dataset.startswith("s3://"):
            check_s3_dataset(cfg.dataset, cfg.dataset_format, self._s3(cfg))
        eks, store = self._eks(cfg), self._reservations(cfg)
        store.update(lambda state: reserve(
            record_baseline(state, self._current_scaling(eks, cfg)), cfg.rdzv_id, cfg.nodes,
            time.time(), cfg.max_nodes, self.reservation_ttl))
        return self._reconcile_scaling(eks, cfg, store)

    def renew_reservation(self, cfg: RunConfig) -> None:
        """Heartbeat: a live run's reservation must not expire while it trains."""
        self._reservations(cfg).update(
            lambda state: renew(state, cfg.rdzv_id, time.time(), self.reservation_ttl))

    def _reconcile_scaling(self, eks: Any, cfg: RunConfig,
                           store: ReservationStore) -> dict[str, int]:
        """Size the node group from the latest reservations until they stop changing.

        Whoever changes the reservations last also sizes the node group last, from them.
        """
        for _ in range(self.update_retries):
            state, version = store.read()
            wanted = wanted_scaling(state, time.time())
            self._apply_scaling(eks, cfg, wanted)
            if store.read()[1] == version:
                return wanted
        raise RuntimeError(f"the reservations of node group {cfg.nodegroup} kept changing")

    def _apply_scaling(self, eks: Any, cfg: RunConfig, wanted: dict[str, int]) -> None:
        current = self._current_scaling(eks, cfg)
        if wanted != current:
            log.info("scaling node group %s from %s to %s", cfg.nodegroup, current, wanted)
            self._update_scaling(eks, cfg, wanted)

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
            usable, summary = usable_nodes(nodes, cfg.procs_per_node, efa)
            if len(usable) >= cfg.nodes:
                log.info("%d node(s) Ready with %s: %s", len(usable), GPU_RESOURCE, usable)
                return usable
            if time.monotonic() > deadline:
                raise self.nodes_timeout_error(cfg, usable, summary)
            log.info("waiting for nodes: %d of %d usable", len(usable), cfg.nodes)
            time.sleep(self.poll_interval)

    def nodes_timeout_error(self, cfg: RunConfig, usable: list[str],
                            summary: str) -> TimeoutError:
        efa = INSTANCE_TYPES[cfg.instance_type].efa
        return TimeoutError(
            f"only {len(usable)} of {cfg.nodes} node(s) of node group {cfg.nodegroup} are Ready "
            f"with {cfg.procs_per_node} allocatable {GPU_RESOURCE}"
            f"{' and ' + EFA_RESOURCE if efa else ''} after {self.nodes_timeout:.0f}s: {summary}")

    def build_image(self, cfg: RunConfig) -> dict:
        """Prebuilt, already in ECR (skipped), or built now (BuildKit Job or CodeBuild)."""
        # The cluster client only when a BuildKit build needs it.
        return provide_image(cfg, aws_session(cfg.aws_conn_id), lambda: self._kube(cfg),
                             poll_interval=self.poll_interval)

    def start_build(self, cfg: RunConfig) -> dict:
        """build_image's first half: the image, or the started build under `pending`."""
        return start_image(cfg, aws_session(cfg.aws_conn_id), lambda: self._kube(cfg))

    def finish_build(self, cfg: RunConfig, started: dict, state: str, message: str) -> dict:
        """build_image's second half, after a deferred wait ended in `state`."""
        return finish_image(cfg, aws_session(cfg.aws_conn_id), lambda: self._kube(cfg),
                            started, state, message)

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
        """The polling form; the deferrable operator calls start_job and PyTorchJobTrigger."""
        import kubernetes

        job = self.start_job(cfg, image)
        api = self._kube(cfg)
        custom = kubernetes.client.CustomObjectsApi(api)
        core = kubernetes.client.CoreV1Api(api)
        after, state, message = "", "Pending", ""
        while True:
            found = custom.get_namespaced_custom_object(
                PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, cfg.namespace, PYTORCHJOB_PLURAL,
                job["job"])
            after = self._stream_leader_log(api, core, cfg, job["job"], after)
            new_state, message = job_state(found)
            if new_state != state:
                log.info("PyTorchJob %s: %s %s", job["job"], new_state, message)
                state = new_state
            if state in ("Succeeded", "Failed"):
                break
            time.sleep(self.poll_interval)
        if state == "Failed":
            raise RuntimeError(self.failure_report(cfg, job["job"], message))
        return self.train_result(cfg, job, image, rendezvous)

    def start_job(self, cfg: RunConfig, image: dict) -> dict:
        """The trainer's ConfigMap and the run's PyTorchJob, created or (on a retry) adopted."""
        import kubernetes

        api = self._kube(cfg)
        started = time.time()
        core = kubernetes.client.CoreV1Api(api)
        create_or_replace(core.create_namespaced_config_map, core.replace_namespaced_config_map,
                          trainer_configmap_manifest(cfg))
        name, adopted = self._create_or_adopt_job(kubernetes.client.CustomObjectsApi(api), cfg,
                                                  image["image"])
        return {"job": name, "adopted": adopted, "started": started}

    def train_result(self, cfg: RunConfig, job: dict, image: dict, rendezvous: dict) -> dict:
        finished = time.time()
        return {"job": job["job"], "namespace": cfg.namespace, "adopted": job["adopted"],
                "started": job["started"], "finished": finished,  # the GPU metrics' window
                "wall_time_s": round(finished - job["started"], 1), "image": image["image"],
                "image_tag": image.get("image_tag"),
                "rendezvous": {k: rendezvous[k] for k in ("backend", "rdzv_id")}}

    def stream_leader_log(self, cfg: RunConfig, name: str, after: str) -> str:
        """Worker 0's log lines newer than timestamp `after` into the task log; the newest."""
        import kubernetes

        api = self._kube(cfg)
        return self._stream_leader_log(api, kubernetes.client.CoreV1Api(api), cfg, name, after)

    def failure_report(self, cfg: RunConfig, name: str, message: str) -> str:
        import kubernetes

        api = self._kube(cfg)
        return self._failure_report(api, kubernetes.client.CoreV1Api(api), cfg, name, message)

    def delete_job(self, cfg: RunConfig, name: str) -> bool:
        import kubernetes

        return self._delete_job(kubernetes.client.CustomObjectsApi(self._kube(cfg)), cfg, name)

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
                           since_seconds=_seconds_since(after) if after else None)
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

    def _s3(self, cfg: RunConfig) -> Any:
        return aws_session(cfg.aws_conn_id).client("s3")

    def collect_metrics(self, cfg: RunConfig, trained: dict) -> dict:
        """The report from the trainer's metrics.jsonl and summary.json in the run directory (S3,
        or a shared file system this worker mounts), stored beside the model."""
        result = build_report(cfg.run_dir, lambda: self._s3(cfg), run_id=cfg.run_id,
                              status="success", config=cfg.to_dict(),
                              stages={"train": trained}, gpu=self.gpu_metrics(cfg, trained),
                              node_hourly_price=cfg.node_hourly_price, nodes=cfg.nodes)
        log.info("report of %s: %s", cfg.run_dir, result["report_html"])
        return result

    def gpu_metrics(self, cfg: RunConfig, trained: dict) -> dict:
        """The job's DCGM GPU metrics from Prometheus over the train stage's time window."""
        url, auth = prometheus_endpoint(cfg.prometheus_url, cfg.prometheus_conn_id)
        if not url:
            return missing_section("prometheus", "GPU metrics missing: no prometheus_url or "
                                   "prometheus_conn_id was given for this run", {})
        end = trained.get("finished") or time.time()
        start = trained.get("started") or end - trained["wall_time_s"]
        return prometheus_gpu_metrics(url, namespace=cfg.namespace, auth=auth,
                                      pod_regex=job_pod_regex(trained["job"]), start=start,
                                      end=end)

    def _failed_report(self, cfg: RunConfig) -> dict | None:
        """After a failed run: a failed report of what the trainer left, unless none is needed."""
        s3 = lambda: self._s3(cfg)  # noqa: E731
        if report_exists(cfg.run_dir, s3) or not has_outputs(cfg.run_dir, s3):
            return None
        return build_report(cfg.run_dir, s3, run_id=cfg.run_id, status="failed",
                            config=cfg.to_dict())

    def teardown(self, cfg: RunConfig, snapshot: dict) -> dict:
        """Delete the run's job and ConfigMap, restore the node group; every step is tried."""
        done: dict[str, Any] = {}
        problems: list[str] = []
        try:
            done["deleted"] = self._delete_run_objects(cfg)
        except Exception as exc:  # the node group must be restored even so
            problems.append(f"deleting the run's Kubernetes objects failed: {exc}")
        if cfg.rdzv_backend != "c10d":
            try:  # the id is unique per run; still, leave no keys behind
                done["rendezvous_keys"] = len(delete_rendezvous_keys(
                    proxy_keys_request(self._kube(cfg), cfg.namespace, cfg.etcd_service),
                    cfg.rdzv_id))
            except Exception as exc:  # no etcd service: nothing was kept there
                log.warning("could not delete rendezvous %s's keys on etcd service %s/%s: %s",
                            cfg.rdzv_id, cfg.namespace, cfg.etcd_service, exc)
        try:
            done["scaling_config"] = self._restore_scaling(cfg, snapshot)
        except Exception as exc:
            problems.append(f"restoring node group {cfg.nodegroup} failed: {exc}")
        try:  # after the nodes are given back: the report is not worth an idle GPU
            report = self._failed_report(cfg)
            if report is not None:
                done["report"] = report
        except Exception as exc:
            log.warning("no failed-run report for %s: %s", cfg.run_dir, exc)
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

    def _protect_busy_instances(self, eks: Any, cfg: RunConfig, state: dict) -> dict:
        """Protect from scale-in the instances running other live runs' pods, and lift the
        protection this pipeline set on the others (`state["protected"]`), so that lowering
        desiredSize terminates idle nodes. Best effort: without it scale-in picks as before.

        The protection is the Auto Scaling group's, which EKS managed node groups are made of:
        an ASG whose desired capacity drops terminates unprotected instances only.
        """
        import kubernetes

        try:
            groups = self._describe_nodegroup(eks, cfg).get("resources", {}).get(
                "autoScalingGroups") or []
            if not groups:
                return state
            api = self._kube(cfg)
            core = kubernetes.client.CoreV1Api(api)
            pods = api.sanitize_for_serialization(core.list_namespaced_pod(
                cfg.namespace, label_selector=f"{LABEL_APP}={APP}"))["items"]
            nodes = api.sanitize_for_serialization(core.list_node(
                label_selector=f"{NODEGROUP_LABEL}={cfg.nodegroup}"))["items"]
            busy_nodes = busy_node_names(pods, cfg.rdzv_id,
                                         set(live_reservations(state, time.time())))
            autoscaling = aws_session(cfg.aws_conn_id).client("autoscaling")
            asg = groups[0]["name"]
            members = {i["InstanceId"]: i.get("ProtectedFromScaleIn", False) for i in
                       autoscaling.describe_auto_scaling_groups(
                           AutoScalingGroupNames=[asg])["AutoScalingGroups"][0]["Instances"]}
            busy = {iid for node in nodes if node["metadata"]["name"] in busy_nodes
                    and (iid := instance_id(node)) in members}
            ours = set(state.get("protected") or []) & set(members)
            protect = sorted(i for i in busy if not members[i])
            unprotect = sorted(ours - busy)
            for ids, on in ((protect, True), (unprotect, False)):
                if ids:
                    autoscaling.set_instance_protection(
                        InstanceIds=ids, AutoScalingGroupName=asg, ProtectedFromScaleIn=on)
                    log.info("%s scale-in protection of %s in %s", "set" if on else "lifted",
                             ", ".join(ids), asg)
            return {**state, "protected": sorted((ours | set(protect)) - set(unprotect))}
        except Exception as exc:
            log.warning("could not set the node group's scale-in protection: %s", exc)
            return state

    def _restore_scaling(self, cfg: RunConfig, snapshot: dict) -> dict[str, int]:
        """Remove the run's reservation; give back only what no other live run needs."""
        eks = self._eks(cfg)
        try:
            store = self._reservations(cfg)
            state, _ = store.read()
        except Exception as exc:  # no cluster: no other run can be using the nodes either
            log.warning("reservations unreadable (%s): restoring the run's snapshot", exc)
            state, store = None, None
        if store is None or state is None or not state["baseline"]:
            self._apply_scaling(eks, cfg, dict(snapshot["scaling_config"]))
            return dict(snapshot["scaling_config"])

        def release_own(state: dict) -> dict:
            released = release(state, cfg.rdzv_id, time.time())
            # Before the node group shrinks: the ASG must pick idle nodes, not another run's.
            released = self._protect_busy_instances(eks, cfg, released)
            if not live_reservations(released, time.time()):
                # The last run gives the nodes back before the record says none are held, so
                # a new run's snapshot never takes the raised size for the baseline.
                self._apply_scaling(eks, cfg, released["baseline"])
            return released

        store.update(release_own)
        return self._reconcile_scaling(eks, cfg, store)


def instance_id(node: dict[str, Any]) -> str | None:
    """The EC2 instance of a node: the last part of its providerID (aws:///zone/i-...)."""
    provider = (node.get("spec") or {}).get("providerID") or ""
    last = provider.rsplit("/", 1)[-1]
    return last if provider.startswith("aws://") and last.startswith("i-") else None


def busy_node_names(pods: list[dict[str, Any]], own_run: str,
                    live_runs: set[str]) -> set[str]:
    """Nodes running a Pending or Running pod of another live run of this pipeline."""
    return {
        pod["spec"]["nodeName"] for pod in pods
        if (pod.get("spec") or {}).get("nodeName")
        and (pod.get("status") or {}).get("phase") in ("Pending", "Running")
        and (run := ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_RUN))
        and run != own_run and run in live_runs
    }


def pod_log(core: Any, pod: str, namespace: str, **options: Any) -> str:
    """The training container's log as text."""
    # Raw body: the client (36.x) turns a non-JSON text answer into the repr of its bytes.
    resp = core.read_namespaced_pod_log(pod, namespace, container=CONTAINER_NAME,
                                        _preload_content=False, **options)
    return resp.data.decode("utf-8", errors="replace")


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

