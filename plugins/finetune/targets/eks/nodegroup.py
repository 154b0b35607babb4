"""The run's EKS managed node group: its scaling config (read, sized from the reservations,
updated one change at a time), the run's nodes reserved (`reserve_nodes`) and given back
(`give_back_nodes`), its instance type (resolved from the node group, checked against the
run's), which of its nodes are usable, and the Auto Scaling group's scale-in protection of the
nodes other runs train on.

`node_readiness` and `usable_nodes` are pure; the trigger that waits for the nodes uses them.
Bad nodes (cordoned, replaced) are `node_health`'s.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable
from typing import Any

import tenacity

from finetune.config import RunConfig
from finetune.targets.eks.clients import aws_session, retry_transient
from finetune.targets.eks.manifests import (
    APP,
    INSTANCE_TYPE_LABEL,
    LABEL_APP,
    LABEL_RUN,
    NODEGROUP_LABEL,
)
from finetune.targets.eks.reservations import (
    SCALING_KEYS,
    ReservationStore,
    live_reservations,
    record_baseline,
    release,
    reserve,
    wanted_scaling,
)
from finetune_contract.instance_types import EFA_RESOURCE, GPU_RESOURCE

log = logging.getLogger(__name__)


# -- the node group in EKS -------------------------------------------------------------------


@retry_transient
def describe_nodegroup(eks: Any, cfg: RunConfig) -> dict[str, Any]:
    return eks.describe_nodegroup(clusterName=cfg.cluster_name,
                                  nodegroupName=cfg.nodegroup)["nodegroup"]


def current_scaling(eks: Any, cfg: RunConfig) -> dict[str, int]:
    scaling = describe_nodegroup(eks, cfg)["scalingConfig"]
    return {k: scaling[k] for k in SCALING_KEYS}


def resolve_instance_type(eks: Any, cfg: RunConfig) -> str:
    """The node group's instance type, which the run's `instance_type` must be: a mismatch is
    refused (the GPUs, EFA and node selector of the run would not fit the nodes)."""
    types = describe_nodegroup(eks, cfg).get("instanceTypes") or []
    if not types:  # set in a launch template: EKS does not say; the param is all we have
        log.info("node group %s names no instance types: using instance_type %s",
                 cfg.nodegroup, cfg.instance_type)
        return cfg.instance_type
    if cfg.instance_type not in types:
        raise ValueError(f"instance_type is {cfg.instance_type}, but node group {cfg.nodegroup} "
                         f"of cluster {cfg.cluster_name} has instanceTypes {', '.join(types)}: "
                         "set instance_type to the node group's")
    return cfg.instance_type


def update_scaling(eks: Any, cfg: RunConfig, scaling: dict[str, int], attempts: int,
                   wait_s: float) -> None:
    """update_nodegroup_config, retried while another update of the node group is in progress
    (EKS takes one at a time)."""
    for attempt in tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(eks.exceptions.ResourceInUseException),
            stop=tenacity.stop_after_attempt(attempts), wait=tenacity.wait_fixed(wait_s),
            reraise=True):
        with attempt:
            eks.update_nodegroup_config(clusterName=cfg.cluster_name,
                                        nodegroupName=cfg.nodegroup, scalingConfig=scaling)


def apply_scaling(eks: Any, cfg: RunConfig, wanted: dict[str, int], attempts: int,
                  wait_s: float) -> None:
    current = current_scaling(eks, cfg)
    if wanted != current:
        log.info("scaling node group %s from %s to %s", cfg.nodegroup, current, wanted)
        update_scaling(eks, cfg, wanted, attempts, wait_s)


def reconcile_scaling(eks: Any, cfg: RunConfig, store: ReservationStore, attempts: int,
                      wait_s: float) -> dict[str, int]:
    """Size the node group from the latest reservations until they stop changing.

    Whoever changes the reservations last also sizes the node group last, from them.
    """
    def size_from_latest() -> dict[str, int] | None:
        """The size applied, or None when the reservations changed meanwhile."""
        state, version = store.read()
        wanted = wanted_scaling(state, time.time())
        apply_scaling(eks, cfg, wanted, attempts, wait_s)
        return wanted if store.read()[1] == version else None

    sized = tenacity.Retrying(retry=tenacity.retry_if_result(lambda wanted: wanted is None),
                              stop=tenacity.stop_after_attempt(attempts),
                              retry_error_callback=lambda _: None)(size_from_latest)
    if sized is None:
        raise RuntimeError(f"the reservations of node group {cfg.nodegroup} kept changing")
    return sized


def reserve_nodes(eks: Any, cfg: RunConfig, store: ReservationStore, ttl: float,
                  attempts: int, wait_s: float) -> dict[str, int]:
    """Reserve the run's nodes (the baseline recorded first when no run holds any; refused
    above max_nodes) and size the node group for every live reservation; the size applied."""
    store.update(lambda state: reserve(record_baseline(state, current_scaling(eks, cfg)),
                                       cfg.rdzv_id, cfg.nodes, time.time(), cfg.max_nodes, ttl))
    return reconcile_scaling(eks, cfg, store, attempts, wait_s)


def give_back_nodes(eks: Any, kube: Callable[[], Any], cfg: RunConfig, snapshot: dict,
                    store: Callable[[], ReservationStore], attempts: int,
                    wait_s: float) -> dict[str, int]:
    """Remove the run's reservation; give back only what no other live run needs. Without
    reservations (none recorded, or the cluster unreachable) the run's snapshot is restored."""
    try:
        reservations = store()
        state, _ = reservations.read()
    except Exception as exc:  # no cluster: no other run can be using the nodes either
        log.warning("reservations unreadable (%s): restoring the run's snapshot", exc)
        state = None
    if state is None or not state["baseline"]:
        apply_scaling(eks, cfg, dict(snapshot["scaling_config"]), attempts, wait_s)
        return dict(snapshot["scaling_config"])

    def release_own(state: dict) -> dict:
        released = release(state, cfg.rdzv_id, time.time())
        # Before the node group shrinks: the ASG must pick idle nodes, not another run's.
        released = protect_busy_instances(eks, kube(), cfg, released)
        if not live_reservations(released, time.time()):
            # The last run gives the nodes back before the record says none are held, so
            # a new run's snapshot never takes the raised size for the baseline.
            apply_scaling(eks, cfg, released["baseline"], attempts, wait_s)
        return released

    reservations.update(release_own)
    return reconcile_scaling(eks, cfg, reservations, attempts, wait_s)


# -- its nodes in Kubernetes (pure) ----------------------------------------------------------


def node_readiness(node: dict[str, Any], gpus: int, efa: int,
                   instance_type: str = "") -> tuple[bool, str]:
    """(usable, summary): Ready, schedulable, of the instance type (when labelled), with the
    GPUs (and EFA) a worker requests."""
    status = node.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    ready = conditions.get("Ready", {})
    allocatable = status.get("allocatable") or {}
    have_gpus = int(allocatable.get(GPU_RESOURCE, 0))
    have_efa = int(allocatable.get(EFA_RESOURCE, 0))
    labels = (node.get("metadata") or {}).get("labels") or {}
    have_type = labels.get(INSTANCE_TYPE_LABEL, instance_type)
    type_ok = not instance_type or have_type == instance_type
    ok = (ready.get("status") == "True" and have_gpus >= gpus and have_efa >= efa and type_ok
          and not (node.get("spec") or {}).get("unschedulable"))
    name = (node.get("metadata") or {}).get("name")
    detail = f"Ready={ready.get('status', 'Unknown')}"
    if ready.get("status") != "True" and (ready.get("reason") or ready.get("message")):
        detail += f" ({ready.get('reason', '')}: {ready.get('message', '')})"
    detail += f", {GPU_RESOURCE}={have_gpus}" + (f", {EFA_RESOURCE}={have_efa}" if efa else "")
    if not type_ok:
        detail += f", instance type {have_type}, not {instance_type}"
    return ok, f"{name}: {detail}"


def usable_nodes(nodes: list[dict[str, Any]], gpus: int, efa: int,
                 instance_type: str = "") -> tuple[list[str], str]:
    """(names of the usable nodes, a summary of every node's state) for a timeout message."""
    states = [node_readiness(n, gpus, efa, instance_type) for n in nodes]
    usable = [s.split(":", 1)[0] for ok, s in states if ok]
    return usable, "; ".join(s for _, s in states) or "no nodes registered"


# The device plugins that advertise each resource, as a missing one is named.
DEVICE_PLUGINS = {
    GPU_RESOURCE: "the NVIDIA device plugin (kube-system daemonset nvidia-device-plugin-daemonset)",
    EFA_RESOURCE: "the EFA device plugin (kube-system daemonset "
                  "aws-efa-k8s-device-plugin-daemonset; see containers/k8s/"
                  "efa-device-plugin-patch.yaml for GPU-tainted nodes)",
}


def missing_devices(nodes: list[dict[str, Any]], gpus: int, efa: int, instance_type: str,
                    grace_s: float, now: float) -> str | None:
    """Why nodes Ready for `grace_s` or more still cannot take a worker: the GPUs or EFA they
    do not advertise, and the device plugin that should; None while none is like that. The
    time comes from the Ready condition's lastTransitionTime, so a restarted trigger agrees."""
    problems = []
    for node in nodes:
        status = node.get("status") or {}
        ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
        labels = (node.get("metadata") or {}).get("labels") or {}
        since = ready.get("lastTransitionTime")
        if ready.get("status") != "True" or not since or \
                labels.get(INSTANCE_TYPE_LABEL, instance_type) != instance_type:
            continue
        ready_for = now - datetime.datetime.fromisoformat(since.replace("Z", "+00:00")).timestamp()
        if ready_for < grace_s:
            continue
        allocatable = status.get("allocatable") or {}
        for resource, needed in ((GPU_RESOURCE, gpus), (EFA_RESOURCE, efa)):
            have = int(allocatable.get(resource, 0))
            if needed and have < needed:
                problems.append(f"node {node['metadata']['name']} has been Ready for "
                                f"{ready_for:.0f} s but advertises {resource}={have} (a worker "
                                f"needs {needed}): is {DEVICE_PLUGINS[resource]} running there?")
    return "; ".join(problems) or None


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


# -- scale-in protection ---------------------------------------------------------------------


def protect_busy_instances(eks: Any, api: Any, cfg: RunConfig, state: dict) -> dict:
    """Protect from scale-in the instances running other live runs' pods, and lift the
    protection this pipeline set on the others (`state["protected"]`), so that lowering
    desiredSize terminates idle nodes. Best effort: without it scale-in picks as before.

    The protection is the Auto Scaling group's, which EKS managed node groups are made of:
    an ASG whose desired capacity drops terminates unprotected instances only.
    """
    import kubernetes

    try:
        groups = describe_nodegroup(eks, cfg).get("resources", {}).get(
            "autoScalingGroups") or []
        if not groups:
            return state
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
