"""The run's EKS managed node group: its scaling config (read, sized from the reservations,
updated one change at a time), its instance type (resolved from the node group, checked
against the run's), which of its nodes are usable, and the Auto Scaling group's scale-in
protection of the nodes other runs train on.

`node_readiness` and `usable_nodes` are pure; the trigger that waits for the nodes uses them.
"""

from __future__ import annotations

import datetime
import logging
import time
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


# -- bad nodes ---------------------------------------------------------------------------------


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
        raise RuntimeError(f"node group {cfg.nodegroup} has no Auto Scaling group to replace "
                           f"nodes {', '.join(names)} with")
    core = kubernetes.client.CoreV1Api(api)
    autoscaling = aws_session(cfg.aws_conn_id).client("autoscaling")
    terminated = []
    for name in names:
        node = api.sanitize_for_serialization(core.read_node(name))
        iid = instance_id(node)
        if iid is None:
            raise RuntimeError(f"node {name} has no EC2 instance in its providerID: cannot "
                               "replace it")
        autoscaling.terminate_instance_in_auto_scaling_group(
            InstanceId=iid, ShouldDecrementDesiredCapacity=False)
        log.warning("terminated %s (node %s): %s launches a new instance", iid, name,
                    groups[0]["name"])
        terminated.append(iid)
    return terminated
