"""A failed eks training names its first failure by time from the pods' container status
(OOMKilled, a signal's exit code, an eviction) with the node, before what followed on other
ranks; the failed report carries it. Pods in the Kubernetes API emulator, records on moto S3."""

from __future__ import annotations

import json

import boto3
import kubernetes
import pytest

from finetune.targets.eks import job
from finetune.targets.eks.manifests import job_name
from finetune_contract.errors import error_file, error_record, failure_records
from tests.support.eks import NS, eks_config
from tests.support.kube import pod_status

T0 = "2026-11-29T10:00:00Z"


def make_pod(cluster, name: str, worker: int, status: dict) -> None:
    core = kubernetes.client.CoreV1Api(cluster.api())
    pod = f"{name}-worker-{worker}"
    core.create_namespaced_pod(NS, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod, "namespace": NS, "labels": {
            "training.kubeflow.org/job-name": name,
            "training.kubeflow.org/replica-type": "worker",
            "training.kubeflow.org/replica-index": str(worker)}},
        "spec": {"containers": [{"name": "pytorch", "image": "img"}],
                 "nodeName": f"ip-10-0-0-{worker}"},
        "status": pod_status()})
    core.patch_namespaced_pod_status(pod, NS, {"status": status})


def terminated(code: int, finished: str, reason: str = "Error") -> dict:
    return {"phase": "Failed", "containerStatuses": [{
        "name": "pytorch", "ready": False, "restartCount": 0, "image": "img", "imageID": "",
        "state": {"terminated": {"exitCode": code, "reason": reason, "finishedAt": finished}}}]}


def evicted(at: str) -> dict:
    return {"phase": "Failed", "reason": "Evicted",
            "message": "The node was low on resource: memory.",
            "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": at}]}


@pytest.mark.parametrize(("status", "words"), [
    (terminated(137, "2026-11-29T10:00:05Z", "OOMKilled"),
     ["killed by SIGKILL (exit code 137) (OOMKilled) on node ip-10-0-0-1",
      "OOM killer: the container's memory reached its limit"]),
    (terminated(137, "2026-11-29T10:00:05Z"),
     ["killed by SIGKILL (exit code 137)", "usually the kernel's OOM killer"]),
    (terminated(139, "2026-11-29T10:00:05Z"), ["killed by SIGSEGV", "native code"]),
    (terminated(3, "2026-11-29T10:00:05Z"), ["exited with code 3 (Error) on node ip-10-0-0-1"]),
    (evicted("2026-11-29T10:00:05Z"),
     ["evicted from node ip-10-0-0-1", "low on resource: memory", "kubelet evicted"]),
])
def test_each_kind_of_pod_death_is_named_with_its_node_and_meaning(cluster, status, words):
    name = "run-job"
    make_pod(cluster, name, 0, {"phase": "Running"})
    make_pod(cluster, name, 1, status)
    deaths = job.failed_pods(cluster.api(), NS, name)
    assert len(deaths) == 1, deaths  # the running pod is not blamed
    text = deaths[0]["message"]
    assert all(w in text for w in words), text
    assert deaths[0]["time"] == job._epoch("2026-11-29T10:00:05Z")


def test_the_earliest_pod_death_comes_first_whatever_the_pod_order(cluster):
    name = "run-job"
    make_pod(cluster, name, 0, terminated(1, "2026-11-29T10:00:09Z"))  # in the wake
    make_pod(cluster, name, 1, terminated(137, "2026-11-29T10:00:04Z", "OOMKilled"))
    make_pod(cluster, name, 2, evicted("2026-11-29T10:00:07Z"))
    nodes = [death["node"] for death in job.failed_pods(cluster.api(), NS, name)]
    assert [n.split()[0] for n in nodes] == ["ip-10-0-0-1", "ip-10-0-0-2", "ip-10-0-0-0"]


def test_a_failed_train_leads_with_the_oomkilled_pod_before_rank_0s_broken_collective(
        cluster, aws):
    """What the task's error says first, and what the failed report reads (the dead pod's
    record stored beside the ranks' records)."""
    cfg = eks_config()
    name = job_name(cfg)
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="bucket")
    prefix = cfg.run_dir.removeprefix("s3://bucket/")
    wake = error_record(RuntimeError("Connection reset by peer"), rank=0)
    wake["time"] = job._epoch("2026-11-29T10:00:06Z")
    s3.put_object(Bucket="bucket", Key=f"{prefix}/{error_file(0)}", Body=json.dumps(wake))
    make_pod(cluster, name, 0, terminated(1, "2026-11-29T10:00:08Z"))
    make_pod(cluster, name, 1, terminated(137, "2026-11-29T10:00:05Z", "OOMKilled"))

    summary = job.first_failure(cluster.api(), cfg, name, job.PYTORCHJOB, lambda: s3)
    lines = summary.splitlines()
    assert lines[0].startswith("first failure: a process killed by SIGKILL"), summary
    assert "ip-10-0-0-1" in lines[0] and "OOMKilled" in lines[0]
    assert lines[1].startswith("then: rank 0 raised RuntimeError: Connection reset"), summary
    assert "exited with code 1" in lines[2], summary

    listed = s3.list_objects_v2(Bucket="bucket", Prefix=f"{prefix}/errors/")["Contents"]
    stored = failure_records(s3.get_object(Bucket="bucket", Key=o["Key"])["Body"].read()
                             .decode() for o in listed)
    assert stored[0]["type"] == "SIGKILL" and "ip-10-0-0-1" in stored[0]["node"]
    # read again (a retried task): the stored pod records are not counted twice
    again = job.first_failure(cluster.api(), cfg, name, job.PYTORCHJOB, lambda: s3)
    assert again == summary
