"""Capacity that may not come, on moto's EKS and the emulated cluster: scale_up checks the node
group is the run's capacity (capacityType, instance types of one GPU class, a spot group's
several), waits for its nodes up to capacity_wait_s, and then fails saying the capacity did not
come, or (capacity_fallback on-demand) scales the fallback node group instead, gives the first
one back and places the run's pods there; teardown restores both."""

from __future__ import annotations

from typing import Any

import boto3
import kubernetes
import pytest
from airflow.sdk.exceptions import AirflowFailException

from finetune.targets.eks import nodegroup
from finetune.targets.eks.launchers import launcher_for
from finetune.targets.eks.manifests import pytorchjob_manifest, run_selector
from finetune_contract.instance_types import INSTANCE_TYPES
from tests.support.eks import IMAGE, NS, RDZV, SCALING, eks_config, jobs_of_run, run_stage, target
from tests.support.kube import add_nodes
from tests.support.schemas import assert_valid_pytorchjob

SPOT_TYPES = ["g5.12xlarge", "g5.24xlarge"]


def add_nodegroup(name: str, capacity_type: str, instance_types: list[str]) -> None:
    boto3.client("eks").create_nodegroup(
        clusterName="train", nodegroupName=name, nodeRole="arn:aws:iam::123456789012:role/node",
        subnets=["subnet-1"], scalingConfig=SCALING, instanceTypes=instance_types,
        capacityType=capacity_type)


def scaling_of(name: str) -> dict[str, int]:
    return boto3.client("eks").describe_nodegroup(
        clusterName="train", nodegroupName=name)["nodegroup"]["scalingConfig"]


def spot_config(**changes: Any) -> Any:
    """A spot run of 2 g5.12xlarge nodes on the spot group, waiting briefly for capacity."""
    return eks_config(**{"nodegroup": "gpu-spot", "instance_type": "g5.12xlarge",
                         "procs_per_node": 4, "nodes": 2, "capacity_type": "spot",
                         "capacity_wait_s": 0.3, **changes})


@pytest.fixture
def spot_group(nodegroup: Any) -> str:
    """A spot node group of two A10G types beside the on-demand p4de one."""
    add_nodegroup("gpu-spot", "SPOT", SPOT_TYPES)
    return "gpu-spot"


@pytest.mark.slow  # several stages on the emulators: with the slow tests
def test_a_spot_run_takes_any_type_of_its_gpu_class_from_a_spot_node_group(spot_group, cluster):
    cfg = spot_config()
    add_nodes(cluster, 1, gpus=4, efa=1, nodegroup=spot_group, instance_type="g5.12xlarge")
    add_nodes(cluster, 1, gpus=4, efa=1, nodegroup=spot_group, instance_type="g5.24xlarge",
              first=1)
    up = run_stage("scale_up", cfg)
    assert up["nodegroup"] == "gpu-spot" and len(up["nodes"]) == 2
    assert scaling_of("gpu-spot")["desiredSize"] == 2
    # the pods request what a g5.12xlarge holds and may land on either type
    manifest = pytorchjob_manifest(cfg, "img:1")
    assert_valid_pytorchjob(manifest)
    pod = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["nodeSelector"] == {"eks.amazonaws.com/nodegroup": "gpu-spot"}
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "node.kubernetes.io/instance-type",
                                         "operator": "In", "values": SPOT_TYPES}]
    requests = pod["containers"][0]["resources"]["requests"]
    assert requests["cpu"] == str(INSTANCE_TYPES["g5.12xlarge"].cpu_request)


@pytest.mark.parametrize(("changes", "words"), [
    ({"capacity_type": "on-demand"}, "capacity_type is on-demand, but node group gpu-spot of "
     "cluster train has capacityType SPOT: set capacity_type to spot"),
    ({"instance_type": "g5.24xlarge"}, "g5.12xlarge cannot hold a pod made for g5.24xlarge"),
    ({"instance_type": "g6.12xlarge"}, "g5.12xlarge, g5.24xlarge cannot hold a pod made for "
     "g6.12xlarge (another GPU"),
])
def test_scale_up_refuses_a_node_group_that_is_not_the_runs_capacity_naming_the_mismatch(
        spot_group, cluster, changes, words):
    with pytest.raises(AirflowFailException) as err:  # a verdict: no retry
        run_stage("scale_up", spot_config(**changes))
    assert words in str(err.value)
    assert scaling_of("gpu-spot") == SCALING  # refused before any node was asked for


def test_a_node_group_of_two_gpu_classes_is_refused_naming_the_type_that_does_not_fit(
        nodegroup, cluster):
    add_nodegroup("gpu-mixed", "SPOT", ["g5.12xlarge", "g6.12xlarge"])
    with pytest.raises(AirflowFailException) as err:  # a verdict: no retry
        run_stage("scale_up", spot_config(nodegroup="gpu-mixed"))
    assert "g6.12xlarge cannot hold a pod made for g5.12xlarge (another GPU" in str(err.value)


def test_capacity_that_does_not_come_fails_scale_up_saying_so_and_teardown_gives_it_back(
        spot_group, cluster):
    cfg, t = spot_config(), target()
    snap = t.snapshot(cfg)
    add_nodes(cluster, 1, gpus=4, efa=1, nodegroup=spot_group, instance_type="g5.12xlarge")
    with pytest.raises(AirflowFailException) as err:  # a verdict: no retry
        run_stage("scale_up", cfg)
    message = str(err.value)
    assert "the capacity did not come: only 1 of 2 node(s) of node group gpu-spot (spot)" in message
    assert "capacity_wait_s 0.3" in message and "teardown gives back what came" in message
    assert scaling_of("gpu-spot")["desiredSize"] == 2  # asked for until teardown
    t.teardown(cfg, snap)
    assert scaling_of("gpu-spot") == SCALING


def fallback_config() -> Any:
    return spot_config(capacity_fallback="on-demand", fallback_nodegroup="gpu-od")


@pytest.mark.slow  # several stages on the emulators: with the slow tests
def test_capacity_that_does_not_come_falls_back_to_the_on_demand_node_group(
        spot_group, cluster, task_log, monkeypatch):
    add_nodegroup("gpu-od", "ON_DEMAND", ["g5.12xlarge"])
    cfg, t = fallback_config(), target()
    snap = t.snapshot(cfg)
    assert snap["fallback"] == {"nodegroup": "gpu-od", "scaling_config": SCALING}
    add_nodes(cluster, 2, gpus=4, efa=1, nodegroup="gpu-od", instance_type="g5.12xlarge")
    up = run_stage("scale_up", cfg)
    assert (up["nodegroup"], up["instead_of"], len(up["nodes"])) == ("gpu-od", "gpu-spot", 2)
    assert scaling_of("gpu-spot") == SCALING  # the first one given back at once
    assert scaling_of("gpu-od")["desiredSize"] == 2
    assert any("capacity_fallback on-demand: scaling node group gpu-od" in line
               for line in task_log)
    # the stages after scale_up place the run's pods on the fallback's nodes, and the train
    # stage's wait renews the reservation there; it reads the record of where they are once
    reads = []
    real = nodegroup.run_nodegroup
    monkeypatch.setattr(nodegroup, "run_nodegroup", lambda *a: reads.append(a) or real(*a))
    wait = t.train(cfg, IMAGE, RDZV)
    assert wait.trigger.reservation["nodegroup"] == "gpu-od" and len(reads) == 1
    (job,) = jobs_of_run(cluster, cfg)
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["nodeSelector"]["eks.amazonaws.com/nodegroup"] == "gpu-od"
    assert launcher_for(cfg).kind == "PyTorchJob"
    done = t.teardown(cfg, snap)
    assert scaling_of("gpu-spot") == scaling_of("gpu-od") == SCALING
    assert done["fallback_scaling_config"] == SCALING
    core = kubernetes.client.CoreV1Api(cluster.api())
    # the record of where the nodes are went with the run
    assert core.list_namespaced_config_map(NS, label_selector=run_selector(cfg)).items == []


@pytest.mark.slow  # several stages on the emulators: with the slow tests
def test_a_fallback_that_does_not_come_either_fails_naming_it_and_teardown_restores_both(
        spot_group, cluster):
    add_nodegroup("gpu-od", "ON_DEMAND", ["g5.12xlarge"])
    cfg, t = fallback_config(), target()
    snap = t.snapshot(cfg)
    with pytest.raises(AirflowFailException) as err:  # a verdict: no retry
        run_stage("scale_up", cfg)
    assert "only 0 of 2 node(s) of node group gpu-od (on-demand)" in str(err.value)
    assert scaling_of("gpu-spot") == SCALING and scaling_of("gpu-od")["desiredSize"] == 2
    t.teardown(cfg, snap)
    assert scaling_of("gpu-spot") == scaling_of("gpu-od") == SCALING


def test_a_fallback_node_group_that_is_not_on_demand_is_refused_before_any_node(
        spot_group, cluster):
    add_nodegroup("gpu-od", "SPOT", ["g5.12xlarge"])
    with pytest.raises(AirflowFailException) as err:  # a verdict: no retry
        run_stage("scale_up", fallback_config())
    assert "fallback_nodegroup: capacity_fallback on-demand needs on-demand nodes, but node " \
        "group gpu-od of cluster train has capacityType SPOT" in str(err.value)
    assert scaling_of("gpu-spot") == scaling_of("gpu-od") == SCALING
