"""The health of the run's nodes: the preflight job's verdict (what rank 0 measured, judged by
`finetune.preflight_verdict` against the instance type's profile and the nodes' XID errors,
stored beside the run's outputs), the XID errors DCGM reports for their GPUs (read from
Prometheus), a bad node cordoned so no new pod lands there, the training's pods on it deleted
so they restart elsewhere (`move_off_xid_nodes`, while it trains), and its EC2 instance
replaced through the node group's Auto Scaling group (`replace_bad_nodes`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from finetune.config import RunConfig
from finetune.gpu_metrics import prometheus_endpoint, xid_codes_by_node
from finetune.outputs import write_run_file
from finetune.preflight_verdict import (
    PREFLIGHT_FILE,
    XID_WINDOW_S,
    PreflightFailed,
    judge,
    result_line,
    summary_line,
)
from finetune.targets.base import StageFailed
from finetune.targets.eks import job
from finetune.targets.eks.clients import aws_session
from finetune.targets.eks.launchers import Launcher, launcher_for
from finetune.targets.eks.manifests import PREFLIGHT_DEADLINE_S
from finetune.targets.eks.nodegroup import describe_nodegroup, instance_id
from finetune_contract.instance_types import INSTANCE_TYPES

log = logging.getLogger(__name__)


def has_prometheus(cfg: RunConfig) -> bool:
    return bool(prometheus_endpoint(cfg.prometheus_url, cfg.prometheus_conn_id)[0])


def xid_codes(cfg: RunConfig, nodes: list[str], window_s: float) -> dict[str, list[int]]:
    """XID codes per node over the last `window_s` seconds (DCGM via Prometheus); {} without
    Prometheus, or when it cannot be read (a warning says so: the other checks still ran)."""
    url, auth = prometheus_endpoint(cfg.prometheus_url, cfg.prometheus_conn_id)
    if not url:
        return {}
    try:
        return xid_codes_by_node(url, auth, nodes, time.time(), window_s)
    except Exception as exc:
        log.warning("could not read XID errors from Prometheus: %s", exc)
        return {}


def preflight_failure(api: Any, cfg: RunConfig, name: str, event: dict) -> PreflightFailed:
    """The preflight job failed or ran past PREFLIGHT_DEADLINE_S (`event`, JobTrigger's): the
    error to raise, with the pods' reasons; the job is deleted."""
    launcher = launcher_for(cfg)
    report = job.failure_report(api, cfg.namespace, name, event["message"], launcher)
    job.delete_job(api, cfg.namespace, name, launcher=launcher)
    why = ("did not finish in PREFLIGHT_DEADLINE_S = "
           f"{PREFLIGHT_DEADLINE_S} s (a collective that hangs: a node's NCCL/EFA)"
           if event["status"] == "deadline" else "failed")
    return PreflightFailed(f"preflight {why}:\n{report}")


def preflight_verdict(api: Any, cfg: RunConfig, name: str,
                      s3_client: Callable[[], Any]) -> dict[str, Any]:
    """The verdict on the nodes of the preflight job that succeeded: rank 0's result line
    judged against the instance type's profile and the nodes' XIDs of the last hour, stored
    as preflight.json in the run directory; the job is deleted once its log is read."""
    launcher = launcher_for(cfg)
    measured = result_line(job.leader_log(api, cfg.namespace, name, launcher))
    job.delete_job(api, cfg.namespace, name, launcher=launcher)
    if measured is None:
        raise PreflightFailed(f"preflight {launcher.kind} {name} succeeded but its rank 0 "
                              "printed no result")
    nodes = sorted({r["node_name"] for r in measured["ranks"]})
    verdict = judge(measured, INSTANCE_TYPES[cfg.instance_type],
                    xid_codes(cfg, nodes, XID_WINDOW_S))
    write_run_file(cfg.run_dir, s3_client, PREFLIGHT_FILE, json.dumps(verdict, indent=2))
    log.info("preflight: %s", summary_line(verdict))
    return verdict


def cordon_nodes(api: Any, names: list[str]) -> list[str]:
    """Mark the nodes unschedulable (kubectl cordon): no new pod of any run lands there."""
    import kubernetes

    core = kubernetes.client.CoreV1Api(api)
    for name in names:
        core.patch_node(name, {"spec": {"unschedulable": True}})
        log.warning("cordoned node %s", name)
    return list(names)


def replace_nodes(eks: Any, api: Any, cfg: RunConfig, names: list[str]) -> list[str]:
    """Terminate the instances of the nodes `names` in the node group's Auto Scaling group
    without lowering its desired capacity, so the group launches a new instance for each;
    the instance ids terminated."""
    import kubernetes

    groups = describe_nodegroup(eks, cfg).get("resources", {}).get("autoScalingGroups") or []
    if not groups:
        raise StageFailed(f"node group {cfg.nodegroup} has no Auto Scaling group to replace "
                           f"nodes {', '.join(names)} with")
    core = kubernetes.client.CoreV1Api(api)
    autoscaling = aws_session(cfg.aws_conn_id).client("autoscaling")
    terminated = []
    for name in names:
        node = api.sanitize_for_serialization(core.read_node(name))
        iid = instance_id(node)
        if iid is None:
            raise StageFailed(f"node {name} has no EC2 instance in its providerID: cannot "
                               "replace it")
        autoscaling.terminate_instance_in_auto_scaling_group(
            InstanceId=iid, ShouldDecrementDesiredCapacity=False)
        log.warning("terminated %s (node %s): %s launches a new instance", iid, name,
                    groups[0]["name"])
        terminated.append(iid)
    return terminated


def move_off_xid_nodes(eks: Callable[[], Any], api: Any, cfg: RunConfig, name: str,
                       launcher: Launcher, state: dict) -> dict:
    """A node of the training whose GPUs raised XID errors (DCGM) since the job started is
    cordoned and its pods of the job deleted, so the restart they cause lands elsewhere (on
    the node replace_bad_nodes brings, or it waits schedule_timeout_s and fails). `state` is
    the train stage's; the nodes cordoned are added to its "cordoned"."""
    if not has_prometheus(cfg):
        return state
    done = set(state.get("cordoned") or [])
    pods = job.job_pods(api, cfg.namespace, name, launcher)
    nodes = sorted({p["spec"]["nodeName"] for p in pods if p["spec"].get("nodeName")} - done)
    xids = xid_codes(cfg, nodes, max(60.0, time.time() - state["job"]["created"]))
    if not xids:
        return state
    bad = sorted(xids)
    cordon_nodes(api, bad)
    evicted = job.delete_pods_on(api, cfg.namespace, pods, bad)
    log.warning("XID error(s) on %s: cordoned, and deleted the job's pods there (%s) so "
                "they restart on other nodes", "; ".join(
                    f"{n} (XID {', '.join(map(str, c))})" for n, c in xids.items()),
                ", ".join(evicted) or "none")
    if cfg.replace_bad_nodes:
        replace_nodes(eks(), api, cfg, bad)
    return {**state, "cordoned": sorted(done | set(bad))}
