"""The evaluate stage's job on eks: trainer.evaluate in the trainer image on the run's nodes."""

from __future__ import annotations

import json
import threading
import time

import boto3
import kubernetes
import pytest
from airflow.sdk.exceptions import AirflowFailException

from finetune.targets.eks.launchers import LAUNCHERS, PYTORCHJOB, TRAINJOB
from finetune.targets.eks.manifests import (
    GPU_RESOURCE,
    KUEUE_QUEUE_LABEL,
    LABEL_PROGRAM,
    NODEGROUP_LABEL,
    configmap_name,
    evaluation_job_manifest,
    evaluation_job_name,
    evaluation_trainjob_manifest,
    job_name,
    run_selector,
)
from finetune_contract.fields import EVALUATION_FILE
from tests.support.eks import IMAGE, NS, eks_config, run_stage, set_condition, target
from tests.support.schemas import assert_valid_pytorchjob, assert_valid_trainjob
from tests.support.trainer import set_trainjob_status, trainjob_config

CONFIGS = {PYTORCHJOB.name: eks_config, TRAINJOB.name: trainjob_config}


def test_the_evaluation_job_runs_trainer_evaluate_on_one_gpu_of_the_run_s_nodes():
    cfg = eks_config()
    job = evaluation_job_manifest(cfg, "registry/trainer:abc", "s3://bucket/runs/old/model")
    assert_valid_pytorchjob(job)
    assert job["metadata"]["name"] != job_name(cfg)  # never adopted as the training's job
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 1 and worker["restartPolicy"] == "Never"
    pod = worker["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == "registry/trainer:abc"
    assert container["command"] == ["python", "-m", "trainer.evaluate"]
    assert container["args"][-2:] == ["--champion", "s3://bucket/runs/old/model"]
    assert container["resources"]["limits"] == {GPU_RESOURCE: 1}
    assert pod["nodeSelector"][NODEGROUP_LABEL] == cfg.nodegroup
    assert {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v} == {
        configmap_name(cfg)}
    assert job["spec"]["runPolicy"]["backoffLimit"] == 0


def test_with_launcher_trainjob_the_evaluation_is_a_one_gpu_trainjob_on_the_runtime():
    # A cluster with Kubeflow Trainer v2 only has no PyTorchJob CRD: evaluate must not need it.
    cfg = trainjob_config(nodes=2, queue_name="gpu")
    job = evaluation_trainjob_manifest(cfg, "registry/trainer:abc", "s3://bucket/old/model")
    assert_valid_trainjob(job)
    assert job["metadata"]["name"] == evaluation_job_name(cfg) != job_name(cfg)
    assert job["metadata"]["labels"][LABEL_PROGRAM] == "evaluate"
    assert KUEUE_QUEUE_LABEL not in job["metadata"]["labels"] and "suspend" not in job["spec"]
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (1, 1)
    assert trainer["command"] == ["python", "-m", "trainer.evaluate"]
    assert trainer["args"][-2:] == ["--champion", "s3://bucket/old/model"]
    assert trainer["resourcesPerNode"]["limits"] == {GPU_RESOURCE: 1}
    # The same container as the PyTorchJob's evaluation: one place says what it runs.
    pytorchjob = evaluation_job_manifest(cfg, "registry/trainer:abc", "s3://bucket/old/model")
    container = pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"][
        "containers"][0]
    assert (trainer["args"], trainer["resourcesPerNode"]) == (container["args"],
                                                               container["resources"])
    assert not {e["name"] for e in trainer["env"]} & {"FI_PROVIDER", "NCCL_SOCKET_IFNAME"}


def run_jobs_left(cluster, cfg) -> list[str]:
    """Every job of the run, of every kind a launcher makes, still on the cluster."""
    custom = kubernetes.client.CustomObjectsApi(cluster.api())
    return [f"{launcher.name}/{item['metadata']['name']}" for launcher in LAUNCHERS.values()
            for item in custom.list_namespaced_custom_object(
                launcher.group, launcher.version, NS, launcher.plural,
                label_selector=run_selector(cfg))["items"]]


def play_the_evaluation(cluster, cfg, outcome: str, evaluation: dict | None) -> threading.Thread:
    """The operator (of the run's launcher) and trainer.evaluate: once the job exists,
    evaluation.json in the run directory (S3), then the job's outcome."""
    launcher = LAUNCHERS[cfg.launcher]

    def run() -> None:
        custom = kubernetes.client.CustomObjectsApi(cluster.api())
        name = evaluation_job_name(cfg)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                custom.get_namespaced_custom_object(launcher.group, launcher.version, NS,
                                                    launcher.plural, name)
                break
            except kubernetes.client.ApiException:
                time.sleep(0.02)
        if evaluation is not None:
            bucket, _, prefix = cfg.run_dir.removeprefix("s3://").partition("/")
            boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}/{EVALUATION_FILE}",
                                          Body=json.dumps(evaluation).encode())
        if launcher is TRAINJOB:
            set_trainjob_status(cluster, name, {"Succeeded": "Complete"}.get(outcome, outcome))
        else:
            set_condition(cluster, name, outcome)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
@pytest.mark.parametrize("launcher", list(CONFIGS))
def test_evaluate_on_eks_runs_a_job_of_the_run_s_launcher_and_teardown_deletes_it(
        nodegroup, cluster, launcher):
    cfg, t = CONFIGS[launcher](), target()
    snapshot = t.snapshot(cfg)
    boto3.client("s3").create_bucket(Bucket="bucket")  # eks_config's output_dir
    evaluation = {"loss": 2.5, "perplexity": 12.18, "tasks": {"demo_instructions": {"acc": 0.6}},
                  "samples": [], "champion": None}
    player = play_the_evaluation(cluster, cfg, "Succeeded", evaluation)
    result = run_stage("evaluate", cfg, trained={}, image=IMAGE, champion={})
    player.join(5)
    assert (result["loss"], result["perplexity"]) == (2.5, 12.18)
    assert result["tasks"] == {"demo_instructions": {"acc": 0.6}}
    assert result["evaluation"] == f"{cfg.run_dir}/{EVALUATION_FILE}"
    assert run_jobs_left(cluster, cfg) == [f"{launcher}/{evaluation_job_name(cfg)}"]

    done = t.teardown(cfg, snapshot)
    assert f"{launcher}/{evaluation_job_name(cfg)}" in done["deleted"]
    assert run_jobs_left(cluster, cfg) == []  # nothing of the run is left on the cluster


@pytest.mark.slow
@pytest.mark.parametrize("launcher", list(CONFIGS))
def test_a_failed_evaluation_job_fails_evaluate_naming_the_job(nodegroup, cluster, launcher):
    cfg = CONFIGS[launcher]()
    boto3.client("s3").create_bucket(Bucket="bucket")
    player = play_the_evaluation(cluster, cfg, "Failed", None)
    kind = LAUNCHERS[launcher].kind
    with pytest.raises(AirflowFailException, match=f"evaluation failed: {kind} ml/"
                                                   f"{evaluation_job_name(cfg)} failed"):
        run_stage("evaluate", cfg, trained={}, image=IMAGE, champion={})
    player.join(5)
