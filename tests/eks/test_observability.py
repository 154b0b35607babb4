"""containers/observability/: the DCGM exporter DaemonSet, the Prometheus scrape jobs and the
Grafana dashboard parse, validate, and name the series the exporter and the trainer export."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import yaml

from finetune.gpu_metrics import DCGM_SERIES
from finetune.targets.eks.manifests import (
    APP,
    LABEL_REPLICA_INDEX,
    METRICS_PORT_NAME,
    pytorchjob_manifest,
)
from tests.support.eks import eks_config
from tests.support.schemas import K8S_VERSION
from tests.support.system import system_binary_or_skip
from trainer.metrics_endpoint import EVAL_GAUGE, MAX_STEPS_GAUGE, TRAIN_GAUGES

OBSERVABILITY = Path(__file__).resolve().parents[2] / "containers" / "observability"
TRAINER_SERIES = {name for name, _ in TRAIN_GAUGES.values()} | {EVAL_GAUGE[0],
                                                                 MAX_STEPS_GAUGE[0]}


def test_dcgm_exporter_manifests_validate_and_map_gpus_to_pods_on_9400():
    docs = list(yaml.safe_load_all((OBSERVABILITY / "dcgm-exporter.yaml").read_text()))
    assert [d["kind"] for d in docs] == ["Namespace", "ServiceAccount", "DaemonSet", "Service"]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    daemonset = docs[2]
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DCGM_EXPORTER_KUBERNETES"] == "true" and env["DCGM_EXPORTER_LISTEN"] == ":9400"
    assert container["ports"] == [{"name": "metrics", "containerPort": 9400}]
    assert {"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources",
            "readOnly": True} in container["volumeMounts"]
    assert docs[3]["spec"]["ports"][0]["port"] == 9400


def test_scrape_config_passes_promtool_and_finds_the_exporter_and_the_trainer(tmp_path):
    config = yaml.safe_load((OBSERVABILITY / "prometheus-scrape.yaml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["dcgm-exporter"]["honor_labels"] is True  # the GPU's pod, not the exporter's
    trainer_keeps = {tuple(r["source_labels"]): r["regex"]
                     for r in jobs["finetune-trainer"]["relabel_configs"]
                     if r.get("action") == "keep"}
    assert trainer_keeps == {
        ("__meta_kubernetes_pod_label_app_kubernetes_io_managed_by",): APP,
        ("__meta_kubernetes_pod_container_port_name",): METRICS_PORT_NAME,
        # only worker 0 (rank 0) serves the endpoint
        ("__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", LABEL_REPLICA_INDEX),):
            "0"}
    promtool = system_binary_or_skip("promtool", "prometheus")
    # Debian's Prometheus is built without Kubernetes discovery: check the rest with static
    # targets in its place (the relabelling rules, intervals, job names)
    for job in config["scrape_configs"]:
        job.pop("kubernetes_sd_configs")
        job["static_configs"] = [{"targets": ["127.0.0.1:9400"]}]
    checked = tmp_path / "prometheus.yml"
    checked.write_text(yaml.safe_dump(config))
    result = subprocess.run([promtool, "check", "config", str(checked)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dashboard_queries_exactly_the_series_the_exporter_and_trainer_export():
    dashboard = json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    named = {m for expr in exprs for m in re.findall(r"\b(DCGM_\w+|finetune_\w+)\b", expr)}
    assert named == set(DCGM_SERIES) | TRAINER_SERIES
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    used = {v for expr in exprs for v in re.findall(r"\$(\w+)", expr)}
    assert used <= variables


def test_a_trainer_with_metrics_port_exposes_it_by_name_for_the_scrape_job():
    cfg = eks_config(metrics_port=9402)
    template = pytorchjob_manifest(cfg, "img:1")["spec"]["pytorchReplicaSpecs"]["Worker"][
        "template"]
    container = template["spec"]["containers"][0]
    assert container["ports"] == [{"name": METRICS_PORT_NAME, "containerPort": 9402}]
    # only rank 0 serves metrics: no scrape annotation on every worker
    assert "annotations" not in template["metadata"]
    assert template["metadata"]["labels"]["app.kubernetes.io/managed-by"] == APP
    plain = pytorchjob_manifest(eks_config(), "img:1")["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert "ports" not in plain["template"]["spec"]["containers"][0]
