"""The run's EKS managed node group: its scaling config (read, sized from the reservations,
updated one change at a time), the run's nodes reserved (`reserve_nodes`) and given back
(`give_back_nodes`), its capacity (`check_capacity`: its capacityType and instance types against
the run's), which node group the run's nodes are in after a fallback (`record_run_nodegroup`,
`run_nodegroup`), which of its nodes are usable, and the Auto Scaling group's scale-in
protection of the nodes other runs train on.

`node_readiness` and `usable_nodes` are pure; the trigger that waits for the nodes uses them.
Bad nodes (cordoned, replaced) are `node_health`'s.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import tenacity

from finetune.config import RunConfig
from finetune.targets.base import StageFailed
from finetune.targets.eks.clients import (
    aws_session,
    create_or_replace,
    no_such_cluster,
    retry_transient,
)
from finetune.targets.eks.manifests import (
    APP,
    INSTANCE_TYPE_LABEL,
    LABEL_APP,
    LABEL_RUN,
    NODEGROUP_LABEL,
    nodegroup_record_manifest,
    nodegroup_record_name,
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
from finetune_contract.instance_types import (
    EFA_RESOURCE,
    GPU_RESOURCE,
    INSTANCE_TYPES,
    gpu_class,
    holds,
)

log = logging.getLogger(__name__)


# -- the node group in EKS -------------------------------------------------------------------


@retry_transient
def describe_nodegroup(eks: Any, cfg: RunConfig) -> dict[str, Any]:
    return eks.describe_nodegroup(clusterName=cfg.cluster_name,
                                  nodegroupName=cfg.nodegroup)["nodegroup"]


def current_scaling(eks: Any, cfg: RunConfig) -> dict[str, int]:
    scaling = describe_nodegroup(eks, cfg)["scalingConfig"]
    return {k: scaling[k] for k in SCALING_KEYS}


# The run's capacity_type in EKS's words (a managed node group's capacityType).
EKS_CAPACITY_TYPES = {"on-demand": "ON_DEMAND", "spot": "SPOT", "capacity-block": "CAPACITY_BLOCK"}


def check_capacity(eks: Any, cfg: RunConfig, capacity_type: str | None = None) -> list[str]:
    """The node group's instance types, once it is known to be what the run asked for: its
    capacityType the run's `capacity_type` (or `capacity_type`: a fallback's on-demand), and
    each of its types one the run's pods fit (the same GPUs as `instance_type`, with room for
    its requests: a spot group's several pools). A mismatch is refused, naming it."""
    group = describe_nodegroup(eks, cfg)
    where = f"node group {cfg.nodegroup} of cluster {cfg.cluster_name}"
    wanted = capacity_type or cfg.capacity_type
    have = group.get("capacityType") or "ON_DEMAND"  # EKS's default
    if have != EKS_CAPACITY_TYPES[wanted]:
        theirs = {v: k for k, v in EKS_CAPACITY_TYPES.items()}.get(have, have)
        if capacity_type is None:
            raise StageFailed(f"capacity_type is {wanted}, but {where} has capacityType {have}: "
                             f"set capacity_type to {theirs}, or name a node group of {wanted} "
                             "nodes")
        raise StageFailed(f"fallback_nodegroup: capacity_fallback {capacity_type} needs "
                         f"{capacity_type} nodes, but {where} has capacityType {have}: name "
                         f"a node group of {capacity_type} nodes")
    types = group.get("instanceTypes") or []
    if not types:  # set in a launch template: EKS does not say; the param is all we have
        log.info("%s names no instance types: using instance_type %s", where, cfg.instance_type)
        return [cfg.instance_type]
    unknown = [t for t in types if t not in INSTANCE_TYPES]
    misfits = [t for t in types if t in INSTANCE_TYPES and not holds(t, cfg.instance_type)]
    if cfg.instance_type not in types or unknown or misfits:
        fits = [t for t in types if t in gpu_class(cfg.instance_type)]
        why = (f"{', '.join(unknown)} ha{'s' if len(unknown) == 1 else 've'} no instance "
               "profile here" if unknown else
               f"{', '.join(misfits)} cannot hold a pod made for {cfg.instance_type} (another "
               "GPU, or less CPU, memory or EFA)" if misfits else
               f"{cfg.instance_type} is not one of them")
        smallest = [t for t in types if t in INSTANCE_TYPES
                    and all(t2 not in INSTANCE_TYPES or holds(t2, t) for t2 in types)]
        advice = f"set instance_type to {smallest[0]}, whose pods every node holds" if smallest \
            else "give the run a node group whose types have the same GPUs"
        raise StageFailed(f"instance_type is {cfg.instance_type}, but {where} has instanceTypes "
                         f"{', '.join(types)}: {why}; {advice}" +
                         (f" (of these, {', '.join(fits)} hold its pods)" if fits and misfits
                          else ""))
    return list(types)


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
    reservations (no ConfigMap, no baseline in it, or no such cluster) the run's snapshot is
    restored. An error reading them that may pass is retried, and then fails (teardown is
    retried): the snapshot may be stale, and restoring it would take other runs' nodes."""
    try:
        reservations, state = _read_reservations(store)
    except Exception as exc:
        if not no_such_cluster(exc):
            raise
        log.warning("no cluster to read the reservations from (%s): restoring the run's "
                    "snapshot", exc)
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


@retry_transient
def _read_reservations(store: Callable[[], ReservationStore]) -> tuple[ReservationStore, dict]:
    """The store and its state (an empty one when its ConfigMap is absent)."""
    reservations = store()
    return reservations, reservations.read()[0]


def record_run_nodegroup(api: Any, cfg: RunConfig, nodegroup: str) -> None:
    """Record that the run's nodes are in `nodegroup` (a fallback's), for the stages after
    scale_up; teardown deletes the record with the run's other ConfigMaps."""
    import kubernetes

    core = kubernetes.client.CoreV1Api(api)
    create_or_replace(core.create_namespaced_config_map, core.replace_namespaced_config_map,
                      nodegroup_record_manifest(cfg, nodegroup))


@retry_transient
def run_nodegroup(api: Any, cfg: RunConfig) -> str:
    """The node group the run's nodes are in: the one scale_up fell back to, else its own."""
    import kubernetes

    if cfg.capacity_fallback != "on-demand":
        return cfg.nodegroup
    try:
        record = kubernetes.client.CoreV1Api(api).read_namespaced_config_map(
            nodegroup_record_name(cfg), cfg.namespace)
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return cfg.nodegroup
        raise
    return (record.data or {}).get("nodegroup") or cfg.nodegroup


# -- its nodes in Kubernetes (pure) ----------------------------------------------------------


def node_readiness(node: dict[str, Any], gpus: int, efa: int,
                   instance_types: Sequence[str] = ()) -> tuple[bool, str]:
    """(usable, summary): Ready, schedulable, of one of the instance types (when labelled;
    none given: any), with the GPUs (and EFA) a worker requests."""
    status = node.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    ready = conditions.get("Ready", {})
    allocatable = status.get("allocatable") or {}
    have_gpus = int(allocatable.get(GPU_RESOURCE, 0))
    have_efa = int(allocatable.get(EFA_RESOURCE, 0))
    labels = (node.get("metadata") or {}).get("labels") or {}
    have_type = labels.get(INSTANCE_TYPE_LABEL)
    type_ok = not instance_types or have_type is None or have_type in instance_types
    ok = (ready.get("status") == "True" and have_gpus >= gpus and have_efa >= efa and type_ok
          and not (node.get("spec") or {}).get("unschedulable"))
    name = (node.get("metadata") or {}).get("name")
    detail = f"Ready={ready.get('status', 'Unknown')}"
    if ready.get("status") != "True" and (ready.get("reason") or ready.get("message")):
        detail += f" ({ready.get('reason', '')}: {ready.get('message', '')})"
    detail += f", {GPU_RESOURCE}={have_gpus}" + (f", {EFA_RESOURCE}={have_efa}" if efa else "")
    if not type_ok:
        detail += f", instance type {have_type}, not {' or '.join(instance_types)}"
    return ok, f"{name}: {detail}"


def usable_nodes(nodes: list[dict[str, Any]], gpus: int, efa: int,
                 instance_types: Sequence[str] = ()) -> tuple[list[str], str]:
    """(names of the usable nodes, a summary of every node's state) for a timeout message."""
    states = [node_readiness(n, gpus, efa, instance_types) for n in nodes]
    usable = [s.split(":", 1)[0] for ok, s in states if ok]
    return usable, "; ".join(s for _, s in states) or "no nodes registered"


# The device plugins that advertise each resource, as a missing one is named.
DEVICE_PLUGINS = {
    GPU_RESOURCE: "the NVIDIA device plugin (kube-system daemonset nvidia-device-plugin-daemonset)",
    EFA_RESOURCE: "the EFA device plugin (kube-system daemonset "
                  "aws-efa-k8s-device-plugin-daemonset; see containers/k8s/"
                  "efa-device-plugin-patch.yaml for GPU-tainted nodes)",
}


def missing_devices(nodes: list[dict[str, Any]], gpus: int, efa: int,
                    instance_types: Sequence[str], grace_s: float, now: float) -> str | None:
    """Why nodes Ready for `grace_s` or more still cannot take a worker: the GPUs or EFA they
    do not advertise, and the device plugin that should; None while none is like that. The
    time comes from the Ready condition's lastTransitionTime, so a restarted trigger agrees."""
    problems = []
    for node in nodes:
        status = node.get("status") or {}
        ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
        labels = (node.get("metadata") or {}).get("labels") or {}
        since = ready.get("lastTransitionTime")
        have_type = labels.get(INSTANCE_TYPE_LABEL)
        if ready.get("status") != "True" or not since or \
                (instance_types and have_type is not None and have_type not in instance_types):
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
