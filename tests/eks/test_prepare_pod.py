"""prepare_data on eks in a CPU pod of its own (prepare_on pod), against moto in server mode (S3)
and the Kubernetes emulator. The test plays the Job controller and the kubelet: it runs the
Job's own container command (trainer.prepare_data with the ConfigMap's trainer config) here, as
the pod would, so the set and the record in S3 are the real function's."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import boto3
import kmock
import kubernetes
import kubernetes_validate
import pytest
from airflow.sdk.exceptions import AirflowFailException

from finetune.config import ConfigError, RunConfig
from finetune.targets.eks.image_build import JOB_NAME_LABEL
from finetune.targets.eks.manifests import (
    CONTAINER_NAME,
    GPU_RESOURCE,
    TRAINER_CONFIG_DIR,
    TRAINER_CONFIG_FILE,
    prepare_job_manifest,
)
from finetune.validate import validate_params
from finetune_contract.fields import PREPARE_DATA_FILE
from tests.support import REPO_ROOT
from tests.support.deferral import run_deferred
from tests.support.eks import EKS_PARAMS, NS, eks_config, stage_operator
from tests.support.kube import Cluster
from tests.support.schemas import K8S_VERSION

BUCKET = "bucket"  # EKS_PARAMS' output_dir is s3://bucket/runs
SELECTOR = "eks.amazonaws.com/nodegroup=cpu,kubernetes.io/arch=amd64"


def pod_config(**changes: Any) -> RunConfig:
    return eks_config(**{"prepare_on": "pod", "prepare_node_selector": SELECTOR,
                         "prepare_cpu": 2, "prepare_memory_gib": 8, **changes})


@pytest.fixture
def session(aws: str, monkeypatch: pytest.MonkeyPatch) -> boto3.Session:
    from finetune.targets.eks import target

    s = boto3.Session(region_name="us-east-1")
    s.client("s3").create_bucket(Bucket=BUCKET)
    monkeypatch.setattr(target, "aws_session", lambda aws_conn_id: s)
    return s


@pytest.fixture
def kube(cluster: Cluster) -> Cluster:
    cluster.emulator.resources["batch/v1/jobs"] = kmock.ResourceInfo(namespaced=True)
    return cluster


class Kubelet(threading.Thread):
    """Plays the Job controller and the kubelet for the run's prepare_data Job: makes its pod,
    runs the container's command here (its ConfigMap's config at the mounted path, boto3 at
    moto), and ends the pod and the Job as the process did; `oom`: the kernel kills it first."""

    def __init__(self, cluster: Cluster, tmp_path: Path, oom: bool = False):
        super().__init__(daemon=True)
        self.cluster, self.tmp_path, self.oom = cluster, tmp_path, oom
        self.job: dict[str, Any] | None = None
        self.returncode: int | None = None

    def run(self) -> None:
        api = self.cluster.api()
        batch, core = kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (jobs := batch.list_namespaced_job(NS).items):
            time.sleep(0.02)
        if not jobs:
            return
        self.job = job = api.sanitize_for_serialization(jobs[0])
        name = job["metadata"]["name"]
        spec = job["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        pod = f"{name}-q8x2v"
        core.create_namespaced_pod(NS, {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod, "namespace": NS,
                         "labels": {**job["spec"]["template"]["metadata"]["labels"],
                                    JOB_NAME_LABEL: name}},
            "spec": {**spec, "nodeName": "ip-10-0-9-9"}, "status": {"phase": "Running"}})
        terminated: dict[str, Any]
        if self.oom:
            terminated = {"exitCode": 137, "reason": "OOMKilled"}
        else:
            terminated = self._run_container(core, container)
        failed = terminated["exitCode"] != 0
        core.patch_namespaced_pod_status(pod, NS, {"status": {
            "phase": "Failed" if failed else "Succeeded", "containerStatuses": [{
                "name": container["name"], "ready": False, "restartCount": 0,
                "image": container["image"], "imageID": "",
                "state": {"terminated": terminated}}]}})
        batch.patch_namespaced_job_status(name, NS, {"status": {
            "failed" if failed else "succeeded": 1}})

    def _run_container(self, core: Any, container: dict[str, Any]) -> dict[str, Any]:
        configmap = next(v["configMap"]["name"] for v in self.job["spec"]["template"]["spec"]
                         ["volumes"] if "configMap" in v)
        config = self.tmp_path / "mounted" / TRAINER_CONFIG_FILE
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(core.read_namespaced_config_map(configmap, NS).data[TRAINER_CONFIG_FILE])
        args = [str(config) if a == f"{TRAINER_CONFIG_DIR}/{TRAINER_CONFIG_FILE}" else a
                for a in container["args"]]
        python, *module = container["command"]
        assert python == "python"
        termination = self.tmp_path / "termination-log"
        env = {**os.environ, **{e["name"]: e["value"] for e in container["env"] if "value" in e},
               "TMPDIR": str(self.tmp_path), "HF_HOME": str(self.tmp_path / "hf"),
               "FINETUNE_TERMINATION_LOG": str(termination),
               "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "plugins"), str(REPO_ROOT)])}
        proc = subprocess.run([sys.executable, *module, *args], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        self.returncode = proc.returncode
        lines = (proc.stdout + proc.stderr).splitlines()
        self.cluster.emulator.pod_logs[NS, f"{self.job['metadata']['name']}-q8x2v"] = [
            ("2026-12-02T18:00:00Z", line) for line in lines]
        if proc.returncode == 0:
            return {"exitCode": 0, "reason": "Completed"}
        return {"exitCode": proc.returncode, "reason": "Error",
                "message": termination.read_text() if termination.exists() else ""}


def run_prepare(cfg: RunConfig) -> tuple[dict, list[dict]]:
    return run_deferred(stage_operator("prepare_data", cfg))


def objects_left(cluster: Cluster) -> list[str]:
    api = cluster.api()
    batch, core = kubernetes.client.BatchV1Api(api), kubernetes.client.CoreV1Api(api)
    return [f"job/{j.metadata.name}" for j in batch.list_namespaced_job(NS).items] + \
        [f"pod/{p.metadata.name}" for p in core.list_namespaced_pod(NS).items]


def test_prepare_job_is_a_valid_cpu_job_on_the_users_nodes_that_never_takes_a_gpu_node():
    cfg = pod_config(volumes="fsx:/fsx", service_account="trainer-s3")
    job = prepare_job_manifest(cfg, "1234.dkr.ecr/ft:abc")
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    spec = job["spec"]["template"]["spec"]
    (container,) = spec["containers"]
    assert job["spec"]["backoffLimit"] == 0 and job["spec"]["activeDeadlineSeconds"] > 0
    assert spec["nodeSelector"] == {"eks.amazonaws.com/nodegroup": "cpu",
                                    "kubernetes.io/arch": "amd64"}
    assert "tolerations" not in spec  # the GPU nodes' taint keeps it off them
    assert container["resources"]["requests"]["cpu"] == "2"
    assert container["resources"]["requests"]["memory"] == "8Gi"
    assert container["resources"]["limits"] == {"memory": "8Gi"}
    assert GPU_RESOURCE not in json.dumps(container["resources"])
    assert container["name"] == CONTAINER_NAME and container["image"] == "1234.dkr.ecr/ft:abc"
    assert container["command"] == ["python", "-m", "trainer.prepare_data"]
    args = container["args"]
    assert args[args.index("--prepared-root") + 1] == "s3://bucket/runs/prepared_data"
    assert args[args.index("--record") + 1] == f"{cfg.run_dir}/{PREPARE_DATA_FILE}"
    assert args[args.index("--num-proc") + 1] == "2"  # the pod's cores, not the node's
    assert spec["serviceAccountName"] == "trainer-s3"
    assert {"name": "data-0", "mountPath": "/fsx"} in container["volumeMounts"]
    assert spec["restartPolicy"] == "Never"


@pytest.mark.slow  # the worker's function on a real data set: 10-12 s
def test_pod_prepares_the_set_in_s3_with_the_workers_function_and_the_run_goes_on_with_it(
        session, kube, tmp_path, task_log):
    kubelet = Kubelet(kube, tmp_path)
    kubelet.start()
    result, events = run_prepare(pod_config())
    kubelet.join(5)
    assert kubelet.returncode == 0 and events == [{"state": "Complete", "message": ""}]
    cfg = RunConfig.from_dict(result)
    assert cfg.prepared_data.startswith("s3://bucket/runs/prepared_data/")
    assert cfg.counted_train_rows > 0 and cfg.counted_batches_per_epoch > 0
    s3 = session.client("s3")
    prefix = cfg.prepared_data.removeprefix("s3://bucket/") + "/"
    keys = {o["Key"][len(prefix):] for o in
            s3.list_objects_v2(Bucket=BUCKET, Prefix=prefix)["Contents"]}
    assert {"stats.json", "train/state.json", "eval/state.json"} <= keys
    record = json.loads(s3.get_object(Bucket=BUCKET, Key=cfg.run_dir.removeprefix(
        "s3://bucket/") + f"/{PREPARE_DATA_FILE}")["Body"].read())
    assert record["run_id"] == cfg.run_id and record["num_proc"] == 2
    assert not record["cache_hit"]
    assert objects_left(kube) == []  # the Job and its pod are deleted once read
    # The same key prepared on the worker is the pod's set: a cache hit, nothing encoded.
    again = stage_operator("prepare_data", dataclasses.replace(
        pod_config(run_id="manual__again"), prepare_on="worker")).execute({})
    assert again["prepared_data"] == cfg.prepared_data
    assert any("cache hit" in line for line in task_log)


@pytest.mark.slow  # the worker's function on a real data set: 10-12 s
def test_a_bad_row_in_the_pod_fails_the_stage_naming_file_and_line_and_leaves_nothing(
        session, kube, tmp_path):
    kubelet = Kubelet(kube, tmp_path)
    kubelet.start()
    data = tmp_path / "rows.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"})
                              for i in range(50)) + '\n{"prompt": "q", "resp\n')
    with pytest.raises(AirflowFailException) as err:  # a verdict: no retry
        run_prepare(pod_config(dataset=str(data), bad_rows="error"))
    kubelet.join(5)
    first = str(err.value).splitlines()[0]
    assert first.startswith("prepare_data pod failed: ValueError: ")
    assert "rows.jsonl line 51" in first
    assert "last lines of" in str(err.value)  # the pod's log tail follows
    assert objects_left(kube) == []


def test_an_oom_killed_pod_fails_the_stage_with_that_first_and_leaves_nothing(session, kube,
                                                                             tmp_path):
    kubelet = Kubelet(kube, tmp_path, oom=True)
    kubelet.start()
    with pytest.raises(AirflowFailException) as err:  # a verdict: no retry
        run_prepare(pod_config())
    kubelet.join(5)
    first = str(err.value).splitlines()[0]
    assert "OOMKilled" in first and "ip-10-0-9-9" in first
    assert objects_left(kube) == []


def test_a_prepare_task_marked_failed_while_deferred_deletes_its_job(session, kube):
    import asyncio

    from airflow.sdk.exceptions import TaskDeferred

    from tests.support.deferral import reloaded

    with pytest.raises(TaskDeferred) as deferred:
        stage_operator("prepare_data", pod_config()).execute({})
    assert deferred.value.method_name == "resume"
    assert deferred.value.kwargs["resume"] == "prepare_job_done"
    assert [o.split("/")[0] for o in objects_left(kube)] == ["job"]
    asyncio.run(reloaded(deferred.value.trigger).on_kill())
    assert objects_left(kube) == []


def test_a_retry_of_prepare_adopts_the_running_job_of_the_first_try(session, kube):
    from airflow.sdk.exceptions import TaskDeferred

    cfg = pod_config()
    for _ in range(2):
        with pytest.raises(TaskDeferred):
            stage_operator("prepare_data", cfg).execute({})
    assert [o.split("/")[0] for o in objects_left(kube)] == ["job"]


def test_teardown_deletes_a_prepare_pod_left_running(session, kube, nodegroup, tmp_path):
    from finetune.targets.eks import prepare_pod
    from tests.support.eks import target

    cfg = pod_config()
    prepare_pod.start_prepare_job(kube.api(), cfg, "1234.dkr.ecr/ft:abc")
    name = prepare_job_manifest(cfg, "x")["metadata"]["name"]
    kubernetes.client.CoreV1Api(kube.api()).create_namespaced_pod(NS, {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"{name}-abcde", "namespace": NS,
                     "labels": {JOB_NAME_LABEL: name}},
        "spec": {"containers": [{"name": CONTAINER_NAME, "image": "x"}]},
        "status": {"phase": "Running"}})
    assert objects_left(kube) == [f"job/{name}", f"pod/{name}-abcde"]
    t = target()
    done = t.teardown(cfg, t.snapshot(cfg))
    assert f"job/{name}" in done["deleted"] and f"pod/{name}-abcde" in done["deleted"]
    assert objects_left(kube) == []


@pytest.mark.parametrize(("changes", "field", "needle"), [
    ({"prepare_on": "pod", "output_dir": "/fsx/runs", "volumes": "fsx:/fsx"}, "output_dir",
     "prepare_on pod writes the prepared set"),
    ({"prepare_node_selector": "nodegroup"}, "prepare_node_selector", "is not label=value"),
    ({"prepare_node_selector": "a=b,a=c"}, "prepare_node_selector", "given twice"),
    ({"prepare_on": "gpu"}, "prepare_on", "worker"),
    ({"prepare_cpu": 0}, "prepare_cpu", ">= 1"),
])
def test_bad_prepare_pod_params_are_refused_at_validate_naming_the_field(changes, field, needle):
    with pytest.raises(ConfigError) as err:
        validate_params({**EKS_PARAMS, **changes}, run_id="manual__bad_prepare")
    fields = {f: m for f, m in err.value.errors}
    assert field in fields and needle in fields[field], err.value.errors
