"""The eks target's preflight stage against the Kubernetes emulator and moto: its own job on the
run's nodes, the verdict in the run directory (S3), bad nodes cordoned, replaced through the
node group's Auto Scaling group and checked again; and nodes with XID errors cordoned while the
training runs. The test plays the training operator and the preflight program's output."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import boto3
import kubernetes
import pytest
from airflow.sdk.exceptions import AirflowFailException

from finetune.targets.eks.manifests import (
    LABEL_JOB_NAME,
    LABEL_PROGRAM,
    LABEL_REPLICA_INDEX,
    LABEL_REPLICA_TYPE,
    PREFLIGHT,
    PYTORCHJOB_GROUP,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
    run_selector,
)
from finetune_contract.preflight_result import PREFLIGHT_FILE, RESULT_PREFIX
from tests.support.eks import (
    IMAGE,
    NS,
    RDZV,
    TrainingOperator,
    eks_config,
    jobs_of_run,
    run_stage,
    the_nodegroups_asg,
)
from tests.support.kube import add_nodes
from tests.support.preflight import measured
from tests.support.prometheus import TextExporter, start_prometheus
from tests.support.schemas import assert_valid_pytorchjob

pytestmark = pytest.mark.slow


class PreflightOperator(threading.Thread):
    """Plays the training operator for each preflight job of the run, in turn: its pods on the
    nodes, rank 0's result line from `results` (one per round), the job Succeeded."""

    def __init__(self, cluster: Any, cfg: Any, results: list[dict],
                 before_round: Any = None):
        super().__init__(daemon=True)
        self.cluster, self.cfg, self.results = cluster, cfg, list(results)
        self.before_round = before_round  # called with the round's number before it runs
        self.manifests: list[dict] = []

    def run(self) -> None:
        api = self.cluster.api()
        custom = kubernetes.client.CustomObjectsApi(api)
        core = kubernetes.client.CoreV1Api(api)
        deadline = time.monotonic() + 30
        while self.results and time.monotonic() < deadline:
            jobs = [j for j in custom.list_namespaced_custom_object(
                PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, NS, PYTORCHJOB_PLURAL,
                label_selector=run_selector(self.cfg))["items"]
                if j["metadata"]["labels"].get(LABEL_PROGRAM) == PREFLIGHT
                and not j.get("status")]
            if not jobs:
                time.sleep(0.02)
                continue
            job = jobs[0]
            if self.before_round:
                self.before_round(len(self.manifests))
            self.manifests.append(job)
            name, result = job["metadata"]["name"], self.results.pop(0)
            for i in range(job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]):
                pod = f"{name}-worker-{i}"
                try:
                    core.delete_namespaced_pod(pod, NS)  # the round before's
                except kubernetes.client.ApiException:
                    pass
                core.create_namespaced_pod(NS, {
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": pod, "namespace": NS, "labels": {
                        LABEL_JOB_NAME: name, LABEL_REPLICA_TYPE: "worker",
                        LABEL_REPLICA_INDEX: str(i)}},
                    "spec": {"nodeName": f"ip-10-0-0-{i}",
                             "containers": [{"name": "pytorch", "image": "img"}]},
                    "status": {"phase": "Succeeded"}})
            self.cluster.emulator.pod_logs[NS, f"{name}-worker-0"] = [
                ("2026-11-29T10:00:01.000000000Z", "checking 16 GPUs"),
                ("2026-11-29T10:00:02.000000000Z", RESULT_PREFIX + json.dumps(result))]
            custom.patch_namespaced_custom_object_status(
                PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, NS, PYTORCHJOB_PLURAL, name,
                {"status": {"conditions": [{"type": "Succeeded", "status": "True",
                                            "message": "done"}]}})
            time.sleep(0.3)  # the stage reads and deletes it before the next round


def preflight(cfg: Any) -> dict:
    return run_stage("preflight", cfg, image=IMAGE, rendezvous=RDZV)


def verdict_in_s3(cfg: Any) -> dict:
    bucket, _, prefix = cfg.run_dir.removeprefix("s3://").partition("/")
    body = boto3.client("s3").get_object(Bucket=bucket, Key=f"{prefix}/{PREFLIGHT_FILE}")["Body"]
    return json.loads(body.read())


def unschedulable(cluster: Any) -> set[str]:
    api = cluster.api()
    nodes = api.sanitize_for_serialization(kubernetes.client.CoreV1Api(api).list_node())
    return {n["metadata"]["name"] for n in nodes["items"]
            if (n.get("spec") or {}).get("unschedulable")}


def config(**changes: Any) -> Any:
    """A 2-node p4de run whose run directory (s3://bucket/runs/...) is in moto."""
    cfg = eks_config(nodes=2, **changes)
    boto3.client("s3").create_bucket(Bucket=cfg.run_dir.removeprefix("s3://").split("/")[0])
    return cfg


def test_healthy_nodes_pass_in_a_job_of_their_own_and_the_verdict_is_stored(
        nodegroup, cluster):
    cfg = config()
    add_nodes(cluster, 2)
    operator = PreflightOperator(cluster, cfg, [measured()])
    operator.start()
    result = preflight(cfg)
    operator.join(5)
    assert result["ok"] and "2 node(s) checked (nccl)" in result["summary"]
    (job,) = operator.manifests
    assert_valid_pytorchjob(job)
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert container["args"][:2] == ["-m", "trainer.preflight"]
    assert job["spec"]["elasticPolicy"]["rdzvId"] != cfg.rdzv_id  # not the training's
    assert verdict_in_s3(cfg)["ok"]
    assert jobs_of_run(cluster, cfg) == []  # deleted once read
    assert unschedulable(cluster) == set()


def test_a_bad_node_is_cordoned_named_and_fails_the_run_before_training(nodegroup, cluster):
    cfg = config()
    add_nodes(cluster, 2)
    PreflightOperator(cluster, cfg, [measured(
        health={(1, 3): {"ecc_uncorrected_volatile": 4}})]).start()
    with pytest.raises(AirflowFailException) as err:
        preflight(cfg)
    message = str(err.value)
    assert "cordoned ip-10-0-0-1" in message
    assert "node ip-10-0-0-1: GPU 3: 4 uncorrected ECC error(s)" in message
    assert "set replace_bad_nodes" in message
    assert unschedulable(cluster) == {"ip-10-0-0-1"}
    assert verdict_in_s3(cfg)["bad_nodes"] == ["ip-10-0-0-1"]


def test_with_replace_bad_nodes_the_instance_is_replaced_and_checked_again(
        nodegroup, cluster):
    cfg = config(replace_bad_nodes=True)
    autoscaling, asg_name, instances = the_nodegroups_asg(nodegroup, 2)
    add_nodes(cluster, 3)  # the third is the replacement the ASG brings
    core = kubernetes.client.CoreV1Api(cluster.api())
    for i, instance in enumerate(instances):
        core.patch_node(f"ip-10-0-0-{i}", {"spec": {
            "providerID": f"aws:///us-east-1a/{instance}"}})
    slow_then_fine = [measured(intra=40.0, node_names=["ip-10-0-0-0", "ip-10-0-0-1"]),
                      measured()]
    slow_then_fine[0]["ranks"] = [r if r["node"] == 1 else {**r, "intra_busbw_gbps": 220.0}
                                  for r in slow_then_fine[0]["ranks"]]
    operator = PreflightOperator(cluster, cfg, slow_then_fine)
    operator.start()
    result = preflight(cfg)
    operator.join(5)
    assert result["ok"] and result["tries"] == 2
    assert unschedulable(cluster) == {"ip-10-0-0-1"}
    live = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[asg_name])[
        "AutoScalingGroups"][0]["Instances"]
    assert instances[1] not in {i["InstanceId"] for i in live}  # terminated...
    assert len(live) == 2  # ...and replaced: the desired capacity stayed


def test_replacing_stops_after_the_bounded_number_of_preflights(nodegroup, cluster):
    from finetune.preflight_verdict import PREFLIGHT_TRIES

    cfg = config(replace_bad_nodes=True)
    autoscaling, asg_name, _ = the_nodegroups_asg(nodegroup, 2)
    add_nodes(cluster, 2 + PREFLIGHT_TRIES)
    core = kubernetes.client.CoreV1Api(cluster.api())

    def a_live_instance_under(node: int) -> None:
        # round k's bad node is node k, on an instance the ASG has now
        live = autoscaling.describe_auto_scaling_groups(AutoScalingGroupNames=[asg_name])[
            "AutoScalingGroups"][0]["Instances"]
        core.patch_node(f"ip-10-0-0-{node}", {"spec": {
            "providerID": f"aws:///us-east-1a/{live[-1]['InstanceId']}"}})

    rounds = [measured(node_names=[f"ip-10-0-0-{k}", "ip-10-0-0-9"],
                       health={(0, 0): {"row_remap_failure": True}})
              for k in range(PREFLIGHT_TRIES)]
    operator = PreflightOperator(cluster, cfg, rounds, before_round=a_live_instance_under)
    operator.start()
    with pytest.raises(AirflowFailException, match=f"{PREFLIGHT_TRIES} preflight\\(s\\), no more"):
        preflight(cfg)
    operator.join(5)
    assert len(operator.manifests) == PREFLIGHT_TRIES
    assert unschedulable(cluster) == {f"ip-10-0-0-{k}" for k in range(PREFLIGHT_TRIES)}


def test_a_node_whose_gpus_raise_xid_errors_while_training_is_cordoned_and_its_pods_moved(
        nodegroup, cluster, task_log, tmp_path):
    exporter = TextExporter(lambda scrape: (
        'DCGM_FI_DEV_XID_ERRORS{gpu="3",Hostname="ip-10-0-0-1"} 79\n'
        'DCGM_FI_DEV_XID_ERRORS{gpu="0",Hostname="ip-10-0-0-0"} 0\n'))
    proc, url = start_prometheus(tmp_path, [exporter.start()])
    try:
        deadline = time.monotonic() + 30
        while exporter.scrapes < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)  # the scrape's samples appended
        cfg = config(prometheus_url=url)
        add_nodes(cluster, 2)
        operator = TrainingOperator(cluster, cfg)
        operator.start()
        run_stage("train", cfg, image=IMAGE, rendezvous=RDZV)
        operator.join(5)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        exporter.shutdown()
    assert unschedulable(cluster) == {"ip-10-0-0-1"}
    api = cluster.api()
    pods = api.sanitize_for_serialization(
        kubernetes.client.CoreV1Api(api).list_namespaced_pod(NS))["items"]
    assert sorted(p["metadata"]["name"] for p in pods) == [operator.created[0]]
    assert any("XID error(s) on ip-10-0-0-1 (XID 79): cordoned" in line for line in task_log)
