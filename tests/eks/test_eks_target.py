"""The eks target against moto in server mode (EKS node groups) and the Kubernetes emulator, where
the test plays the training operator (pods, logs, job conditions) and the cluster autoscaler."""

from __future__ import annotations

import base64
import dataclasses
import threading
import time
import urllib.parse
import urllib.request
from typing import Any

import boto3
import botocore.exceptions
import kubernetes
import pytest
from airflow.sdk.exceptions import AirflowFailException

from finetune.targets import get_target
from finetune.targets.eks.clients import (
    async_kube_api_client,
    ca_bundle_file,
    delete_object,
    eks_api_client,
    eks_token,
)
from finetune.targets.eks.manifests import (
    PYTORCHJOB_GROUP,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
    job_name,
)
from finetune.targets.eks.nodegroup import current_scaling, node_readiness, update_scaling
from finetune.targets.eks.target import EksTarget
from tests.support.deferral import run_deferred
from tests.support.eks import (
    FAST,
    IMAGE,
    NS,
    RDZV,
    SCALING,
    TrainingOperator,
    eks_config,
    jobs_of_run,
    run_stage,
    scaling,
    stage_operator,
    target,
)
from tests.support.kube import add_nodes


def test_get_target_eks_is_the_eks_target():
    assert isinstance(get_target("eks"), EksTarget)


@pytest.mark.slow
def test_successful_run_scales_up_trains_streams_the_log_and_teardown_restores(
        nodegroup, cluster, task_log):
    cfg, t = eks_config(nodes=2), target()
    snap = t.snapshot(cfg)
    assert snap["scaling_config"] == SCALING
    add_nodes(cluster, 2)
    up = run_stage("scale_up", cfg)
    assert scaling(nodegroup) == {"minSize": 0, "maxSize": 2, "desiredSize": 2}
    assert len(up["nodes"]) == 2

    operator = TrainingOperator(cluster, cfg)
    operator.start()
    trained = run_stage("train", cfg, image=IMAGE, rendezvous=RDZV)
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


@pytest.mark.slow
def test_failed_job_names_the_oomkilled_pod_and_teardown_restores_the_nodegroup(
        nodegroup, cluster):
    cfg, t = eks_config(nodes=2), target()
    snap = t.snapshot(cfg)
    add_nodes(cluster, 2)
    run_stage("scale_up", cfg)
    operator = TrainingOperator(cluster, cfg, outcome="Failed", oom_worker=1)
    operator.start()
    with pytest.raises(AirflowFailException) as err:
        run_stage("train", cfg, image=IMAGE, rendezvous=RDZV)
    operator.join(5)
    message = str(err.value)
    assert f"{job_name(cfg)}-worker-1: container pytorch OOMKilled (exit code 137)" in message
    assert "allocating activations" in message  # the failed pod's last log lines
    assert "worker-0:" not in message  # a pod that did not fail is not blamed

    t.teardown(cfg, snap)
    assert scaling(nodegroup) == SCALING
    assert jobs_of_run(cluster, cfg) == []


@pytest.mark.slow
def test_a_failed_job_leads_with_the_trainers_root_cause_and_the_failed_report_carries_it(
        nodegroup, cluster):
    import json

    import boto3

    from finetune_contract.errors import error_file, error_record

    cfg, t = eks_config(nodes=2), target()
    snap = t.snapshot(cfg)
    add_nodes(cluster, 2)
    run_stage("scale_up", cfg)
    s3 = boto3.client("s3")
    s3.create_bucket(Bucket="bucket")
    prefix = cfg.run_dir.removeprefix("s3://bucket/")
    cause = error_record(ValueError("prompt_field='promt' is not a column of s3://d/x"), rank=9)
    s3.put_object(Bucket="bucket", Key=f"{prefix}/{error_file(9)}", Body=json.dumps(cause))
    operator = TrainingOperator(cluster, cfg, outcome="Failed", oom_worker=1)
    operator.start()
    with pytest.raises(AirflowFailException) as err:
        run_stage("train", cfg, image=IMAGE, rendezvous=RDZV)
    operator.join(5)
    assert str(err.value).startswith(
        "first failure: rank 9 raised ValueError: prompt_field='promt'")
    assert "OOMKilled" in str(err.value)  # and still the pods' reasons

    t.teardown(cfg, snap)
    report = json.loads(s3.get_object(Bucket="bucket", Key=f"{prefix}/report.json")["Body"].read())
    assert report["status"] == "failed" and report["error"]["rank"] == 9
    assert report["error"]["message"].startswith("prompt_field='promt'")


@pytest.mark.slow
def test_pods_the_scheduler_cannot_place_fail_train_in_time_naming_its_reason(
        nodegroup, cluster):
    cfg, t = eks_config(nodes=2, schedule_timeout_s=600), target()
    snap = t.snapshot(cfg)
    add_nodes(cluster, 2)
    run_stage("scale_up", cfg)
    reason = "0/2 nodes are available: 2 Insufficient vpc.amazonaws.com/efa."
    operator = TrainingOperator(cluster, cfg, unschedulable=reason)
    operator.start()
    started = time.monotonic()
    with pytest.raises(AirflowFailException) as err:  # a verdict: no retry
        run_stage("train", cfg, image=IMAGE, rendezvous=RDZV)
    operator.join(5)
    assert time.monotonic() - started < 30  # the first wake-up, not active_deadline_s
    message = str(err.value)
    assert "could not be scheduled for 600 s or more (schedule_timeout_s)" in message
    assert f"{job_name(cfg)}-worker-1 (" in message and reason in message
    t.teardown(cfg, snap)
    assert scaling(nodegroup) == SCALING and jobs_of_run(cluster, cfg) == []


@pytest.mark.parametrize(("gpus", "efa", "plugin"), [
    (8, 0, "the EFA device plugin"), (0, 4, "the NVIDIA device plugin")])
def test_ready_nodes_without_their_gpus_or_efa_fail_scale_up_naming_the_device_plugin(
        nodegroup, cluster, gpus, efa, plugin):
    cfg = eks_config(nodes=2)
    add_nodes(cluster, 2, gpus=gpus, efa=efa, ready_for=600)
    with pytest.raises(AirflowFailException) as err:  # a verdict: no retry
        run_deferred(stage_operator("scale_up", cfg, {"nodes_timeout": 60.0,
                                                      "devices_grace_s": 300.0}))
    message = str(err.value)
    assert "are Ready but cannot take a worker" in message and plugin in message
    assert "has been Ready for 6" in message  # about 600 s, from the Ready condition


def test_retry_adopts_the_running_job_instead_of_creating_a_second(nodegroup, cluster):
    cfg = eks_config(nodes=1)
    custom = kubernetes.client.CustomObjectsApi(cluster.api())
    from finetune.targets.eks.manifests import pytorchjob_manifest

    # The first try created the job, then its worker died (the job keeps running).
    first = pytorchjob_manifest(cfg, IMAGE["image"])
    custom.create_namespaced_custom_object(PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, NS,
                                           PYTORCHJOB_PLURAL, first)
    operator = TrainingOperator(cluster, cfg)
    operator.start()
    trained = run_stage("train", cfg, image=IMAGE, rendezvous=RDZV)
    operator.join(5)
    assert trained["adopted"] is True
    jobs = jobs_of_run(cluster, cfg)
    assert [j["metadata"]["name"] for j in jobs] == [first["metadata"]["name"]]


@pytest.mark.slow
def test_scale_up_times_out_with_node_conditions_and_teardown_still_restores(
        nodegroup, cluster):
    cfg, t = eks_config(nodes=2), target()
    snap = t.snapshot(cfg)
    add_nodes(cluster, 2, ready=False)
    with pytest.raises(AirflowFailException) as err:  # a verdict: no retry
        run_stage("scale_up", cfg)
    assert "only 0 of 2 node(s)" in str(err.value)
    assert "Ready=False (KubeletNotReady: container runtime not ready)" in str(err.value)
    assert scaling(nodegroup)["desiredSize"] == 2
    t.teardown(cfg, snap)
    assert scaling(nodegroup) == SCALING


def test_scale_up_raises_max_size_up_to_the_cap_and_never_beyond(nodegroup, cluster):
    add_nodes(cluster, 4)
    run_stage("scale_up", eks_config(nodes=4, max_nodes=4))
    assert scaling(nodegroup) == {"minSize": 0, "maxSize": 4, "desiredSize": 4}
    with pytest.raises(AirflowFailException, match="above max_nodes = 4"):
        run_stage("scale_up", eks_config(nodes=5, max_nodes=4))
    assert scaling(nodegroup)["maxSize"] == 4


def test_the_rendezvous_stage_deletes_the_runs_keys_through_the_service_proxy(cluster, etcd_server):
    cfg = eks_config()
    cluster.emulator.proxies[NS, "etcd"] = etcd_server.endpoint
    for key in (f"/torch/elastic/rendezvous/{cfg.rdzv_id}", "/torch/elastic/rendezvous/other"):
        req = urllib.request.Request(f"http://{etcd_server.endpoint}/v2/keys{key}",
                                     data=b"value=closed", method="PUT")
        urllib.request.urlopen(req, timeout=5).close()
    result = target().rendezvous(cfg)
    assert result["deleted_keys"] == 1
    assert result["endpoint"] == "etcd.ml.svc:2379" and result["rdzv_id"] == cfg.rdzv_id
    with pytest.raises(urllib.error.HTTPError):  # gone
        urllib.request.urlopen(f"http://{etcd_server.endpoint}/v2/keys/torch/elastic/"
                               f"rendezvous/{cfg.rdzv_id}", timeout=5)
    urllib.request.urlopen(f"http://{etcd_server.endpoint}/v2/keys/torch/elastic/rendezvous/"
                           "other", timeout=5).close()  # another run's keys stay


def etcd_pod(name: str, ready: bool) -> dict[str, Any]:
    """A pod of the etcd service (its selector: app=etcd), Ready or not yet; its uid as the API
    server would give it (the emulator gives none)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "uid": f"uid-of-{name}",
                         "labels": {"app": "etcd"}},
            "spec": {"containers": [{"name": "etcd", "image": "quay.io/coreos/etcd:v3.5.17"}]},
            "status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": "True" if ready else "False"}]}}


def etcd_service_with_a_ready_pod(cluster) -> Any:
    """The etcd service and its Ready pod etcd-0; the cluster's CoreV1Api."""
    core = kubernetes.client.CoreV1Api(cluster.api())
    core.create_namespaced_service(NS, {
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "etcd", "namespace": NS},
        "spec": {"selector": {"app": "etcd"}, "ports": [{"port": 2379}]}})
    core.create_namespaced_pod(NS, etcd_pod("etcd-0", ready=True))
    return core


def test_the_rendezvous_stage_restarts_etcd_and_returns_once_a_new_pod_is_ready(cluster):
    core = etcd_service_with_a_ready_pod(cluster)

    def replace_the_pod() -> None:  # as etcd's Deployment does: a new pod, Ready a while later
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and core.list_namespaced_pod(NS).items:
            time.sleep(0.02)
        core.create_namespaced_pod(NS, etcd_pod("etcd-1", ready=False))
        time.sleep(0.5)
        ready = etcd_pod("etcd-1", ready=True)["status"]
        core.patch_namespaced_pod_status("etcd-1", NS, {"status": ready})

    deployment = threading.Thread(target=replace_the_pod, daemon=True)
    deployment.start()
    result = target().rendezvous(dataclasses.replace(eks_config(), etcd_reset="restart"))
    deployment.join(5)
    assert result["restarted_etcd"] is True
    (pod,) = core.list_namespaced_pod(NS).items
    assert pod.metadata.name == "etcd-1"
    assert [(c.type, c.status) for c in pod.status.conditions] == [("Ready", "True")]


def test_an_etcd_restart_without_a_new_ready_pod_fails_the_rendezvous_stage_in_etcd_timeout(
        cluster):
    etcd_service_with_a_ready_pod(cluster)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"etcd \(ml/etcd\) has no Ready pod 1s after the "
                       "restart"):
        EksTarget(**{**FAST, "etcd_timeout": 1.0}).rendezvous(
            dataclasses.replace(eks_config(), etcd_reset="restart"))
    assert 1.0 <= time.monotonic() - started < 3.0


def test_a_deletion_that_waits_returns_once_the_object_is_gone_or_its_timeout_has_passed():
    def not_found() -> None:
        raise kubernetes.client.ApiException(status=404, reason="Not Found")

    gone_at = time.monotonic() + 0.3  # a finalizer holds it that long

    def read() -> dict:
        if time.monotonic() >= gone_at:
            not_found()
        return {}

    assert delete_object(lambda: None, read, wait=True, poll_interval=0.02) is True
    assert time.monotonic() >= gone_at
    started = time.monotonic()  # one that stays: the wait ends at its timeout, no error
    assert delete_object(lambda: None, dict, wait=True, timeout=0.3, poll_interval=0.02) is True
    assert 0.3 <= time.monotonic() - started < 2.0
    assert delete_object(not_found, read, wait=True) is False  # not there to delete


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


def test_eks_clients_made_all_day_write_the_clusters_ca_to_one_file(monkeypatch, tmp_path):
    """The stages and triggers make a client several times a minute while a run trains; each
    wrote the CA to a new temporary file before."""
    import asyncio
    import tempfile
    from pathlib import Path
    from types import SimpleNamespace

    import certifi

    import finetune.targets.eks.clients as kube

    # A real certificate (the clients load it) as the cluster's CA: certifi's first.
    bundle = Path(certifi.where()).read_text()
    begin = bundle.index("-----BEGIN CERTIFICATE-----")
    end = bundle.index("-----END CERTIFICATE-----") + len("-----END CERTIFICATE-----")
    ca = (bundle[begin:end] + "\n").encode()
    cluster = {"endpoint": "https://eks.example", "certificateAuthority": {
        "data": base64.b64encode(ca).decode()}}
    session = SimpleNamespace(client=lambda service: SimpleNamespace(
        describe_cluster=lambda name: {"cluster": cluster}))
    monkeypatch.setattr(kube, "aws_session", lambda conn_id: session)
    monkeypatch.setattr(kube, "eks_token", lambda session, name: "k8s-aws-v1.token")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("FINETUNE_KUBECONFIG", raising=False)

    async def triggers_client() -> str:
        async with async_kube_api_client(cluster_name="train") as api:
            return api.configuration.ssl_ca_cert

    used = {eks_api_client(session, "train").configuration.ssl_ca_cert for _ in range(30)} | {
        asyncio.run(triggers_client()) for _ in range(5)}
    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert len(files) == 1 and used == {str(files[0])}
    assert files[0].read_bytes() == ca
    assert oct(files[0].parent.stat().st_mode & 0o777) == "0o700"  # this user's alone
    assert ca_bundle_file(b"another cluster's CA") != str(files[0])  # one per distinct CA


def test_eks_client_uses_the_cluster_endpoint_and_re_mints_the_token(nodegroup, monkeypatch):
    import finetune.targets.eks.clients as kube

    api = eks_api_client(boto3.session.Session(), "train")
    conf = api.configuration
    cluster = nodegroup.describe_cluster(name="train")["cluster"]
    assert conf.host == cluster["endpoint"]
    first = conf.get_api_key_with_prefix("authorization")
    assert first.startswith("Bearer k8s-aws-v1.")
    monkeypatch.setattr(kube, "TOKEN_REFRESH_S", -1)  # as if 10 minutes had passed
    monkeypatch.setattr(kube, "eks_token", lambda session, name: "k8s-aws-v1.fresh")
    assert conf.get_api_key_with_prefix("authorization") == "Bearer k8s-aws-v1.fresh"


def test_scale_up_refuses_an_instance_type_that_is_not_the_nodegroups_naming_both(
        nodegroup, cluster):
    cfg = eks_config(instance_type="p5.48xlarge")  # the node group is p4de.24xlarge
    with pytest.raises(AirflowFailException) as err:  # a verdict: no retry
        run_stage("scale_up", cfg)
    assert "instance_type is p5.48xlarge" in str(err.value)
    assert "gpu-p4de of cluster train has instanceTypes p4de.24xlarge" in str(err.value)
    assert scaling(nodegroup) == SCALING  # refused before any node was asked for
    assert target()._reservations(cfg).read()[0]["reservations"] == {}


def test_nodes_of_another_instance_type_are_not_counted_ready():
    node = {"metadata": {"name": "n", "labels": {
        "node.kubernetes.io/instance-type": "p5.48xlarge"}},
        "status": {"conditions": [{"type": "Ready", "status": "True"}],
                   "allocatable": {"nvidia.com/gpu": "8"}}}
    ok, summary = node_readiness(node, gpus=8, efa=0, instance_types=["p4de.24xlarge"])
    assert not ok and "instance type p5.48xlarge, not p4de.24xlarge" in summary
    assert node_readiness(node, gpus=8, efa=0, instance_types=["p5.48xlarge"])[0]


class Flaky:
    """An EKS client whose calls named in `errors` raise those errors first, in order."""

    def __init__(self, real: Any, **errors: list[Exception]):
        self.real, self.errors, self.exceptions = real, errors, real.exceptions

    def __getattr__(self, name: str) -> Any:
        def call(**kwargs: Any) -> Any:
            if self.errors.get(name):
                raise self.errors[name].pop(0)
            return getattr(self.real, name)(**kwargs)
        return call


def in_use(eks: Any) -> Exception:
    return eks.exceptions.ResourceInUseException(
        {"Error": {"Code": "ResourceInUseException", "Message": "update in progress"}},
        "UpdateNodegroupConfig")


def test_a_nodegroup_update_waits_while_another_update_is_in_progress(nodegroup):
    cfg = eks_config()
    wanted = {"minSize": 0, "maxSize": 2, "desiredSize": 1}
    flaky = Flaky(nodegroup, update_nodegroup_config=[in_use(nodegroup), in_use(nodegroup)])
    update_scaling(flaky, cfg, wanted, attempts=3, wait_s=0.01)
    assert scaling(nodegroup) == wanted
    flaky = Flaky(nodegroup, update_nodegroup_config=[in_use(nodegroup) for _ in range(3)])
    with pytest.raises(nodegroup.exceptions.ResourceInUseException):
        update_scaling(flaky, cfg, SCALING, attempts=3, wait_s=0.01)  # gives up at last
    assert scaling(nodegroup) == wanted


def test_a_throttled_read_of_the_nodegroup_is_retried(nodegroup):
    throttled = botocore.exceptions.ClientError(
        {"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"},
         "ResponseMetadata": {"HTTPStatusCode": 400}}, "DescribeNodegroup")
    flaky = Flaky(nodegroup, describe_nodegroup=[throttled])
    assert current_scaling(flaky, eks_config()) == SCALING


def test_a_node_lacking_devices_is_named_only_after_the_grace_time_from_its_ready_condition():
    from finetune.targets.eks.nodegroup import missing_devices

    def node(ready_since: str, efa: int) -> dict:
        return {"metadata": {"name": "n1", "labels": {
                    "node.kubernetes.io/instance-type": "p4de.24xlarge"}},
                "status": {"conditions": [{"type": "Ready", "status": "True",
                                           "lastTransitionTime": ready_since}],
                           "allocatable": {"nvidia.com/gpu": "8",
                                           "vpc.amazonaws.com/efa": str(efa)}}}

    now = 1_800_000_000.0
    at = lambda seconds_ago: time.strftime(  # noqa: E731
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - seconds_ago))
    assert missing_devices([node(at(100), 0)], 8, 4, ["p4de.24xlarge"], 300, now) is None
    assert "EFA device plugin" in missing_devices([node(at(400), 0)], 8, 4, ["p4de.24xlarge"],
                                                  300, now)
    assert missing_devices([node(at(400), 4)], 8, 4, ["p4de.24xlarge"], 300, now) is None
    assert missing_devices([node(at(400), 0)], 8, 0, ["p4de.24xlarge"], 300, now) is None
