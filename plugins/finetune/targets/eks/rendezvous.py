"""The run's torchrun rendezvous on eks: the etcd service's keys of the run, deleted through
the Kubernetes API server's service proxy (no route from Airflow to the pod network needed), or
the etcd pod restarted (an empty store); c10d needs neither."""

from __future__ import annotations

import json
import logging
import urllib.parse
from typing import Any

from finetune.config import RunConfig
from finetune.etcd import EtcdError, KeysRequest, delete_rendezvous_keys
from finetune.polling import until_true
from finetune.targets.eks.manifests import ETCD_PORT, rendezvous_host

log = logging.getLogger(__name__)


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


def delete_run_keys(api: Any, cfg: RunConfig) -> list[str]:
    """Delete the run's rendezvous keys on the etcd service; the keys deleted."""
    return delete_rendezvous_keys(proxy_keys_request(api, cfg.namespace, cfg.etcd_service),
                                  cfg.rdzv_id)


def reset_rendezvous(api_client: Any, cfg: RunConfig, poll_interval: float,
                     timeout: float) -> dict:
    """The rendezvous stage's result: the rendezvous endpoint, backend and id; the store made clean.

    `api_client` is called only when there is an etcd to reset.
    """
    host, port = rendezvous_host(cfg)
    result = {"backend": cfg.rdzv_backend, "endpoint": f"{host}:{port}",
              "rdzv_id": cfg.rdzv_id, "deleted_keys": 0}
    if cfg.launcher == "trainjob":
        # Kubeflow Trainer gives torchrun PET_MASTER_ADDR/PORT: a static rendezvous whose
        # store lives and dies with node 0's pod. Nothing is kept between runs or restarts.
        log.info("launcher trainjob: Kubeflow Trainer gives torchrun a static c10d rendezvous "
                 "on node 0 (%s:%d); nothing to reset", host, port)
        return {**result, "launcher": "trainjob"}
    if cfg.rdzv_backend == "c10d":
        log.info("c10d rendezvous on worker 0 (%s): no etcd to reset", host)
        return result
    api = api_client()
    if cfg.etcd_reset == "restart":
        restart_etcd(api, cfg, poll_interval, timeout)
        return {**result, "restarted_etcd": True}
    deleted = delete_run_keys(api, cfg)
    log.info("rendezvous id %s: deleted %d stale key(s) on etcd service %s/%s", cfg.rdzv_id,
             len(deleted), cfg.namespace, cfg.etcd_service)
    return {**result, "deleted_keys": len(deleted)}


def restart_etcd(api: Any, cfg: RunConfig, poll_interval: float, timeout: float) -> None:
    """Delete the etcd service's pods and wait for a new one to be Ready (empty store)."""
    import kubernetes

    core = kubernetes.client.CoreV1Api(api)
    service = api.sanitize_for_serialization(core.read_namespaced_service(cfg.etcd_service,
                                                                          cfg.namespace))
    selector = ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items())

    def pods() -> list[dict[str, Any]]:
        return api.sanitize_for_serialization(core.list_namespaced_pod(
            cfg.namespace, label_selector=selector))["items"]

    running = pods()
    old = {p["metadata"]["uid"] for p in running}
    for pod in running:
        core.delete_namespaced_pod(pod["metadata"]["name"], cfg.namespace)
    log.info("deleted etcd pod(s) %s; waiting for the replacement", sorted(old))

    def new_pod_ready() -> bool:
        return any(pod["metadata"]["uid"] not in old and _ready(pod) for pod in pods())

    if not until_true(timeout, poll_interval)(new_pod_ready):
        raise TimeoutError(f"etcd ({cfg.namespace}/{cfg.etcd_service}) has no Ready pod "
                           f"{timeout:.0f}s after the restart")


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
