"""The run's job (a PyTorchJob or a TrainJob: `launchers`), from creation to its end: create (or,
on a retry, adopt) it with the trainer's ConfigMap, read its state and its pods' failures, stream
the leader's log, fail fast on pods the scheduler cannot place, report a failure with each failed
pod's reason and log tail and the first failure of all (the ranks' records and the pods'
deaths), delete it; the preflight's job is started here too, and teardown deletes the run's jobs
and ConfigMaps.

The readers (the launcher's `state`, `pod_failure`, `split_log`) are pure functions on the API's
JSON; the trigger that waits for the job uses the launcher's `state` too.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from finetune.config import RunConfig
from finetune.outputs import run_history, trainer_failures, write_run_file
from finetune.targets.base import StageFailed
from finetune.targets.eks.clients import (
    adopt_or_create,
    create_or_replace,
    delete_object,
    retry_transient,
)
from finetune.targets.eks.launchers import (
    LAUNCHERS,
    PYTORCHJOB,
    TERMINAL,
    Launcher,
    launcher_for,
    pytorchjob_state,
)
from finetune.targets.eks.manifests import (
    LABEL_PROGRAM,
    LABEL_RESTART_ATTEMPT,
    PREFLIGHT,
    TRAIN,
    run_selector,
    trainer_configmap_manifest,
)
from finetune_contract.errors import (
    ERRORS_DIR,
    MAX_MESSAGE_CHARS,
    death_record,
    failure_summary,
)
from finetune_contract.parallel_dims import is_elastic
from finetune_contract.run_history import preemptions

log = logging.getLogger(__name__)

__all__ = ["LAUNCHERS", "TERMINAL", "pytorchjob_state"]
# Waiting reasons that mean the container will not start by itself.
STUCK_REASONS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CrashLoopBackOff",
                 "CreateContainerConfigError", "CreateContainerError")
LOG_TAIL_LINES = 20
DELETE_TIMEOUT_S = 300.0


# -- reading the job and its pods (pure) -----------------------------------------------------


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


# What an eviction usually means (the kubelet's message says which resource).
EVICTED_MEANING = "the kubelet evicted it to reclaim the node's memory or disk"


def pod_death(pod: dict[str, Any]) -> dict[str, Any] | None:
    """The failure record (finetune_contract.errors) of a pod whose training died: its
    container OOMKilled, killed by a signal or exited with a code, or the pod evicted; with the
    node's name and the time the container status gives (None for a pod that did not fail)."""
    status = pod.get("status") or {}
    node = (pod.get("spec") or {}).get("nodeName") or "(not scheduled)"
    where = f"{node} (pod {pod['metadata']['name']})"
    for cs in status.get("containerStatuses") or []:
        for which in ("state", "lastState"):
            term = (cs.get(which) or {}).get("terminated") or {}
            if term.get("exitCode", 0) != 0:
                return death_record(None, int(term["exitCode"]), where,
                                    _epoch(term.get("finishedAt")) or time.time(),
                                    reason=str(term.get("reason") or ""))
    if status.get("reason") == "Evicted":
        since = [_epoch(c.get("lastTransitionTime")) for c in status.get("conditions") or []]
        return {"stage": "train", "type": "Evicted", "rank": None, "node": where,
                "time": max([t for t in since if t] or [time.time()]),
                "message": f"evicted from node {where}: {status.get('message', '')} "
                           f"({EVICTED_MEANING})"[:MAX_MESSAGE_CHARS]}
    return None


def pod_deaths(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """pod_death of every failed pod, earliest first."""
    return sorted(filter(None, map(pod_death, pods)), key=lambda record: record["time"])


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


def _list_jobs(custom: Any, launcher: Launcher, cfg: RunConfig,
               program: str | None = TRAIN) -> list[dict[str, Any]]:
    """The run's jobs of `program` (None: all of them); a job without the label is a training
    (made before preflights had jobs)."""
    jobs = custom.list_namespaced_custom_object(
        launcher.group, launcher.version, cfg.namespace, launcher.plural,
        label_selector=run_selector(cfg))["items"]
    return [j for j in jobs if program is None or
            (j["metadata"].get("labels") or {}).get(LABEL_PROGRAM, TRAIN) == program]


def start_preflight_job(api: Any, cfg: RunConfig, image: str) -> str:
    """The run's preflight job, new: one an earlier try (or an earlier round) left is deleted
    first, so the nodes are measured as they are now."""
    launcher = launcher_for(cfg)
    custom, _ = _apis(api)
    for old in _list_jobs(custom, launcher, cfg, PREFLIGHT):
        delete_job(api, cfg.namespace, old["metadata"]["name"], wait=True, launcher=launcher)
    manifest = launcher.manifest(cfg, image, program=PREFLIGHT)
    custom.create_namespaced_custom_object(launcher.group, launcher.version, cfg.namespace,
                                           launcher.plural, manifest)
    log.info("created %s %s/%s: the preflight of %d node(s)", launcher.kind, cfg.namespace,
             manifest["metadata"]["name"], cfg.nodes)
    return manifest["metadata"]["name"]


def leader_log(api: Any, namespace: str, name: str, launcher: Launcher = PYTORCHJOB) -> str:
    """Rank 0's whole log ('' when its pod is gone)."""
    pods = list_pods(api, namespace, launcher.leader_selector(name))
    if not pods:
        return ""
    leader = max(pods, key=lambda p: (_restart_attempt(p),
                                      p["metadata"].get("creationTimestamp") or ""))
    _, core = _apis(api)
    return pod_log(core, leader["metadata"]["name"], namespace, launcher.container)


def start_job(api: Any, cfg: RunConfig, image: str) -> dict[str, Any]:
    """The trainer's ConfigMap and the run's job (PyTorchJob or TrainJob), created or (on a
    retry) adopted."""
    started = time.time()
    launcher = launcher_for(cfg)
    custom, core = _apis(api)
    create_or_replace(core.create_namespaced_config_map, core.replace_namespaced_config_map,
                      trainer_configmap_manifest(cfg))
    manifest = launcher.manifest(cfg, image)
    name = manifest["metadata"]["name"]
    jobs = _list_jobs(custom, launcher, cfg)
    if _being_deleted(jobs):
        # Past its deadline, or by teardown: a job created now under its name would meet it
        # (409) and adopt it, its deadline counted again from now. Waited out first.
        for going in _being_deleted(jobs):
            delete_job(api, cfg.namespace, going, wait=True, launcher=launcher)
        jobs = _list_jobs(custom, launcher, cfg)
        if _being_deleted(jobs):
            raise RuntimeError(f"{launcher.kind} {', '.join(_being_deleted(jobs))} of the run "
                               f"is still being deleted after {DELETE_TIMEOUT_S:.0f} s (its "
                               "finalizers): a new one is started once it is gone")
    live = [j for j in jobs if not j["metadata"].get("deletionTimestamp")]
    found = live[0] if live else None
    # A retry of a failed job runs it again (from its last checkpoint).
    failed = found is not None and launcher.state(found)[0] == "Failed"
    adopted = adopt_or_create(
        f"{launcher.kind} {cfg.namespace}/{name}", found, failed,
        create=lambda: custom.create_namespaced_custom_object(
            launcher.group, launcher.version, cfg.namespace, launcher.plural, manifest),
        delete=lambda old: delete_job(api, cfg.namespace, old, wait=True, launcher=launcher))
    created = started
    if adopted and found is not None and not failed:  # else the one of the manifest's name
        name = found["metadata"]["name"]
        created = _epoch(found["metadata"].get("creationTimestamp")) or started
    if not adopted:
        log.info("created %s %s/%s: %d node(s) x %d GPU(s), image %s", launcher.kind,
                 cfg.namespace, name, cfg.nodes, cfg.procs_per_node, image)
    return {"job": name, "adopted": adopted, "started": started, "created": created}


def _being_deleted(jobs: list[dict[str, Any]]) -> list[str]:
    return [j["metadata"]["name"] for j in jobs if j["metadata"].get("deletionTimestamp")]


def _epoch(timestamp: str | None) -> float | None:
    """Epoch seconds of an RFC 3339 timestamp of the API (None when absent or unreadable)."""
    try:
        return datetime.datetime.fromisoformat(str(timestamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@retry_transient
def read_job(api: Any, namespace: str, name: str,
             launcher: Launcher = PYTORCHJOB) -> dict[str, Any]:
    custom, _ = _apis(api)
    return custom.get_namespaced_custom_object(launcher.group, launcher.version, namespace,
                                               launcher.plural, name)


def delete_job(api: Any, namespace: str, name: str, wait: bool = False,
               launcher: Launcher = PYTORCHJOB) -> bool:
    """Delete the job and (Foreground) its pods; False when it was not there. With `wait`,
    return once it is gone."""
    import kubernetes

    custom, _ = _apis(api)
    return delete_object(
        lambda: custom.delete_namespaced_custom_object(
            launcher.group, launcher.version, namespace, launcher.plural, name,
            body=kubernetes.client.V1DeleteOptions(propagation_policy="Foreground")),
        lambda: read_job(api, namespace, name, launcher), wait=wait, timeout=DELETE_TIMEOUT_S)


def pod_log(core: Any, pod: str, namespace: str, container: str = PYTORCHJOB.container,
            **options: Any) -> str:
    """The training container's log as text."""
    # Raw body: the client (36.x) turns a non-JSON text answer into the repr of its bytes.
    resp = core.read_namespaced_pod_log(pod, namespace, container=container,
                                        _preload_content=False, **options)
    return resp.data.decode("utf-8", errors="replace")


@retry_transient
def list_pods(api: Any, namespace: str, selector: str) -> list[dict[str, Any]]:
    _, core = _apis(api)
    return api.sanitize_for_serialization(core.list_namespaced_pod(
        namespace, label_selector=selector))["items"]


def job_pods(api: Any, namespace: str, name: str,
             launcher: Launcher = PYTORCHJOB) -> list[dict[str, Any]]:
    return list_pods(api, namespace, launcher.pod_selector(name))


def delete_pods_on(api: Any, namespace: str, pods: list[dict[str, Any]],
                   nodes: list[str]) -> list[str]:
    """Delete the pods (of a job) that run on `nodes`; their names."""
    import kubernetes

    _, core = _apis(api)
    deleted = []
    for pod in pods:
        if (pod.get("spec") or {}).get("nodeName") in nodes:
            try:
                core.delete_namespaced_pod(pod["metadata"]["name"], namespace)
                deleted.append(pod["metadata"]["name"])
            except kubernetes.client.ApiException as exc:
                if exc.status != 404:
                    raise
    return deleted


def unschedulable_pods(api: Any, namespace: str, name: str,
                       launcher: Launcher = PYTORCHJOB) -> list[tuple[str, int, str]]:
    """(pod, seconds, the scheduler's message) of the job's pods the scheduler could not place
    (PodScheduled False, reason Unschedulable: what a FailedScheduling event also says)."""
    found = []
    for pod in list_pods(api, namespace, launcher.pod_selector(name)):
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


def fail_unschedulable(api: Any, cfg: RunConfig, name: str, launcher: Launcher) -> None:
    """Fail fast, with the scheduler's words, when a pod of the job has waited to be placed for
    schedule_timeout_s or more (0: never). An elastic run goes on while min_nodes of its pods
    are placed: the others wait for their nodes, and join when one comes."""
    pending = unschedulable_pods(api, cfg.namespace, name, launcher)
    stuck = [(pod, seconds, why) for pod, seconds, why in pending
             if cfg.schedule_timeout_s and seconds >= cfg.schedule_timeout_s]
    if stuck and is_elastic(cfg):
        placed = len(job_pods(api, cfg.namespace, name, launcher)) - len(pending)
        if placed >= cfg.min_nodes:
            log.warning("%d pod(s) of %s %s wait for a node (%s): the training goes on with %d "
                        "of %d nodes (min_nodes %d); they join when nodes come", len(pending),
                        launcher.kind, name, pending[0][2], placed, cfg.nodes, cfg.min_nodes)
            return
    if stuck:
        raise StageFailed(
            f"{len(stuck)} pod(s) of {launcher.kind} {name} could not be scheduled for "
            f"{cfg.schedule_timeout_s} s or more (schedule_timeout_s); the scheduler "
            "says:\n" + "\n".join(f"{pod} ({seconds} s): {why}"
                                  for pod, seconds, why in stuck))


def count_preemptions(api: Any, cfg: RunConfig, name: str, launcher: Launcher,
                      s3_client: Callable[[], Any], seen: list[str]) -> tuple[int, str, list[str]]:
    """(preemptions so far, what counted them, the restarts seen at the looks so far).

    The trainer records each notice it saved in history.jsonl in the run's output (S3 or a
    volume this worker mounts), and each node a notice before its round's first step beside it
    (finetune_contract.run_history; outputs.run_history merges them): that count, where it can
    be read. Else each restart the job shows at a look (the launcher's `restarts`: a
    PyTorchJob's Restarting condition, a TrainJob's pods that exited 138) counts once; a
    restart that begins and ends between two looks is missed."""
    marks = sorted(set(seen) | launcher.restarts(read_job(api, cfg.namespace, name, launcher),
                                                 job_pods(api, cfg.namespace, name, launcher)))
    try:
        events = run_history(cfg.run_dir, s3_client)
    except Exception as exc:  # S3 unreachable or refused: the job's own restarts say it
        log.info("history.jsonl of %s cannot be read (%s): counting %s %s's restarts", cfg.run_dir,
                 exc, launcher.kind, name)
        events = None
    if events is None:
        return len(marks), f"the restarts of {launcher.kind} {name} seen", marks
    return len(preemptions(events)), f"{cfg.run_dir}/history.jsonl", marks


def _restart_attempt(pod: dict[str, Any]) -> int:
    value = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_RESTART_ATTEMPT, "0")
    return int(value) if value.isdigit() else 0


def stream_leader_log(api: Any, namespace: str, name: str, after: str,
                      launcher: Launcher = PYTORCHJOB) -> str:
    """Copy rank 0's log lines newer than timestamp `after` into the task log; the newest."""
    import kubernetes

    pods = list_pods(api, namespace, launcher.leader_selector(name))
    if not pods:
        return after
    # After a JobSet restart the newest attempt's pod leads (the old one may still be there).
    leader = max(pods, key=lambda p: (_restart_attempt(p),
                                      p["metadata"].get("creationTimestamp") or ""))
    _, core = _apis(api)
    try:
        text = pod_log(core, leader["metadata"]["name"], namespace, launcher.container,
                       timestamps=True, since_seconds=_seconds_since(after) if after else None)
    except kubernetes.client.ApiException as exc:
        if exc.status in (400, 404):  # not started yet, or gone
            return after
        raise
    lines, after = split_log(text, after)
    for line in lines:
        log.info("[rank 0] %s", line)
    return after


def failed_pods(api: Any, namespace: str, name: str,
                launcher: Launcher = PYTORCHJOB) -> list[dict[str, Any]]:
    """The failure records of the job's pods that died, earliest first (pod_deaths)."""
    return pod_deaths(list_pods(api, namespace, launcher.pod_selector(name)))


def failure_report(api: Any, namespace: str, name: str, message: str,
                   launcher: Launcher = PYTORCHJOB) -> str:
    """The job's failure with each failed pod's reason and the tail of its log."""

    _, core = _apis(api)
    parts = [f"{launcher.kind} {namespace}/{name} failed: {message}"]
    pods = list_pods(api, namespace, launcher.pod_selector(name))
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        reason = pod_failure(pod)
        if reason is None:
            continue
        pod_name = pod["metadata"]["name"]
        parts.append(f"pod {pod_name}: {reason}")
        tail = log_tail(core, pod_name, namespace, launcher.container)
        if tail:
            parts.append(tail)
    return "\n".join(parts)


def log_tail(core: Any, pod: str, namespace: str, container: str = PYTORCHJOB.container) -> str:
    """A pod's last LOG_TAIL_LINES log lines, indented under its name, for a failure's message;
    "" when it has none or they cannot be read."""
    import kubernetes

    try:
        text = pod_log(core, pod, namespace, container, tail_lines=LOG_TAIL_LINES)
    except kubernetes.client.ApiException:
        return ""
    if not text.strip():
        return ""
    return f"  last lines of {pod}:\n" + "\n".join(
        "    " + line for line in text.splitlines()[-LOG_TAIL_LINES:])


def first_failure(api: Any, cfg: RunConfig, name: str, launcher: Launcher,
                  s3_client: Callable[[], Any]) -> str:
    """The failures by time, first the first: the ranks' own records (on the output) and the
    pods that died (their container status, with the node); each dead pod's record is stored
    with the ranks' so the failed report names it too."""
    deaths = failed_pods(api, cfg.namespace, name, launcher)
    try:
        records = trainer_failures(cfg.run_dir, s3_client)
        # an output on a volume the pods mount is not mounted here: nothing to store there
        for record in deaths if cfg.run_dir.startswith("s3://") else []:
            pod = record["node"].rsplit("(pod ", 1)[-1].rstrip(")")
            write_run_file(cfg.run_dir, s3_client, f"{ERRORS_DIR}/pod_{pod}.json",
                           json.dumps(record))
    except Exception as exc:  # the pods' reasons still say what happened
        log.warning("could not read or store the failure records: %s", exc)
        records = []
    # a pod's record stored by an earlier read is the one derived again above
    records = [r for r in records if "(pod " not in str(r.get("node", ""))]
    return failure_summary(sorted(records + deaths, key=lambda record: record["time"]))


def train_result(cfg: RunConfig, job: dict, image: dict, rendezvous: dict) -> dict:
    """What train returns (to XCom): the job, its time window (for the GPU metrics), the
    image and the rendezvous it ran with."""
    finished = time.time()
    return {"job": job["job"], "namespace": cfg.namespace, "adopted": job["adopted"],
            "started": job["started"], "finished": finished,
            "wall_time_s": round(finished - job["started"], 1), "image": image["image"],
            "image_tag": image.get("image_tag"),
            "rendezvous": {k: rendezvous[k] for k in ("backend", "rdzv_id")}}


def delete_run_jobs(api: Any, cfg: RunConfig) -> list[str]:
    """Delete the run's jobs (PyTorchJob or TrainJob: training, preflight, evaluation), found
    by the run's label; what was deleted."""
    launcher = launcher_for(cfg)
    custom, _ = _apis(api)
    deleted = []
    for job in _list_jobs(custom, launcher, cfg, program=None):
        if delete_job(api, cfg.namespace, job["metadata"]["name"], launcher=launcher):
            deleted.append(f"{launcher.name}/{job['metadata']['name']}")
    return deleted


def delete_run_configmaps(api: Any, cfg: RunConfig) -> list[str]:
    """Delete the run's ConfigMaps (the trainer config its jobs and prepare pod mount), found
    by the run's label; what was deleted."""
    import kubernetes

    _, core = _apis(api)
    deleted = []
    for cm in core.list_namespaced_config_map(cfg.namespace,
                                              label_selector=run_selector(cfg)).items:
        try:
            core.delete_namespaced_config_map(cm.metadata.name, cfg.namespace)
            deleted.append(f"configmap/{cm.metadata.name}")
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise
    return deleted
