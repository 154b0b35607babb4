"""Concurrent runs on one node group: each run's reservation in a ConfigMap changed with
optimistic concurrency (moto server for EKS; the emulator answers a stale resourceVersion with
409 Conflict, as the API server does)."""

from __future__ import annotations

import ast
import threading
import time
from collections.abc import Callable
from typing import Any

import kubernetes
import pytest

from finetune.targets.eks.manifests import run_labels
from finetune.targets.eks.nodegroup import busy_node_names, instance_id
from finetune.targets.eks.reservations import (
    ReservationStore,
    empty_state,
    live_reservations,
    record_baseline,
    release,
    renewed_while,
    reserve,
    wanted_scaling,
)
from finetune.targets.eks.triggers import PollingTrigger
from tests.support import REPO_ROOT
from tests.support.deferral import reloaded, run_deferred
from tests.support.eks import (
    NS,
    SCALING,
    eks_config,
    run_stage,
    scaling,
    stage_operator,
    target,
    the_nodegroups_asg,
)
from tests.support.kube import add_nodes

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


@pytest.mark.slow
def test_concurrent_runs_never_scale_down_each_others_nodes(nodegroup, cluster):
    t = target()
    a, b, c = (eks_config(run_id=f"run-{x}", nodes=n, max_nodes=4)
               for x, n in (("a", 2), ("b", 1), ("c", 1)))
    snaps = {cfg.rdzv_id: t.snapshot(cfg) for cfg in (a, b, c)}
    add_nodes(cluster, 4)

    at_once(lambda: run_stage("scale_up", a), lambda: run_stage("scale_up", b))
    assert scaling(nodegroup) == {"minSize": 0, "maxSize": 3, "desiredSize": 3}

    at_once(lambda: t.teardown(a, snaps[a.rdzv_id]), lambda: run_stage("scale_up", c))
    assert scaling(nodegroup)["desiredSize"] == 2  # b's and c's nodes stay

    t.teardown(b, snaps[b.rdzv_id])
    assert scaling(nodegroup)["desiredSize"] == 1
    t.teardown(c, snaps[c.rdzv_id])
    assert scaling(nodegroup) == SCALING
    assert store(cluster).read()[0]["reservations"] == {}


@pytest.mark.slow
def test_a_later_run_restores_the_baseline_not_the_size_it_found(nodegroup, cluster):
    t = target()
    first, second = eks_config(run_id="first", nodes=2), eks_config(run_id="second", nodes=1)
    snap_first = t.snapshot(first)
    add_nodes(cluster, 3)
    run_stage("scale_up", first)
    snap_second = t.snapshot(second)  # sees the node group raised by the first run
    assert snap_second["scaling_config"]["desiredSize"] == 2
    run_stage("scale_up", second)
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
    run_stage("scale_up", cfg)
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


def protected(autoscaling: Any, asg_name: str) -> set[str]:
    group = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[asg_name])
    return {i["InstanceId"] for i in group["AutoScalingGroups"][0]["Instances"]
            if i["ProtectedFromScaleIn"]}


def run_pod(cluster: Any, cfg: Any, node: str, phase: str = "Running") -> None:
    kubernetes.client.CoreV1Api(cluster.api()).create_namespaced_pod(NS, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{cfg.rdzv_id}-worker-0", "namespace": NS,
                     "labels": run_labels(cfg)},
        "spec": {"nodeName": node, "containers": [{"name": "pytorch", "image": "t"}]},
        "status": {"phase": phase}})


@pytest.mark.slow
def test_a_run_shrinking_the_node_group_protects_the_nodes_other_runs_train_on(
    nodegroup, cluster
):
    t = target()
    a, b = eks_config(run_id="run-a", nodes=1), eks_config(run_id="run-b", nodes=1)
    snaps = {cfg.rdzv_id: t.snapshot(cfg) for cfg in (a, b)}
    autoscaling, asg_name, instances = the_nodegroups_asg(nodegroup, 2)
    add_nodes(cluster, 2)
    core = kubernetes.client.CoreV1Api(cluster.api())
    for i, instance in enumerate(instances):  # node ip-10-0-0-i is EC2 instance i
        core.patch_node(f"ip-10-0-0-{i}", {"spec": {
            "providerID": f"aws:///us-east-1a/{instance}"}})
    run_stage("scale_up", a)
    run_stage("scale_up", b)
    run_pod(cluster, a, "ip-10-0-0-0")
    run_pod(cluster, b, "ip-10-0-0-1")

    t.teardown(a, snaps[a.rdzv_id])  # desiredSize 2 -> 1: b's node must be the one kept
    assert scaling(nodegroup)["desiredSize"] == 1
    assert protected(autoscaling, asg_name) == {instances[1]}

    t.teardown(b, snaps[b.rdzv_id])  # the last run lifts what the pipeline set
    assert scaling(nodegroup) == SCALING
    assert protected(autoscaling, asg_name) == set()


def test_busy_nodes_are_those_of_other_live_runs_pending_or_running_pods():
    def pod(run: str, node: str, phase: str) -> dict:
        return {"metadata": {"labels": {"finetune.airflow.apache.org/run": run}},
                "spec": {"nodeName": node}, "status": {"phase": phase}}

    pods = [pod("me", "n1", "Running"), pod("other", "n2", "Running"),
            pod("other", "n3", "Pending"), pod("other", "n4", "Succeeded"),
            pod("dead", "n5", "Running")]
    assert busy_node_names(pods, "me", live_runs={"me", "other"}) == {"n2", "n3"}
    assert instance_id({"spec": {"providerID": "aws:///us-east-1a/i-0abc"}}) == "i-0abc"
    assert instance_id({"spec": {"providerID": "kind://docker/x"}}) is None


# -- a run's reservation is renewed while it waits --------------------------------------------


def holds_nodes(cluster: Any, run: str) -> bool:
    return run in live_reservations(store(cluster).read()[0], time.time())


@pytest.mark.slow  # seconds of real waiting past a ttl
def test_a_wait_longer_than_the_reservation_ttl_keeps_it_live(nodegroup, cluster):
    """scale_up's wait for nodes that come after twice the ttl: other runs' sizing must count
    this run's nodes all the while (as a wait of capacity_wait_s, a build or a node replaced
    must, each far longer than RESERVATION_TTL_S)."""
    cfg = eks_config(nodes=1)
    ttl = 1.0
    seen: list[bool] = []  # from the reservation on, every 0.1 s
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.1):
            if seen or holds_nodes(cluster, cfg.rdzv_id):
                seen.append(holds_nodes(cluster, cfg.rdzv_id))

    threading.Timer(2.5 * ttl, lambda: add_nodes(cluster, 1)).start()
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result, _ = run_deferred(stage_operator(
            "scale_up", cfg, {"reservation_ttl": ttl, "nodes_timeout": 30.0}))
    finally:
        done.set()
        watcher.join()
    assert result["nodes"] == ["ip-10-0-0-0"]
    assert len(seen) > 15 and all(seen), seen  # live before and after the first ttl ended
    assert holds_nodes(cluster, cfg.rdzv_id)


@pytest.mark.slow  # seconds of real waiting past a ttl
def test_a_wait_in_the_task_itself_keeps_the_reservation_live(cluster):
    """A buildah build runs in the task, no trigger: a thread renews meanwhile."""
    cfg = eks_config()
    ttl = 0.4
    store(cluster).update(lambda state: reserve(record_baseline(state, BASELINE), cfg.rdzv_id,
                                                1, time.time(), 8, ttl))
    renewal = target()._renewal(cfg)
    with renewed_while({**renewal, "ttl": ttl}):
        time.sleep(3 * ttl)
        assert holds_nodes(cluster, cfg.rdzv_id)
    time.sleep(1.5 * ttl)
    assert not holds_nodes(cluster, cfg.rdzv_id)  # no renewal once the wait is over


def trigger_classes() -> list[type]:
    """The waits: every PollingTrigger subclass that can be made (its own __init__)."""
    def below(cls: type) -> list[type]:
        return [c for sub in cls.__subclasses__() for c in (sub, *below(sub))]

    return [c for c in below(PollingTrigger) if "__init__" in vars(c)]


# What each wait needs besides its reservation.
TRIGGER_KWARGS = {
    "NodegroupActiveTrigger": {"cluster_name": "train", "nodegroup": "gpu-p4de", "deadline": 1.0},
    "NodesReadyTrigger": {"credentials": {}, "nodegroup": "gpu-p4de", "nodes": 1, "gpus": 8,
                          "deadline": 1.0},
    "JobTrigger": {"credentials": {}, "namespace": NS, "name": "job", "wake_at": 1.0},
    "ImageBuildTrigger": {"pending": {"builder": "codebuild", "build_id": "b"}, "deadline": 1.0},
    "BatchJobTrigger": {"credentials": {}, "namespace": NS, "name": "job", "deadline": 1.0},
}


def test_every_wait_carries_the_runs_reservation_through_a_triggerer_restart():
    """Each trigger renews what it is given, in the loop they share; it must reach a trigger
    built again from its kwargs."""
    renewal = {"credentials": {}, "namespace": NS, "cluster": "train", "nodegroup": "gpu-p4de",
               "holder": "run-1", "ttl": 60.0}
    classes = {c.__name__: c for c in trigger_classes()}
    assert set(classes) == set(TRIGGER_KWARGS), "a new wait: say what it needs in TRIGGER_KWARGS"
    for name, cls in classes.items():
        trigger = cls(**TRIGGER_KWARGS[name], reservation=renewal)
        assert reloaded(trigger).reservation == renewal, name


# Where the eks target defers before the run holds any node: nothing to renew.
BEFORE_THE_NODES = {("_start_prepare", "BatchJobTrigger")}


def test_every_trigger_the_eks_target_defers_on_after_scale_up_is_given_the_reservation():
    """A scan of the eks target: each trigger it makes names `reservation=`, but for the waits
    before any node is reserved; a new wait that forgets it fails here."""
    path = REPO_ROOT / "plugins/finetune/targets/eks/target.py"
    triggers = {c.__name__ for c in trigger_classes()}
    made = []
    for function in ast.walk(ast.parse(path.read_text())):
        if isinstance(function, ast.FunctionDef):
            made += [(function.name, node.func.id, {k.arg for k in node.keywords})
                     for node in ast.walk(function) if isinstance(node, ast.Call)
                     and isinstance(node.func, ast.Name) and node.func.id in triggers]
    assert len(made) >= 5
    missing = [(f, t) for f, t, keywords in made
               if "reservation" not in keywords and (f, t) not in BEFORE_THE_NODES]
    assert missing == []


def test_the_eks_targets_waits_renew_the_holders_reservation_where_its_nodes_are(
        nodegroup, cluster):
    """scale_up's, train's and a sweep trial's waits: the run's (or the sweep's) reservation,
    on the node group the run's nodes are in."""
    cfg, t = eks_config(), target()
    wait = t.scale_up(cfg)
    assert wait.trigger.reservation == t._renewal(cfg, "gpu-p4de")
    assert wait.trigger.reservation["holder"] == cfg.rdzv_id
    assert t.nodegroup_active(cfg, {"status": "success"}, wait.state).trigger.reservation == \
        wait.trigger.reservation
    trial = eks_config(node_reservation="sweep-1")
    trained = t.train(trial, {"image": "img"}, {"backend": "c10d", "rdzv_id": "x"})
    assert trained.trigger.reservation["holder"] == "sweep-1"
    assert trained.trigger.reservation["nodegroup"] == "gpu-p4de"
    t.teardown(cfg, t.snapshot(cfg))


# -- teardown reads the reservations before it gives nodes back ------------------------------


def two_runs_up(cluster: Any) -> tuple[Any, Any]:
    """Another run and this one, a node each: this run's snapshot (SCALING) predates the other's
    reservation, so restoring it would take the other run's node."""
    other, cfg = eks_config(run_id="manual__other", nodes=1), eks_config(nodes=1)
    add_nodes(cluster, 2)
    run_stage("scale_up", other)
    run_stage("scale_up", cfg)
    return other, cfg


RESERVATIONS_PATH = r"/configmaps/finetune-nodes-"


@pytest.mark.slow  # the retries' real back-off
def test_teardown_retries_a_transient_error_reading_the_reservations(nodegroup, cluster):
    other, cfg = two_runs_up(cluster)
    assert scaling(nodegroup)["desiredSize"] == 2
    cluster.emulator.faults += [(RESERVATIONS_PATH, 503)] * 2  # then the API server answers
    target().teardown(cfg, {"scaling_config": SCALING})
    assert scaling(nodegroup)["desiredSize"] == 1  # the other run's node kept
    assert set(live_reservations(store(cluster).read()[0], time.time())) == {other.rdzv_id}


def test_teardown_fails_rather_than_guess_when_the_reservations_cannot_be_read(nodegroup,
                                                                               cluster):
    """A read refused (403) is no evidence that there is no cluster: the stale snapshot is not
    restored; teardown fails, and its retry gives back what is this run's."""
    other, cfg = two_runs_up(cluster)
    cluster.emulator.faults.append((RESERVATIONS_PATH, 403))
    with pytest.raises(RuntimeError, match="restoring node group gpu-p4de failed"):
        target().teardown(cfg, {"scaling_config": SCALING})
    assert scaling(nodegroup)["desiredSize"] == 2  # nothing given back on a guess
    target().teardown(cfg, {"scaling_config": SCALING})  # the task's retry
    assert scaling(nodegroup)["desiredSize"] == 1


def test_without_a_cluster_to_ask_teardown_restores_the_runs_snapshot(nodegroup):
    import botocore.exceptions

    from finetune.targets.eks.nodegroup import give_back_nodes

    cfg = eks_config()
    nodegroup.update_nodegroup_config(clusterName="train", nodegroupName="gpu-p4de",
                                      scalingConfig={**SCALING, "desiredSize": 2})

    def no_cluster() -> ReservationStore:
        raise botocore.exceptions.ClientError(
            {"Error": {"Code": "ResourceNotFoundException", "Message": "No cluster found for "
                       "name: train."}}, "DescribeCluster")

    give_back_nodes(nodegroup, lambda: None, cfg, {"scaling_config": SCALING}, no_cluster, 3,
                    0.05)
    assert scaling(nodegroup) == SCALING
