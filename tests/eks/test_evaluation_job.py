"""The evaluate stage's job on eks: trainer.evaluate in the trainer image on the run's nodes."""

from __future__ import annotations

from finetune.targets.eks.manifests import (
    GPU_RESOURCE,
    NODEGROUP_LABEL,
    configmap_name,
    evaluation_job_manifest,
    job_name,
)
from tests.support.eks import eks_config
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
