"""The cluster prerequisites in containers/k8s/ are valid and grant exactly what the code calls:
every Kubernetes call in plugins/ is allowed by rbac.yaml and every AWS call by iam-policy.json,
and neither grants anything the code does not use."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from finetune.targets.eks.launchers import LAUNCHERS
from tests.support.schemas import K8S_VERSION

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "containers" / "k8s"
# What runs on the Airflow worker: the pipeline (finetune) and the data preparation it calls.
CODE = {p: p.read_text() for package in ("finetune", "finetune_data")
        for p in sorted((ROOT / "plugins" / package).rglob("*.py"))}

# The Kubernetes client's method verbs and resources -> RBAC verbs and (apiGroup, resource).
VERBS = {"list": "list", "read": "get", "get": "get", "create": "create", "replace": "update",
         "patch": "patch", "delete": "delete"}
RESOURCES = {
    "node": ("", "nodes"),
    "namespaced_config_map": ("", "configmaps"),
    "namespaced_pod": ("", "pods"),
    "namespaced_pod_log": ("", "pods/log"),
    "namespaced_service": ("", "services"),
    "namespaced_secret": ("", "secrets"),
    "namespaced_job": ("batch", "jobs"),
    "namespaced_custom_object": None,  # the launchers' jobs: checked below
}
CLUSTER_SCOPED = {("", "nodes")}
# A call, or a bound method handed on (create_or_replace(core.create_namespaced_secret, ...)).
KUBE_CALL = re.compile(r"\.(list|read|get|create|replace|patch|delete)_(namespaced_[a-z_]+|node)\b")
# HTTP methods through the service proxy -> RBAC verbs on services/proxy.
PROXY_VERBS = {"GET": "get", "DELETE": "delete", "PUT": "update", "POST": "create"}

# boto3 clients are named after their service (eks = session.client("eks")).
AWS_VARS = ("eks", "ecr", "s3", "codebuild", "sts", "autoscaling")
AWS_CALL = re.compile(r"\b(" + "|".join(AWS_VARS) + r")\.([a-z_][a-z0-9_]*)\(")
AWS_INLINE_CALL = re.compile(r"client\(\"([a-z0-9-]+)\"\)\.([a-z_]+)\(")
NOT_API = {"get_waiter", "generate_presigned_url", "get_paginator"}
SPECIAL_ACTIONS = {  # calls whose IAM action is not the method's name
    ('eks.get_waiter("nodegroup_active"'): "eks:DescribeNodegroup",
    ('s3.generate_presigned_url("get_object"'): "s3:GetObject",
    ('s3.get_paginator("list_objects_v2"'): "s3:ListBucket",
}
# Calls whose IAM action has another name (HeadObject is allowed by GetObject; the transfer
# manager's upload_file and download_file are PutObject (multipart parts included) and GetObject).
ACTION_OF_CALL = {"s3:ListObjectsV2": "s3:ListBucket", "s3:HeadObject": "s3:GetObject",
                  "s3:UploadFile": "s3:PutObject", "s3:DownloadFile": "s3:GetObject"}
# Needed without a boto3 call: the EKS token is a presigned GetCallerIdentity; CodeBuild's
# project names a service role.
IMPLIED_ACTIONS = {"sts:GetCallerIdentity", "iam:PassRole"}


def rbac_documents() -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S_DIR / "rbac.yaml").read_text()) if d]


def kubernetes_calls() -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) for each Kubernetes API call in plugins/finetune."""
    used = set()
    for path, text in CODE.items():
        for match in KUBE_CALL.finditer(text):
            verb, what = match[1], match[2].removesuffix("_status")
            assert what in RESOURCES, f"{path.name}: add {match[0]} to RESOURCES and rbac.yaml"
            if what == "namespaced_custom_object":
                # Every custom object call is on the run's launcher's job: either one.
                assert "launcher.group" in text[match.end():match.end() + 120], (
                    f"{path.name}: a custom object other than a launcher's job: {match[0]}")
                used |= {(launcher.group, launcher.plural, VERBS[verb])
                         for launcher in LAUNCHERS.values()}
                continue
            used.add((*RESOURCES[what], VERBS[verb]))
    proxy_methods = re.findall(r"request\(\"([A-Z]+)\"", CODE[ROOT / "plugins" / "finetune" /
                                                              "etcd.py"])
    assert "/proxy" in CODE[ROOT / "plugins" / "finetune" / "targets" / "eks" / "rendezvous.py"]
    used |= {("", "services/proxy", PROXY_VERBS[m]) for m in proxy_methods}
    return used


def granted(kind: str) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) granted through bindings of `kind` (RoleBinding or
    ClusterRoleBinding) to the Airflow group."""
    docs = rbac_documents()
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    out = set()
    for binding in (d for d in docs if d["kind"] == kind):
        assert {"kind": "Group", "name": "llm-finetune-airflow",
                "apiGroup": "rbac.authorization.k8s.io"} in binding["subjects"]
        for rule in roles[binding["roleRef"]["name"]]["rules"]:
            out |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"]
                    for v in rule["verbs"]}
    return out


def aws_actions() -> set[str]:
    used = set()
    for text in CODE.values():
        calls = [(m[1], m[2], text[m.start():m.end() + 20]) for m in AWS_CALL.finditer(text)]
        calls += [(m[1], m[2], "") for m in AWS_INLINE_CALL.finditer(text)]
        for service, method, source in calls:
            if method == "exceptions":
                continue
            if method in NOT_API:
                special = [a for call, a in SPECIAL_ACTIONS.items() if source.startswith(call)]
                assert special, f"{service}.{method}: add its IAM action to SPECIAL_ACTIONS"
                used.add(special[0])
                continue
            action = f"{service}:" + "".join(w.capitalize() for w in method.split("_"))
            used.add(ACTION_OF_CALL.get(action, action))
    return used


def policy_actions() -> set[str]:
    policy = json.loads((K8S_DIR / "iam-policy.json").read_text())
    return {a for s in policy["Statement"] if s["Effect"] == "Allow"
            for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])}


@pytest.mark.parametrize("name", ["rbac.yaml", "etcd.yaml"])
def test_shipped_kubernetes_manifests_validate_against_the_schema(name):
    for doc in yaml.safe_load_all((K8S_DIR / name).read_text()):
        if doc:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_kubernetes_call_in_the_code_is_granted_and_nothing_more():
    used = kubernetes_calls()
    namespaced = granted("RoleBinding")
    cluster_wide = granted("ClusterRoleBinding")
    for call in used:
        scope = cluster_wide if call[:2] in CLUSTER_SCOPED else namespaced
        assert call in scope, f"{call} is used by the code but not granted in rbac.yaml"
    assert namespaced | cluster_wide == used, "rbac.yaml grants what the code never uses: " + \
        str(sorted((namespaced | cluster_wide) - used))


def test_every_aws_call_in_the_code_is_allowed_and_nothing_more():
    used = aws_actions() | IMPLIED_ACTIONS
    assert {"eks:DescribeNodegroup", "eks:UpdateNodegroupConfig",
            "eks:DescribeCluster"} <= used  # the scan finds the eks target's calls
    allowed = policy_actions()
    assert used - allowed == set(), "iam-policy.json lacks actions the code calls"
    assert allowed - used == set(), "iam-policy.json allows actions the code never calls"


def test_the_eksctl_example_has_gpu_node_groups_with_efa_scaled_to_zero():
    config = yaml.safe_load((K8S_DIR / "eksctl-cluster.yaml").read_text())
    assert config["kind"] == "ClusterConfig"
    groups = {g["name"]: g for g in config["managedNodeGroups"]}
    assert groups["gpu-p4de"]["instanceType"] == "p4de.24xlarge"
    assert groups["gpu-p5"]["instanceType"] == "p5.48xlarge"
    for name in ("gpu-p4de", "gpu-p5", "gpu-g5-spot", "gpu-g5-ondemand"):
        group = groups[name]
        assert group["efaEnabled"] is True
        assert group["minSize"] == group["desiredCapacity"] == 0
        assert len(group["availabilityZones"]) == 1  # EFA: one placement group, one AZ
        assert {"key": "nvidia.com/gpu", "value": "true",
                "effect": "NoSchedule"} in group["taints"]
    entries = config["accessConfig"]["accessEntries"]
    assert any("llm-finetune-airflow" in e["kubernetesGroups"] for e in entries)


def test_the_eksctl_spot_group_has_types_of_one_gpu_class_and_an_on_demand_fallback():
    from finetune_contract.instance_types import gpu_class

    groups = {g["name"]: g for g in yaml.safe_load(
        (K8S_DIR / "eksctl-cluster.yaml").read_text())["managedNodeGroups"]}
    spot, fallback = groups["gpu-g5-spot"], groups["gpu-g5-ondemand"]
    assert spot["spot"] is True and "instanceType" not in spot
    # several spot pools, every one holding the pods of the smallest (what a run names)
    assert len(spot["instanceTypes"]) > 1
    assert set(spot["instanceTypes"]) == set(gpu_class(spot["instanceTypes"][0]))
    assert not fallback.get("spot") and fallback["instanceType"] == spot["instanceTypes"][0]
