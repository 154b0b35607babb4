"""The eks target's manifests: valid against the real CRD and Kubernetes schemas, and carrying
what the run needs (sizes, rendezvous, resources, secrets only by reference)."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from finetune.config import ConfigError
from finetune.run_plan import plan_run
from finetune.targets.eks.manifests import (
    ETCD_PORT,
    LABEL_RUN,
    etcd_manifests,
    evaluation_job_manifest,
    job_name,
    pytorchjob_manifest,
    trainer_configmap_manifest,
)
from finetune.validate import validate_params
from finetune_contract.fields import STRATEGIES
from finetune_contract.instance_types import INSTANCE_TYPES
from finetune_contract.parameters import RDZV_BACKENDS
from tests.support.eks import EKS_PARAMS, eks_config
from tests.support.schemas import K8S_VERSION, assert_valid_pytorchjob


def test_schema_check_rejects_a_malformed_pytorchjob():
    bad = pytorchjob_manifest(eks_config(), "img:1")
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = "two"
    with pytest.raises(AssertionError, match="replicas"):
        assert_valid_pytorchjob(bad)


@pytest.mark.parametrize("instance_type", sorted(INSTANCE_TYPES))
@pytest.mark.parametrize("backend", RDZV_BACKENDS)
def test_every_generated_pytorchjob_validates_against_the_crd(instance_type, backend):
    gpus = INSTANCE_TYPES[instance_type].gpus
    for strategy in STRATEGIES:
        for nodes in (1, 2, 3, 8, 16, 64, 128):
            cfg = eks_config(instance_type=instance_type, rdzv_backend=backend,
                             strategy=strategy, nodes=nodes, procs_per_node=gpus,
                             max_nodes=128)
            manifest = pytorchjob_manifest(cfg, "img:1")
            assert_valid_pytorchjob(manifest)
            worker = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]
            assert worker["replicas"] == nodes
            assert manifest["spec"]["elasticPolicy"]["rdzvBackend"] == backend


def test_pytorchjobs_for_1_to_128_nodes_validate_and_size_the_workers():
    for nodes in range(1, 129):
        cfg = eks_config(nodes=nodes, max_nodes=128)
        manifest = pytorchjob_manifest(cfg, "img:1")
        assert_valid_pytorchjob(manifest)
        elastic = manifest["spec"]["elasticPolicy"]
        assert elastic["minReplicas"] == elastic["maxReplicas"] == nodes


def test_pytorchjob_carries_rendezvous_resources_and_placement_for_p4de():
    cfg = eks_config(nodes=4, max_restarts=2)
    manifest = pytorchjob_manifest(cfg, "1234.dkr.ecr/ft:abc")
    elastic = manifest["spec"]["elasticPolicy"]
    assert elastic == {"rdzvBackend": "etcd-v2", "rdzvHost": "etcd.ml.svc",
                       "rdzvPort": ETCD_PORT, "rdzvId": cfg.rdzv_id, "minReplicas": 4,
                       "maxReplicas": 4, "maxRestarts": 2}
    assert manifest["spec"]["nprocPerNode"] == "8"
    run_policy = manifest["spec"]["runPolicy"]
    assert run_policy["activeDeadlineSeconds"] == cfg.active_deadline_s
    assert {"cleanPodPolicy", "ttlSecondsAfterFinished", "backoffLimit"} <= set(run_policy)
    pod = manifest["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 4,
                                                "hugepages-2Mi": "5120Mi"}
    assert container["args"][-2:] == ["--config", "/etc/finetune/trainer_config.json"]
    assert pod["nodeSelector"]["eks.amazonaws.com/nodegroup"] == "gpu-p4de"
    assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    env = {e["name"]: e for e in container["env"]}
    assert env["FI_PROVIDER"]["value"] == "efa"
    assert env["TORCH_FR_BUFFER_SIZE"]["value"] != "0"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"]["value"] == "1"
    # torchrun's in-place worker restarts get a new c10d store each round
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"]["value"] == "1"
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {
        "secretKeyRef": {"name": "hf", "key": "token"}}}
    assert manifest["metadata"]["labels"][LABEL_RUN] == cfg.rdzv_id


def _pods_of_both_launchers(instance_type: str) -> list[dict]:
    """The env and resources of the PyTorchJob's worker and of the TrainJob for the type."""
    from finetune.targets.eks.manifests import trainjob_manifest

    gpus = INSTANCE_TYPES[instance_type].gpus
    cfg = eks_config(instance_type=instance_type, procs_per_node=gpus)
    worker = pytorchjob_manifest(cfg, "img:1")["spec"]["pytorchReplicaSpecs"]["Worker"]
    container = worker["template"]["spec"]["containers"][0]
    trainjob_cfg = eks_config(instance_type=instance_type, procs_per_node=gpus,
                              launcher="trainjob", rdzv_backend="c10d", max_restarts=0)
    trainer = trainjob_manifest(trainjob_cfg, "img:1")["spec"]["trainer"]
    return [{"env": container["env"], "resources": container["resources"]},
            {"env": trainer["env"], "resources": trainer["resourcesPerNode"]}]


@pytest.mark.parametrize("instance_type", sorted(INSTANCE_TYPES))
def test_each_pod_gets_its_instance_profiles_devices_resources_and_nccl_environment(
        instance_type):
    profile = INSTANCE_TYPES[instance_type]
    for pod in _pods_of_both_launchers(instance_type):
        env = {e["name"]: e.get("value") for e in pod["env"]}
        # the profile's NCCL/EFA settings, and no type-dependent one from anywhere else
        assert {k: env.get(k) for k in profile.nccl_env} == profile.nccl_env
        type_dependent = {k for k in env if k.startswith("FI_") or k in (
            "NCCL_NVLS_ENABLE", "NCCL_PROTO", "NCCL_ALGO")}
        assert type_dependent <= set(profile.nccl_env)
        assert ("FI_EFA_USE_DEVICE_RDMA" in env) == profile.efa_rdma_read
        limits, requests = pod["resources"]["limits"], pod["resources"]["requests"]
        assert limits.get("vpc.amazonaws.com/efa", 0) == profile.efa
        assert limits["nvidia.com/gpu"] == profile.gpus
        # devices and huge pages: requests equal limits (Kubernetes refuses anything else)
        assert {k: requests[k] for k in limits} == limits
        assert ("hugepages-2Mi" in limits) == (profile.efa > 0)
        # what the pod asks for fits what the node has left after the kubelet's reservation
        assert int(requests["cpu"]) * 1000 <= profile.allocatable_cpu_m
        hugepages = profile.hugepages_mib
        assert int(requests["memory"].removesuffix("Gi")) * 1024 + hugepages \
            <= profile.allocatable_memory_mib


def test_every_instance_type_eksctl_lists_as_efa_capable_gets_its_efa_and_rdma_only_where_sourced():
    # eksctl's table lists every supported type as EFA-capable (g5/g6 .12xlarge included)
    assert all(p.efa >= 1 for p in INSTANCE_TYPES.values())
    assert {n for n, p in INSTANCE_TYPES.items() if p.efa_rdma_read} == {
        "p4d.24xlarge", "p4de.24xlarge", "p5.48xlarge", "p5e.48xlarge", "p5en.48xlarge"}
    # NVLS is left on (NCCL's default) where the NVSwitch has it
    assert all("NCCL_NVLS_ENABLE" not in p.nccl_env for p in INSTANCE_TYPES.values())
    for profile in INSTANCE_TYPES.values():
        assert profile.busbw_intra_gbps > 0 and profile.busbw_inter_gbps > 0
        assert profile.busbw_source


def _worker(manifest: dict) -> dict:
    return manifest["spec"]["pytorchReplicaSpecs"]["Worker"]


def test_a_spot_elastic_run_is_retried_on_a_saved_notice_within_the_plans_grace():
    cfg = eks_config(nodes=4, min_nodes=2, max_restarts=2, node_wait_s=120,
                     capacity_type="spot")
    manifest = pytorchjob_manifest(cfg, "img:1")
    assert_valid_pytorchjob(manifest)
    elastic = manifest["spec"]["elasticPolicy"]
    # torchrun --nnodes 2:4 (the operator's PET_NNODES), the survivors go on after node_wait_s
    assert (elastic["minReplicas"], elastic["maxReplicas"], elastic["maxRestarts"]) == (2, 4, 2)
    assert elastic["rdzvConf"] == [{"key": "last_call_timeout", "value": "120"}]
    worker = _worker(manifest)
    # 138 (a saved notice) is retried by the operator without counting against backoffLimit
    assert worker["replicas"] == 4 and worker["restartPolicy"] == "ExitCode"
    pod = worker["template"]["spec"]
    grace = plan_run(cfg).grace_s
    assert pod["terminationGracePeriodSeconds"] == grace
    container = pod["containers"][0]
    assert container["command"] == ["python", "-m", "trainer.launch"]  # exits 138 after a save
    env = {e["name"]: e.get("value") for e in container["env"]}
    # torchrun's agent waits for its workers' save, and exits, within the grace
    assert 0 < int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < grace


def test_a_run_that_is_not_elastic_needs_all_its_nodes_and_its_checks_are_not_retried():
    cfg = eks_config(nodes=3, min_nodes=3, max_restarts=1)
    elastic = pytorchjob_manifest(cfg, "img:1")["spec"]["elasticPolicy"]
    assert (elastic["minReplicas"], elastic["maxReplicas"]) == (3, 3)
    assert "rdzvConf" not in elastic
    elastic_cfg = eks_config(nodes=3, min_nodes=2, max_restarts=1)
    preflight = pytorchjob_manifest(elastic_cfg, "img:1", program="preflight")
    assert_valid_pytorchjob(preflight)
    assert preflight["spec"]["elasticPolicy"]["minReplicas"] == 3
    assert "rdzvConf" not in preflight["spec"]["elasticPolicy"]
    assert _worker(preflight)["restartPolicy"] == "OnFailure"
    evaluation = evaluation_job_manifest(elastic_cfg, "img:1")
    assert_valid_pytorchjob(evaluation)
    assert "rdzvConf" not in evaluation["spec"]["elasticPolicy"]
    pod = _worker(evaluation)["template"]["spec"]
    assert "terminationGracePeriodSeconds" not in pod  # plain python, nothing to save
    assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in {e["name"] for e in pod["containers"][0]["env"]}


def test_c10d_rendezvous_lives_on_worker_0():
    cfg = eks_config(rdzv_backend="c10d")
    elastic = pytorchjob_manifest(cfg, "img:1")["spec"]["elasticPolicy"]
    assert elastic["rdzvHost"] == f"{job_name(cfg)}-worker-0"


def test_the_token_value_never_appears_in_a_manifest():
    text = json.dumps(pytorchjob_manifest(eks_config(), "img:1"))
    assert "secretKeyRef" in text and "hf_" not in text.lower().replace("hf_token", "")


def test_names_and_labels_are_dns_safe_for_odd_run_ids():
    cfg = eks_config(run_id="scheduled__2026-11-29T10:00:00.123456+00:00 / ÄÖ" + "x" * 200)
    manifest = pytorchjob_manifest(cfg, "img:1")
    name = manifest["metadata"]["name"]
    assert len(f"{name}-worker-127") <= 63 and name[0].isalpha()
    kubernetes_validate.validate(trainer_configmap_manifest(cfg), K8S_VERSION, strict=True)
    assert all(len(v) <= 63 for v in manifest["metadata"]["labels"].values())


def test_configmap_holds_the_trainer_config_with_paths_as_the_pod_sees_them():
    cfg = eks_config()
    cm = trainer_configmap_manifest(cfg)
    kubernetes_validate.validate(cm, K8S_VERSION, strict=True)
    data = json.loads(cm["data"]["trainer_config.json"])
    assert data["dataset"] == "trainer/demo/instructions.jsonl"  # relative to the image's /app
    assert data["output_dir"] == f"s3://bucket/runs/{cfg.run_name}"
    assert data["strategy"] == cfg.strategy


def test_etcd_deployment_and_service_validate_and_enable_the_v2_api():
    deployment, service = etcd_manifests("ml")
    for manifest in (deployment, service):
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)
    assert "--enable-v2=true" in deployment["spec"]["template"]["spec"]["containers"][0][
        "command"]
    assert service["metadata"]["name"] == "etcd"
    assert service["spec"]["ports"][0]["port"] == 2379


def test_shipped_etcd_yaml_is_what_the_function_builds():
    shipped = list(yaml.safe_load_all(
        (Path(__file__).resolve().parents[2] / "containers/k8s/etcd.yaml").read_text()))
    assert shipped == etcd_manifests("default")


@pytest.mark.parametrize(("conf", "field", "needle"), [
    ({"cluster_name": ""}, "cluster_name", "required for target eks"),
    ({"nodegroup": ""}, "nodegroup", "required for target eks"),
    ({"image": ""}, "build_bucket", "required to build the image"),
    ({"image": "", "image_builder": "prebuilt"}, "image", "required with image_builder"),
    ({"nodes": 20, "max_nodes": 16}, "nodes", "max_nodes"),
    ({"procs_per_node": 16}, "procs_per_node", "has 8 GPUs"),
    ({"namespace": "ML_team"}, "namespace", "DNS label"),
    ({"output_dir": "runs"}, "output_dir", "s3://"),
    ({"rdzv_backend": "zookeeper"}, "rdzv_backend", "etcd-v2"),
    ({"etcd_reset": "wipe"}, "etcd_reset", "keys, restart"),
    ({"instance_type": "m5.large"}, "instance_type", "p4de.24xlarge"),
    ({"hf_token_secret": "Bad_Name"}, "hf_token_secret", "give the Secret's name"),
    ({"nodes": 2, "min_nodes": 1, "max_restarts": 1, "rdzv_backend": "c10d"}, "rdzv_backend",
     "its store lives on worker 0"),
    ({"capacity_type": "reserved"}, "capacity_type", "on-demand, spot, capacity-block"),
    ({"capacity_fallback": "spot"}, "capacity_fallback", "fail, on-demand"),
    ({"capacity_wait_s": 10}, "capacity_wait_s", "60"),
    ({"capacity_fallback": "on-demand"}, "fallback_nodegroup", "is empty"),
    ({"capacity_fallback": "on-demand", "fallback_nodegroup": "gpu-p4de"}, "fallback_nodegroup",
     "the run's own node group"),
    ({"fallback_nodegroup": "gpu p4de"}, "fallback_nodegroup", "EKS node group name"),
    ({"max_preemptions": -1}, "max_preemptions", "0"),
    ({"node_wait_s": 0}, "node_wait_s", "1"),
])
def test_bad_eks_param_is_refused_naming_the_field(conf, field, needle):
    with pytest.raises(ConfigError) as err:
        validate_params({**EKS_PARAMS, **conf}, run_id="r")
    message = dict(err.value.errors).get(field, "")
    assert needle in message, err.value


def test_pods_take_a_service_account_volumes_and_a_kueue_queue_and_never_run_as_root():
    cfg = validate_params({**EKS_PARAMS, "service_account": "trainer-irsa",
                           "volumes": "fsx-claim:/fsx, efs-claim:/efs/",
                           "queue_name": "gpu-queue", "model": "/fsx/models/llama",
                           "output_dir": "/efs/runs"}, run_id="manual__vol")
    job = pytorchjob_manifest(cfg, "img:1")
    assert_valid_pytorchjob(job)
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["serviceAccountName"] == "trainer-irsa"
    claims = {v["persistentVolumeClaim"]["claimName"]: v["name"] for v in pod["volumes"]
              if "persistentVolumeClaim" in v}
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert {claim: mounts[name] for claim, name in claims.items()} == {
        "fsx-claim": "/fsx", "efs-claim": "/efs"}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert pod["containers"][0]["securityContext"]["allowPrivilegeEscalation"] is False
    assert job["spec"]["nprocPerNode"] == "8" and "nProcPerNode" not in job["spec"][
        "elasticPolicy"]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "gpu-queue"
    assert job["spec"]["runPolicy"]["suspend"] is True


@pytest.mark.parametrize(("changes", "field", "words"), [
    ({"model": "/fsx/models/llama"}, "model", "on no volume the pods mount"),
    ({"volumes": "fsx-claim:/data", "dataset": "/fsx/train.jsonl"}, "dataset", "(/data)"),
    ({"volumes": "fsx-claim:/data", "output_dir": "/data-other/runs"}, "output_dir",
     "on no volume"),
    ({"volumes": "Bad_Claim:/data"}, "volumes", "claim:/mount/path"),
    ({"volumes": "claim:relative"}, "volumes", "claim:/mount/path"),
    ({"volumes": "claim:/dev/shm"}, "volumes", "claim:/mount/path"),
    ({"volumes": "a:/data,b:/data"}, "volumes", "share a mount path"),
    ({"service_account": "Not Valid"}, "service_account", "not a Kubernetes name"),
    ({"queue_name": "q_1"}, "queue_name", "not a Kubernetes name"),
])
def test_volumes_and_absolute_paths_outside_them_are_refused_naming_the_field(changes, field,
                                                                             words):
    with pytest.raises(ConfigError) as err:
        validate_params({**EKS_PARAMS, **changes}, run_id="manual__vol")
    assert any(f == field and words in m for f, m in err.value.errors), err.value.errors
