"""The evaluate stage's job on eks: trainer.evaluate in the trainer image on the run's nodes."""

from __future__ import annotations

import json
import threading
import time

import boto3
import kubernetes
import pytest

from finetune.targets.eks.manifests import (
    GPU_RESOURCE,
    LABEL_PROGRAM,
    NODEGROUP_LABEL,
    PYTORCHJOB_GROUP,
    PYTORCHJOB_PLURAL,
    PYTORCHJOB_VERSION,
    configmap_name,
    evaluation_job_manifest,
    evaluation_job_name,
    job_name,
)
from finetune_contract.fields import EVALUATION_FILE
from tests.support.eks import IMAGE, NS, eks_config, jobs_of_run, run_stage, set_condition
from tests.support.schemas import assert_valid_pytorchjob


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


def play_the_evaluation(cluster, cfg, outcome: str, evaluation: dict | None) -> threading.Thread:
    """The training operator and trainer.evaluate: once the job exists, evaluation.json in the
    run directory (S3), then the job's outcome."""
    def run() -> None:
        custom = kubernetes.client.CustomObjectsApi(cluster.api())
        name = evaluation_job_name(cfg)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                custom.get_namespaced_custom_object(PYTORCHJOB_GROUP, PYTORCHJOB_VERSION, NS,
                                                    PYTORCHJOB_PLURAL, name)
                break
            except kubernetes.client.ApiException:
                time.sleep(0.02)
        if evaluation is not None:
            bucket, _, prefix = cfg.run_dir.removeprefix("s3://").partition("/")
            boto3.client("s3").put_object(Bucket=bucket, Key=f"{prefix}/{EVALUATION_FILE}",
                                          Body=json.dumps(evaluation).encode())
        set_condition(cluster, name, outcome)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_evaluate_on_eks_runs_its_job_and_returns_what_trainer_evaluate_wrote(nodegroup, cluster):
    cfg = eks_config()
    boto3.client("s3").create_bucket(Bucket="bucket")  # eks_config's output_dir
    evaluation = {"loss": 2.5, "perplexity": 12.18, "tasks": {"demo_instructions": {"acc": 0.6}},
                  "samples": [], "champion": None}
    player = play_the_evaluation(cluster, cfg, "Succeeded", evaluation)
    result = run_stage("evaluate", cfg, trained={}, image=IMAGE, champion={})
    player.join(5)
    assert (result["loss"], result["perplexity"]) == (2.5, 12.18)
    assert result["tasks"] == {"demo_instructions": {"acc": 0.6}}
    assert result["evaluation"] == f"{cfg.run_dir}/{EVALUATION_FILE}"
    (job,) = [j for j in jobs_of_run(cluster, cfg) if j["metadata"]["name"] ==
              evaluation_job_name(cfg)]
    assert job["metadata"]["labels"][LABEL_PROGRAM] == "evaluate"


@pytest.mark.slow
def test_a_failed_evaluation_job_fails_evaluate_naming_the_job(nodegroup, cluster):
    cfg = eks_config()
    boto3.client("s3").create_bucket(Bucket="bucket")
    player = play_the_evaluation(cluster, cfg, "Failed", None)
    with pytest.raises(RuntimeError, match=f"evaluation failed: PyTorchJob ml/"
                                           f"{evaluation_job_name(cfg)} failed"):
        run_stage("evaluate", cfg, trained={}, image=IMAGE, champion={})
    player.join(5)
