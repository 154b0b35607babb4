"""Concurrent runs on one node group: each run's reservation in a ConfigMap changed with
optimistic concurrency (moto server for EKS; the emulator answers a stale resourceVersion with
409 Conflict, as the API server does)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import kubernetes
import pytest
from eks_support import NS, SCALING, add_nodes, eks_config, scaling, target

from finetune.reservations import (
    ReservationStore,
    empty_state,
    record_baseline,
    release,
    reserve,
    wanted_scaling,
)

BASELINE = {"minSize": 0, "maxSize": 2, "desiredSize": 1}


def store(cluster: Any) -> ReservationStore:
    return ReservationStore(kubernetes.client.CoreV1Api(cluster.api()), NS, "train", "gpu-p4de")


def at_once(*calls: Callable[[], Any]) -> None:
    """Run the calls in threads started together; re-raise the first failure."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], Any]) -> None:
        barrier.wait()
        try:
            call()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]


def test_desired_size_is_the_baseline_plus_the_live_reservations():
    state = record_baseline(empty_state(), BASELINE)
    state = reserve(state, "a", 2, now=100, cap=8, ttl=60)
    state = reserve(state, "b", 3, now=110, cap=8, ttl=60)
    assert wanted_scaling(state, now=120) == {"minSize": 0, "maxSize": 6, "desiredSize": 6}
    assert wanted_scaling(state, now=165) == {"minSize": 0, "maxSize": 4, "desiredSize": 4}
    assert wanted_scaling(state, now=200) == BASELINE  # both expired
    with pytest.raises(RuntimeError, match=r"1 \+ 5 reserved by other live runs \+ 3 .*= 8"):
        reserve(state, "c", 3, now=120, cap=8)
    # The baseline is kept while runs hold reservations, re-recorded once none do.
    assert record_baseline(state, {**BASELINE, "desiredSize": 6})["baseline"] == BASELINE
    emptied = release(release(state, "a", now=120), "b", now=120)
    assert emptied["reservations"] == {}
    assert record_baseline(emptied, {**BASELINE, "desiredSize": 0})["baseline"]["desiredSize"] == 0


def test_concurrent_runs_never_scale_down_each_others_nodes(nodegroup, cluster):
    t = target()
    a, b, c = (eks_config(run_id=f"run-{x}", nodes=n, max_nodes=4)
               for x, n in (("a", 2), ("b", 1), ("c", 1)))
    snaps = {cfg.rdzv_id: t.snapshot(cfg) for cfg in (a, b, c)}
    add_nodes(cluster, 4)

    at_once(lambda: t.scale_up(a), lambda: t.scale_up(b))
    assert scaling(nodegroup) == {"minSize": 0, "maxSize": 3, "desiredSize": 3}

    at_once(lambda: t.teardown(a, snaps[a.rdzv_id]), lambda: t.scale_up(c))
    assert scaling(nodegroup)["desiredSize"] == 2  # b's and c's nodes stay

    t.teardown(b, snaps[b.rdzv_id])
    assert scaling(nodegroup)["desiredSize"] == 1
    t.teardown(c, snaps[c.rdzv_id])
    assert scaling(nodegroup) == SCALING
    assert store(cluster).read()[0]["reservations"] == {}


def test_a_later_run_restores_the_baseline_not_the_size_it_found(nodegroup, cluster):
    t = target()
    first, second = eks_config(run_id="first", nodes=2), eks_config(run_id="second", nodes=1)
    snap_first = t.snapshot(first)
    add_nodes(cluster, 3)
    t.scale_up(first)
    snap_second = t.snapshot(second)  # sees the node group raised by the first run
    assert snap_second["scaling_config"]["desiredSize"] == 2
    t.scale_up(second)
    t.teardown(first, snap_first)
    t.teardown(second, snap_second)
    assert scaling(nodegroup) == SCALING


def test_a_stale_reservation_of_a_dead_run_is_ignored_and_cleared(nodegroup, cluster):
    # A run died without its teardown: its reservation expired, its nodes are still up.
    expired = time.time() - 1
    store(cluster).update(lambda _: {"baseline": dict(SCALING), "reservations": {
        "dead-run": {"nodes": 2, "expires": expired}}})
    nodegroup.update_nodegroup_config(clusterName="train", nodegroupName="gpu-p4de",
                                      scalingConfig={**SCALING, "desiredSize": 2})
    t, cfg = target(), eks_config(nodes=1)
    snap = t.snapshot(cfg)
    add_nodes(cluster, 1)
    t.scale_up(cfg)
    assert scaling(nodegroup)["desiredSize"] == 1  # the dead run's 2 nodes are not kept
    t.teardown(cfg, snap)
    assert scaling(nodegroup) == SCALING
    assert store(cluster).read()[0] == {"baseline": SCALING, "reservations": {}}


def test_a_conflicting_change_is_retried_and_neither_change_is_lost(cluster):
    mine, other = store(cluster), store(cluster)
    mine.update(lambda state: record_baseline(state, BASELINE))
    attempts = []

    def reserve_mine(state: dict) -> dict:
        attempts.append(state)
        if len(attempts) == 1:  # another run writes between this read and this write
            other.update(lambda s: reserve(s, "other", 1, time.time(), cap=8))
        return reserve(state, "mine", 2, time.time(), cap=8)

    mine.update(reserve_mine)
    assert len(attempts) == 2  # the first write got 409 Conflict
    state, _ = mine.read()
    assert sorted(state["reservations"]) == ["mine", "other"]
    assert wanted_scaling(state, time.time())["desiredSize"] == 4
