"""The eks target against moto in server mode (EKS node groups) and the Kubernetes emulator, where
the test plays the training operator (pods, logs, job conditions) and the cluster autoscaler."""

from __future__ import annotations

import base64
import logging
import threading
import time
import urllib.parse
import urllib.request
from typing import Any

import boto3
import kubernetes
import pytest
from eks_support import Cluster, eks_config

from finetune.config import RunConfig
from finetune.kube import eks_api_client, eks_token
from finetune.manifests import (
    LABEL_JOB_NAME,
    LABEL_REPLICA_INDEX,
    LABEL_REPLICA_TYPE,
    PYTORCHJOB_GROUP,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
    job_name,
    run_selector,
)
from finetune.targets import get_target
from finetune.targets.eks import EksTarget

NS = "ml"
SCALING = {"minSize": 0, "maxSize": 2, "desiredSize": 0}


@pytest.fixture
def nodegroup(aws: str) -> Any:
    """The cluster and its GPU node group in moto (scaled to zero)."""
    eks = boto3.client("eks")
    eks.create_cluster(name="train", roleArn="arn:aws:iam::123456789012:role/eks",
                       resourcesVpcConfig={"subnetIds": ["subnet-1"]})
    eks.create_nodegroup(clusterName="train", nodegroupName="gpu-p4de",
                         nodeRole="arn:aws:iam::123456789012:role/node", subnets=["subnet-1"],
                         scalingConfig=SCALING, instanceTypes=["p4de.24xlarge"])
    return eks


def scaling(eks: Any) -> dict[str, int]:
    return eks.describe_nodegroup(clusterName="train",
                                  nodegroupName="gpu-p4de")["nodegroup"]["scalingConfig"]


def target() -> EksTarget:
    return EksTarget(poll_interval=0.05, nodes_timeout=3.0, etcd_timeout=3.0, update_retries=3)


def add_nodes(cluster: Cluster, count: int, ready: bool = True, gpus: int = 8) -> None:
    core = kubernetes.client.CoreV1Api(cluster.api())
    for i in range(count):
        core.create_node({
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": f"ip-10-0-0-{i}", "labels": {
                "eks.amazonaws.com/nodegroup": "gpu-p4de",
                "node.kubernetes.io/instance-type": "p4de.24xlarge"}},
            "status": {
                "conditions": [{"type": "Ready", "status": "True" if ready else "False",
                                "reason": "KubeletReady" if ready else "KubeletNotReady",
                                "message": "" if ready else "container runtime not ready"}],
                "allocatable": {"nvidia.com/gpu": str(gpus), "vpc.amazonaws.com/efa": "4"}},
        })


class Operator(threading.Thread):
    """Plays the training operator: waits for the run's PyTorchJob, makes its pods, writes the
    leader's log and moves the job to `outcome`."""

    def __init__(self, cluster: Cluster, cfg: RunConfig, outcome: str = "Succeeded",
                 oom_worker: int | None = None):
        super().__init__(daemon=True)
        self.cluster, self.cfg, self.outcome, self.oom_worker = cluster, cfg, outcome, oom_worker
        self.created: list[str] = []

    def run(self) -> None:
        api = self.cluster.api()
        custom, core = kubernetes.client.CustomObjectsApi(api), kubernetes.client.CoreV1Api(api)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            jobs = custom.list_namespaced_custom_object(
                PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, NS, PYTORCHJOB_PLURAL,
                label_selector=run_selector(self.cfg))["items"]
            if jobs:
                break
            time.sleep(0.02)
        else:
            return
        name = jobs[0]["metadata"]["name"]
        workers = jobs[0]["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]
        for i in range(workers):
            pod = f"{name}-worker-{i}"
            core.create_namespaced_pod(NS, {
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": pod, "namespace": NS, "labels": {
                    LABEL_JOB_NAME: name, LABEL_REPLICA_TYPE: "worker",
                    LABEL_REPLICA_INDEX: str(i)}},
                "spec": {"containers": [{"name": "pytorch", "image": "img"}]},
                "status": {"phase": "Running"}})
            self.created.append(pod)
        self._set(custom, name, "Running")
        logs = self.cluster.emulator.pod_logs
        logs[NS, f"{name}-worker-0"] = []
        for step in range(1, 4):
            logs[NS, f"{name}-worker-0"].append(
                (f"2026-11-29T10:00:0{step}.000000000Z", f"step {step} loss {4 - step}.0"))
            time.sleep(0.15)
        if self.oom_worker is not None:
            pod = f"{name}-worker-{self.oom_worker}"
            logs[NS, pod] = [("2026-11-29T10:00:05.000000000Z", "allocating activations")]
            core.patch_namespaced_pod_status(pod, NS, {"status": {
                "phase": "Failed", "containerStatuses": [{
                    "name": "pytorch", "ready": False, "restartCount": 0, "image": "img",
                    "imageID": "", "state": {"terminated": {"exitCode": 137,
                                                            "reason": "OOMKilled"}}}]}})
        time.sleep(0.15)
        self._set(custom, name, self.outcome)

    def _set(self, custom: Any, name: str, condition: str) -> None:
        custom.patch_namespaced_custom_object_status(
            PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, NS, PYTORCHJOB_PLURAL, name,
            {"status": {"conditions": [{"type": condition, "status": "True",
                                        "message": f"PyTorchJob {name} is {condition}"}]}})


def jobs_of_run(cluster: Cluster, cfg: RunConfig) -> list[dict]:
    custom = kubernetes.client.CustomObjectsApi(cluster.api())
    return custom.list_namespaced_custom_object(
        PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, NS, PYTORCHJOB_PLURAL,
        label_selector=run_selector(cfg))["items"]


IMAGE = {"image": "1234.dkr.ecr/ft:abc", "image_tag": "abc"}
RDZV = {"backend": "etcd-v2", "rdzv_id": "x"}


def test_get_target_eks_is_the_eks_target():
    assert isinstance(get_target("eks"), EksTarget)


@pytest.fixture
def task_log() -> Any:
    """What the eks target writes to the task log (Airflow's logging does not reach caplog)."""
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("finetune")
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def test_successful_run_scales_up_trains_streams_the_log_and_teardown_restores(
        nodegroup, cluster, task_log):
    cfg, t = eks_config(nodes=2), target()
    snap = t.snapshot(cfg)
    assert snap["scaling_config"] == SCALING
    add_nodes(cluster, 2)
    up = t.scale_up(cfg)
    assert scaling(nodegroup) == {"minSize": 0, "maxSize": 2, "desiredSize": 2}
    assert len(up["nodes"]) == 2

    operator = Operator(cluster, cfg)
    operator.start()
    trained = t.train(cfg, IMAGE, RDZV)
    operator.join(5)
    assert trained["job"] == job_name(cfg) and trained["adopted"] is False
    logged = "\n".join(task_log)
    assert all(f"step {s} loss" in logged for s in (1, 2, 3))
    assert logged.count("step 2 loss") == 1  # each new line once, though the log is re-read
    core = kubernetes.client.CoreV1Api(cluster.api())
    assert core.read_namespaced_config_map(f"{job_name(cfg)}-config", NS).data

    done = t.teardown(cfg, snap)
    assert scaling(nodegroup) == SCALING
    assert jobs_of_run(cluster, cfg) == []
    assert f"pytorchjob/{job_name(cfg)}" in done["deleted"]


def test_failed_job_names_the_oomkilled_pod_and_teardown_restores_the_nodegroup(
        nodegroup, cluster):
    cfg, t = eks_config(nodes=2), target()
    snap = t.snapshot(cfg)
    add_nodes(cluster, 2)
    t.scale_up(cfg)
    operator = Operator(cluster, cfg, outcome="Failed", oom_worker=1)
    operator.start()
    with pytest.raises(RuntimeError) as err:
        t.train(cfg, IMAGE, RDZV)
    operator.join(5)
    message = str(err.value)
    assert f"{job_name(cfg)}-worker-1: container pytorch OOMKilled (exit code 137)" in message
    assert "allocating activations" in message  # the failed pod's last log lines
    assert "worker-0:" not in message  # a pod that did not fail is not blamed

    t.teardown(cfg, snap)
    assert scaling(nodegroup) == SCALING
    assert jobs_of_run(cluster, cfg) == []


def test_retry_adopts_the_running_job_instead_of_creating_a_second(nodegroup, cluster):
    cfg, t = eks_config(nodes=1), target()
    custom = kubernetes.client.CustomObjectsApi(cluster.api())
    from finetune.manifests import pytorchjob_manifest

    # The first try created the job, then its worker died (the job keeps running).
    first = pytorchjob_manifest(cfg, IMAGE["image"])
    custom.create_namespaced_custom_object(PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, NS,
                                           PYTORCHJOB_PLURAL, first)
    operator = Operator(cluster, cfg)
    operator.start()
    trained = t.train(cfg, IMAGE, RDZV)
    operator.join(5)
    assert trained["adopted"] is True
    jobs = jobs_of_run(cluster, cfg)
    assert [j["metadata"]["name"] for j in jobs] == [first["metadata"]["name"]]


def test_scale_up_times_out_with_node_conditions_and_teardown_still_restores(
        nodegroup, cluster):
    cfg, t = eks_config(nodes=2), target()
    snap = t.snapshot(cfg)
    add_nodes(cluster, 2, ready=False)
    with pytest.raises(TimeoutError) as err:
        t.scale_up(cfg)
    assert "only 0 of 2 node(s)" in str(err.value)
    assert "Ready=False (KubeletNotReady: container runtime not ready)" in str(err.value)
    assert scaling(nodegroup)["desiredSize"] == 2
    t.teardown(cfg, snap)
    assert scaling(nodegroup) == SCALING


def test_scale_up_raises_max_size_up_to_the_cap_and_never_beyond(nodegroup, cluster):
    t = target()
    add_nodes(cluster, 4)
    t.scale_up(eks_config(nodes=4, max_nodes=4))
    assert scaling(nodegroup) == {"minSize": 0, "maxSize": 4, "desiredSize": 4}
    with pytest.raises(RuntimeError, match="above max_nodes = 4"):
        t.scale_up(eks_config(nodes=5, max_nodes=4))
    assert scaling(nodegroup)["maxSize"] == 4


def test_reset_etcd_deletes_the_runs_keys_through_the_service_proxy(cluster, etcd_server):
    cfg = eks_config()
    cluster.emulator.proxies[NS, "etcd"] = etcd_server.endpoint
    for key in (f"/torch/elastic/rendezvous/{cfg.rdzv_id}", "/torch/elastic/rendezvous/other"):
        req = urllib.request.Request(f"http://{etcd_server.endpoint}/v2/keys{key}",
                                     data=b"value=closed", method="PUT")
        urllib.request.urlopen(req, timeout=5).close()
    result = target().reset_etcd(cfg)
    assert result["deleted_keys"] == 1
    assert result["endpoint"] == "etcd.ml.svc:2379" and result["rdzv_id"] == cfg.rdzv_id
    with pytest.raises(urllib.error.HTTPError):  # gone
        urllib.request.urlopen(f"http://{etcd_server.endpoint}/v2/keys/torch/elastic/"
                               f"rendezvous/{cfg.rdzv_id}", timeout=5)
    urllib.request.urlopen(f"http://{etcd_server.endpoint}/v2/keys/torch/elastic/rendezvous/"
                           "other", timeout=5).close()  # another run's keys stay


def test_eks_token_is_a_presigned_get_caller_identity_naming_the_cluster(aws):
    session = boto3.session.Session()
    token = eks_token(session, "train")
    assert token.startswith("k8s-aws-v1.")
    encoded = token.removeprefix("k8s-aws-v1.")
    url = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    parsed = urllib.parse.urlparse(url)
    query = urllib.parse.parse_qs(parsed.query)
    assert parsed.netloc == "sts.us-east-1.amazonaws.com"
    assert query["Action"] == ["GetCallerIdentity"]
    assert "x-k8s-aws-id" in query["X-Amz-SignedHeaders"][0].split(";")
    assert int(query["X-Amz-Expires"][0]) <= 900


def test_eks_client_uses_the_cluster_endpoint_and_re_mints_the_token(nodegroup, monkeypatch):
    import finetune.kube as kube

    api = eks_api_client(boto3.session.Session(), "train")
    conf = api.configuration
    cluster = nodegroup.describe_cluster(name="train")["cluster"]
    assert conf.host == cluster["endpoint"]
    first = conf.get_api_key_with_prefix("authorization")
    assert first.startswith("Bearer k8s-aws-v1.")
    monkeypatch.setattr(kube, "TOKEN_REFRESH_S", -1)  # as if 10 minutes had passed
    monkeypatch.setattr(kube, "eks_token", lambda session, name: "k8s-aws-v1.fresh")
    assert conf.get_api_key_with_prefix("authorization") == "Bearer k8s-aws-v1.fresh"
