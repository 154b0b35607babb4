"""The GPU node groups' taints (containers/k8s/eksctl-cluster.yaml) and who must still run on
those nodes: the training pods, the DCGM exporter, and the device plugins that advertise
nvidia.com/gpu and vpc.amazonaws.com/efa. A taint nothing there tolerates keeps a plugin off
the nodes, and scale_up waits for GPUs or EFA that never come."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from finetune.targets.eks.manifests import pytorchjob_manifest
from tests.support.eks import eks_config

K8S = Path(__file__).resolve().parents[2] / "containers"
# The tolerations of the EFA device plugin DaemonSet as eksctl installs it (its manifest, and
# aws-samples/aws-efa-eks's): the patch shipped here must add to these, not rely on others.
EFA_PLUGIN_TOLERATIONS = [{"key": "CriticalAddonsOnly", "operator": "Exists"},
                          {"key": "aws.amazon.com/efa", "operator": "Exists",
                           "effect": "NoSchedule"}]
# The NVIDIA device plugin's (NVIDIA/k8s-device-plugin's static DaemonSet).
NVIDIA_PLUGIN_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists",
                              "effect": "NoSchedule"}]


def tolerates(tolerations: list[dict], taint: dict) -> bool:
    """Kubernetes' rule for one taint: a matching key (Exists, or Equal to the value) and
    effect (or none given)."""
    for t in tolerations:
        key_ok = t.get("key") == taint["key"] or (not t.get("key") and
                                                  t.get("operator") == "Exists")
        value_ok = t.get("operator") == "Exists" or t.get("value") == taint.get("value")
        effect_ok = not t.get("effect") or t["effect"] == taint["effect"]
        if key_ok and value_ok and effect_ok:
            return True
    return False


def gpu_taints() -> list[dict]:
    cluster = yaml.safe_load((K8S / "k8s" / "eksctl-cluster.yaml").read_text())
    groups = [g for g in cluster["managedNodeGroups"] if g["name"].startswith("gpu-")]
    assert groups
    return [taint for group in groups for taint in group.get("taints", [])]


def patched_efa_plugin_tolerations() -> list[dict]:
    patch = yaml.safe_load((K8S / "k8s" / "efa-device-plugin-patch.yaml").read_text())
    return patch["spec"]["template"]["spec"]["tolerations"]


def dcgm_tolerations() -> list[dict]:
    docs = yaml.safe_load_all((K8S / "observability" / "dcgm-exporter.yaml").read_text())
    daemonset = next(d for d in docs if d and d.get("kind") == "DaemonSet")
    return daemonset["spec"]["template"]["spec"]["tolerations"]


def job_tolerations() -> list[dict]:
    cfg = eks_config(instance_type="p5.48xlarge")
    worker = pytorchjob_manifest(cfg, "img:1")["spec"]["pytorchReplicaSpecs"]["Worker"]
    return worker["template"]["spec"]["tolerations"]


@pytest.mark.parametrize("who, tolerations", [
    ("training pods", job_tolerations),
    ("DCGM exporter", dcgm_tolerations),
    ("NVIDIA device plugin", lambda: NVIDIA_PLUGIN_TOLERATIONS),
    ("EFA device plugin, patched", patched_efa_plugin_tolerations),
])
def test_every_gpu_node_taint_is_tolerated_by_what_must_run_there(who, tolerations):
    untolerated = [t for t in gpu_taints() if not tolerates(tolerations(), t)]
    assert untolerated == [], f"{who} does not tolerate {untolerated}"


def test_the_patch_keeps_the_efa_plugins_own_tolerations():
    patched = patched_efa_plugin_tolerations()
    assert all(t in patched for t in EFA_PLUGIN_TOLERATIONS)


def test_the_unpatched_efa_plugin_would_not_run_on_the_gpu_nodes():
    """Why the patch exists: the check above would fail without it."""
    assert not all(tolerates(EFA_PLUGIN_TOLERATIONS, t) for t in gpu_taints())
