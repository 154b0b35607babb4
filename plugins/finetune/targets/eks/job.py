"""The run's PyTorchJob, from creation to its end: create (or, on a retry, adopt) it with the
trainer's ConfigMap, read its state and its pods' failures, stream the leader's log, report a
failure with each failed pod's reason and log tail, delete it.

The readers (`pytorchjob_state`, `pod_failure`, `split_log`) are pure functions on the API's
JSON; the trigger that waits for the job uses `pytorchjob_state` too.
"""

from __future__ import annotations

import datetime
import logging
import math
import time
from typing import Any

from finetune.config import RunConfig
from finetune.targets.eks.clients import (
    adopt_or_create,
    create_or_replace,
    delete_object,
    retry_transient,
)
from finetune.targets.eks.manifests import (
    CONTAINER_NAME,
    LABEL_JOB_NAME,
    LABEL_REPLICA_INDEX,
    LABEL_REPLICA_TYPE,
    PYTORCHJOB_GROUP,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
    pytorchjob_manifest,
    run_selector,
    trainer_configmap_manifest,
)

log = logging.getLogger(__name__)

TERMINAL = ("Succeeded", "Failed")
# Waiting reasons that mean the container will not start by itself.
STUCK_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CrashLoopBackOff",
                 "CreateContainerConfigError", "CreateContainerError")
LOG_TAIL_LINES = 20
DELETE_TIMEOUT_S = 300.0


# -- reading the job and its pods (pure) -----------------------------------------------------


def pytorchjob_state(job: dict[str, Any]) -> tuple[str, str]:
    """(state, message): Succeeded or Failed once finished, else the newest true condition."""
    conditions = (job.get("status") or {}).get("conditions") or []
    true = [c for c in conditions if c.get("status") == "True"]
    for terminal in TERMINAL:
        for c in true:
            if c.get("type") == terminal:
                return terminal, c.get("message") or c.get("reason") or ""
    if true:
        return true[-1].get("type", "Unknown"), true[-1].get("message") or ""
    return "Pending", ""


def pod_failure(pod: dict[str, Any]) -> str | None:
    """Why a pod failed or cannot run (OOMKilled, exit code, image pull...), or None."""
    status = pod.get("status") or {}
    reasons = []
    if status.get("reason"):  # for example Evicted
        reasons.append(f"{status['reason']}: {status.get('message', '')}".rstrip(": "))
    for cs in status.get("containerStatuses") or []:
        for which in ("state", "lastState"):
            state = cs.get(which) or {}
            term = state.get("terminated")
            if term and term.get("exitCode", 0) != 0:
                what = term.get("reason") or "Error"
                reasons.append(f"container {cs.get('name')} {what} (exit code "
                               f"{term.get('exitCode')})" + (
                                   f": {term['message']}" if term.get("message") else ""))
                break
            wait = state.get("waiting")
            if wait and wait.get("reason") in STUCK_REASONS:
                reasons.append(f"container {cs.get('name')} {wait['reason']}"
                               + (f": {wait['message']}" if wait.get("message") else ""))
                break
    if not reasons and status.get("phase") == "Failed":
        reasons.append("Failed")
    return "; ".join(reasons) or None


def split_log(text: str, after: str) -> tuple[list[str], str]:
    """Lines of a `timestamps=true` pod log newer than timestamp `after`; and the newest one.

    Kubernetes prefixes each line with an RFC 3339 timestamp of fixed width, so timestamps
    compare as strings.
    """
    lines, newest = [], after
    for raw in text.splitlines():
        ts, _, line = raw.partition(" ")
        if ts > after:
            lines.append(line)
            newest = max(newest, ts)
    return lines, newest


def _seconds_since(timestamp: str) -> int:
    """Seconds since a pod log's RFC 3339 timestamp, with a margin for clock skew."""
    then = datetime.datetime.fromisoformat(timestamp[:19]).replace(tzinfo=datetime.UTC)
    return max(1, math.ceil((datetime.datetime.now(datetime.UTC) - then).total_seconds()) + 30)


# -- the job's lifecycle ---------------------------------------------------------------------


def _apis(api: Any) -> tuple[Any, Any]:
    import kubernetes

    return kubernetes.client.CustomObjectsApi(api), kubernetes.client.CoreV1Api(api)


def start_job(api: Any, cfg: RunConfig, image: str) -> dict[str, Any]:
    """The trainer's ConfigMap and the run's PyTorchJob, created or (on a retry) adopted."""
    started = time.time()
    custom, core = _apis(api)
    create_or_replace(core.create_namespaced_config_map, core.replace_namespaced_config_map,
                      trainer_configmap_manifest(cfg))
    manifest = pytorchjob_manifest(cfg, image)
    name = manifest["metadata"]["name"]
    existing = custom.list_namespaced_custom_object(
        PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, cfg.namespace, PYTORCHJOB_PLURAL,
        label_selector=run_selector(cfg))["items"]
    live = [j for j in existing if not j["metadata"].get("deletionTimestamp")]
    found = live[0] if live else None
    # A retry of a failed job runs it again (from its last checkpoint).
    failed = found is not None and pytorchjob_state(found)[0] == "Failed"
    adopted = adopt_or_create(
        f"PyTorchJob {cfg.namespace}/{name}", found, failed,
        create=lambda: custom.create_namespaced_custom_object(
            PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, cfg.namespace, PYTORCHJOB_PLURAL, manifest),
        delete=lambda old: delete_job(api, cfg.namespace, old, wait=True))
    if adopted and found is not None and not failed:  # else the one of the manifest's name
        name = found["metadata"]["name"]
    if not adopted:
        log.info("created PyTorchJob %s/%s: %d node(s) x %d GPU(s), image %s", cfg.namespace,
                 name, cfg.nodes, cfg.procs_per_node, image)
    return {"job": name, "adopted": adopted, "started": started}


@retry_transient
def read_job(api: Any, namespace: str, name: str) -> dict[str, Any]:
    custom, _ = _apis(api)
    return custom.get_namespaced_custom_object(PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, namespace,
                                               PYTORCHJOB_PLURAL, name)


def delete_job(api: Any, namespace: str, name: str, wait: bool = False) -> bool:
    """Delete the job and (Foreground) its pods; False when it was not there. With `wait`,
    return once it is gone."""
    import kubernetes

    custom, _ = _apis(api)
    return delete_object(
        lambda: custom.delete_namespaced_custom_object(
            PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, namespace, PYTORCHJOB_PLURAL, name,
            body=kubernetes.client.V1DeleteOptions(propagation_policy="Foreground")),
        lambda: read_job(api, namespace, name), wait=wait, timeout=DELETE_TIMEOUT_S)


def pod_log(core: Any, pod: str, namespace: str, **options: Any) -> str:
    """The training container's log as text."""
    # Raw body: the client (36.x) turns a non-JSON text answer into the repr of its bytes.
    resp = core.read_namespaced_pod_log(pod, namespace, container=CONTAINER_NAME,
                                        _preload_content=False, **options)
    return resp.data.decode("utf-8", errors="replace")


@retry_transient
def _pods(api: Any, namespace: str, selector: str) -> list[dict[str, Any]]:
    _, core = _apis(api)
    return api.sanitize_for_serialization(core.list_namespaced_pod(
        namespace, label_selector=selector))["items"]


def unschedulable_pods(api: Any, namespace: str, name: str) -> list[tuple[str, int, str]]:
    """(pod, seconds, the scheduler's message) of the job's pods the scheduler could not place
    (PodScheduled False, reason Unschedulable: what a FailedScheduling event also says)."""
    found = []
    for pod in _pods(api, namespace, f"{LABEL_JOB_NAME}={name}"):
        if (pod.get("status") or {}).get("phase") != "Pending":
            continue
        for condition in (pod.get("status") or {}).get("conditions") or []:
            if condition.get("type") == "PodScheduled" and condition.get("status") == "False" \
                    and condition.get("reason") == "Unschedulable":
                since = condition.get("lastTransitionTime") or \
                    pod["metadata"].get("creationTimestamp")
                seconds = _seconds_since(since) - 30 if since else 0
                found.append((pod["metadata"]["name"], seconds, condition.get("message", "")))
    return sorted(found)


def stream_leader_log(api: Any, namespace: str, name: str, after: str) -> str:
    """Copy worker 0's log lines newer than timestamp `after` into the task log; the newest."""
    import kubernetes

    pods = _pods(api, namespace, f"{LABEL_JOB_NAME}={name},{LABEL_REPLICA_TYPE}=worker,"
                                 f"{LABEL_REPLICA_INDEX}=0")
    if not pods:
        return after
    _, core = _apis(api)
    try:
        text = pod_log(core, pods[0]["metadata"]["name"], namespace, timestamps=True,
                       since_seconds=_seconds_since(after) if after else None)
    except kubernetes.client.ApiException as exc:
        if exc.status in (400, 404):  # not started yet, or gone
            return after
        raise
    lines, after = split_log(text, after)
    for line in lines:
        log.info("[worker 0] %s", line)
    return after


def failure_report(api: Any, namespace: str, name: str, message: str) -> str:
    """The job's failure with each failed pod's reason and the tail of its log."""
    import kubernetes

    _, core = _apis(api)
    parts = [f"PyTorchJob {namespace}/{name} failed: {message}"]
    pods = _pods(api, namespace, f"{LABEL_JOB_NAME}={name}")
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        reason = pod_failure(pod)
        if reason is None:
            continue
        pod_name = pod["metadata"]["name"]
        parts.append(f"pod {pod_name}: {reason}")
        try:
            tail = pod_log(core, pod_name, namespace, tail_lines=LOG_TAIL_LINES)
        except kubernetes.client.ApiException:
            tail = ""
        if tail.strip():
            parts.append(f"  last lines of {pod_name}:\n" + "\n".join(
                "    " + line for line in tail.splitlines()[-LOG_TAIL_LINES:]))
    return "\n".join(parts)


def train_result(cfg: RunConfig, job: dict, image: dict, rendezvous: dict) -> dict:
    """What train returns (to XCom): the job, its time window (for the GPU metrics), the
    image and the rendezvous it ran with."""
    finished = time.time()
    return {"job": job["job"], "namespace": cfg.namespace, "adopted": job["adopted"],
            "started": job["started"], "finished": finished,
            "wall_time_s": round(finished - job["started"], 1), "image": image["image"],
            "image_tag": image.get("image_tag"),
            "rendezvous": {k: rendezvous[k] for k in ("backend", "rdzv_id")}}


def delete_run_objects(api: Any, cfg: RunConfig) -> list[str]:
    """Delete the run's PyTorchJob(s) and ConfigMap(s), found by the run's label."""
    import kubernetes

    custom, core = _apis(api)
    deleted = []
    for job in custom.list_namespaced_custom_object(
            PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, cfg.namespace, PYTORCHJOB_PLURAL,
            label_selector=run_selector(cfg))["items"]:
        if delete_job(api, cfg.namespace, job["metadata"]["name"]):
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
