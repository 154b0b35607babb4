"""Node reservations: concurrent runs on one node group never scale down each other's nodes.

One ConfigMap per node group holds the baseline scaling config (recorded when no run holds a
reservation) and each run's reservation (nodes, expiry). The node group's desired size is the
baseline plus the live reservations; a run's teardown removes its own and restores only what no
other live reservation needs; a reservation whose run died without a teardown expires.

Every change is a read-modify-replace conditional on the ConfigMap's resourceVersion, retried
on 409 Conflict, so two runs changing it at the same time never lose each other's change.
The state lives in one JSON key: a replace is the whole truth, never a merge.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import tenacity

from finetune.names import dns_label
from finetune.targets.base import StageFailed
from finetune.targets.eks.manifests import APP, LABEL_APP

log = logging.getLogger(__name__)

STATE_KEY = "reservations.json"
SCALING_KEYS = ("minSize", "maxSize", "desiredSize")
# A run that holds nodes renews its reservation while it waits (`Renewal`): every trigger's
# loop, and a wait in the task itself (a buildah build), renew it every quarter of this.
RESERVATION_TTL_S = 3600
CONFLICT_RETRIES = 20

State = dict[str, Any]


def configmap_name(cluster: str, nodegroup: str) -> str:
    return dns_label("finetune-nodes", cluster, nodegroup)


def empty_state() -> State:
    return {"baseline": None, "reservations": {}}


def live_reservations(state: State, now: float) -> dict[str, dict[str, Any]]:
    return {run: r for run, r in state["reservations"].items() if r["expires"] > now}


def record_baseline(state: State, current: dict[str, int]) -> State:
    """The node group's own size, recorded while no run (live or dead) holds a reservation."""
    if state["reservations"] and state["baseline"]:
        return state
    return {**state, "baseline": {k: int(current[k]) for k in SCALING_KEYS}}


def reserve(state: State, run: str, nodes: int, now: float, cap: int,
            ttl: float = RESERVATION_TTL_S) -> State:
    """Add or renew `run`'s reservation; refuse one that would take the group above `cap`."""
    others = sum(r["nodes"] for k, r in live_reservations(state, now).items() if k != run)
    total = state["baseline"]["desiredSize"] + others + nodes
    if total > cap:  # a verdict: retries minutes apart are no queue for runs of hours
        raise StageFailed(
            f"the node group would need {total} nodes (baseline "
            f"{state['baseline']['desiredSize']} + {others} reserved by other live runs + "
            f"{nodes} for this run), above max_nodes = {cap}")
    reservations = {**state["reservations"], run: {"nodes": nodes, "expires": now + ttl}}
    return {**state, "reservations": reservations}


def renew(state: State, run: str, now: float, ttl: float = RESERVATION_TTL_S) -> State:
    if run not in state["reservations"]:
        return state
    renewed = {**state["reservations"][run], "expires": now + ttl}
    return {**state, "reservations": {**state["reservations"], run: renewed}}


def release(state: State, run: str, now: float) -> State:
    """Remove `run`'s reservation; the last live run also clears the dead runs' ones."""
    rest = {k: r for k, r in state["reservations"].items() if k != run}
    if not live_reservations({"reservations": rest}, now):
        rest = {}
    return {**state, "reservations": rest}


def wanted_scaling(state: State, now: float) -> dict[str, int]:
    """The baseline plus the live reservations (maxSize raised to fit, never lowered)."""
    base = state["baseline"]
    desired = base["desiredSize"] + sum(r["nodes"] for r in live_reservations(state,
                                                                            now).values())
    return {"minSize": base["minSize"], "maxSize": max(base["maxSize"], desired),
            "desiredSize": desired}


class ReservationStore:
    """The node group's reservation ConfigMap, changed with optimistic concurrency."""

    def __init__(self, core: Any, namespace: str, cluster: str, nodegroup: str,
                 retries: int = CONFLICT_RETRIES):
        self.core, self.namespace, self.retries = core, namespace, retries
        self.name = configmap_name(cluster, nodegroup)
        self.nodegroup = nodegroup

    def read(self) -> tuple[State, str | None]:
        """(state, resourceVersion); an empty state and None when the ConfigMap is absent."""
        import kubernetes

        try:
            cm = self.core.read_namespaced_config_map(self.name, self.namespace)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return empty_state(), None
            raise
        raw = (cm.data or {}).get(STATE_KEY)
        return (json.loads(raw) if raw else empty_state()), cm.metadata.resource_version

    def update(self, change: Callable[[State], State]) -> State:
        """Apply `change` to the latest state; on a concurrent change, re-read and re-apply."""
        on_conflict = tenacity.Retrying(
            retry=tenacity.retry_if_exception(_conflict), reraise=True,
            stop=tenacity.stop_after_attempt(self.retries),
            wait=tenacity.wait_incrementing(start=0.05, increment=0.05),
            before_sleep=lambda _: log.info("reservations %s/%s changed concurrently: retrying",
                                            self.namespace, self.name))
        return on_conflict(self._apply, change)

    def _apply(self, change: Callable[[State], State]) -> State:
        """One read-modify-replace, conditional on the resourceVersion read."""
        state, version = self.read()
        new = change(state)
        if new == state:  # nothing to write (a renewal of a run that holds none)
            return new
        body = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": self.name, "namespace": self.namespace,
                             "labels": {LABEL_APP: APP},
                             "annotations": {"finetune.airflow.apache.org/nodegroup":
                                             self.nodegroup}},
                "data": {STATE_KEY: json.dumps(new, sort_keys=True)}}
        if version is None:
            self.core.create_namespaced_config_map(self.namespace, body)
        else:
            body["metadata"]["resourceVersion"] = version
            self.core.replace_namespaced_config_map(self.name, self.namespace, body)
        return new


def _conflict(exc: BaseException) -> bool:
    """409: another run changed (or created) the ConfigMap since it was read."""
    import kubernetes

    return isinstance(exc, kubernetes.client.ApiException) and exc.status == 409


# -- the renewal while a run waits -----------------------------------------------------------

# What renews a run's reservation (JSON-able: a trigger carries it in its kwargs): the
# cluster's credentials (clients.kube_credentials), the reservation's ConfigMap (namespace,
# cluster, node group), the run that holds it and its ttl.
Renewal = dict[str, Any]


def renewal_interval(renewal: Renewal) -> float:
    """How often a wait renews: a quarter of the ttl, so a few missed renewals do not end it."""
    return float(renewal["ttl"]) / 4


def renew_reservation(renewal: Renewal) -> None:
    """Renew the run's reservation for another ttl (nothing when it holds none); best effort:
    a failure is logged, and the reservation outlives a few missed renewals."""
    import kubernetes

    from finetune.targets.eks.clients import kube_api_client

    try:
        store = ReservationStore(
            kubernetes.client.CoreV1Api(kube_api_client(**renewal["credentials"])),
            renewal["namespace"], renewal["cluster"], renewal["nodegroup"])
        store.update(lambda state: renew(state, renewal["holder"], time.time(), renewal["ttl"]))
    except Exception as exc:
        log.warning("could not renew the node reservation of %s: %s", renewal["holder"], exc)


@contextlib.contextmanager
def renewed_while(renewal: Renewal | None) -> Iterator[None]:
    """Keep the reservation live while the block runs in the task (a wait without a trigger:
    a buildah build of hours), renewing it from a thread every renewal_interval."""
    if renewal is None:
        yield
        return
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(renewal_interval(renewal)):
            renew_reservation(renewal)

    thread = threading.Thread(target=beat, name="reservation-renewal", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
