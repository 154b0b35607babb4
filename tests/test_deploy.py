"""deploy/helm/values.yaml: valid YAML using keys of the official Airflow chart, wired to this
repository's layout (the chart itself cannot be downloaded here)."""

from __future__ import annotations

from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
VALUES = REPO_ROOT / "deploy" / "helm" / "values.yaml"
# Keys of the apache-airflow chart's values.yaml / parameters reference (chart 1.22), checked
# by hand; a key outside this list is a typo the chart would silently ignore.
CHART_KEYS = {
    "defaultAirflowRepository", "defaultAirflowTag", "airflowVersion", "executor", "env",
    "config", "fernetKeySecretName",
    "dags.persistence.enabled", "dags.gitSync.enabled", "dags.gitSync.repo",
    "dags.gitSync.branch", "dags.gitSync.rev", "dags.gitSync.depth", "dags.gitSync.subPath",
    "dags.gitSync.period", "dags.gitSync.credentialsSecret",
    "triggerer.enabled", "triggerer.replicas", "dagProcessor.enabled",
    "postgresql.enabled", "data.metadataSecretName",
    *(f"{c}.serviceAccount.{k}" for c in ("scheduler", "workers", "triggerer", "apiServer",
                                          "dagProcessor") for k in ("create", "annotations")),
}
EXECUTORS = {"LocalExecutor", "CeleryExecutor", "KubernetesExecutor",
             "CeleryExecutor,KubernetesExecutor"}
IRSA = "eks.amazonaws.com/role-arn"


def leaf_keys(tree: dict, prefix: str = "") -> set[str]:
    """Dotted keys down to the chart's own leaves (config, env and annotations are free-form)."""
    keys = set()
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path not in ("config",) \
                and not path.endswith(".annotations"):
            keys |= leaf_keys(value, path + ".")
        else:
            keys.add(path)
    return keys


def test_helm_values_use_only_keys_of_the_airflow_chart():
    values = yaml.safe_load(VALUES.read_text())
    assert leaf_keys(values) <= CHART_KEYS, leaf_keys(values) - CHART_KEYS


def test_helm_values_sync_dags_and_plugins_from_this_repository_and_run_a_triggerer():
    values = yaml.safe_load(VALUES.read_text())
    assert values["executor"] in EXECUTORS
    git = values["dags"]["gitSync"]
    assert git["enabled"] and (REPO_ROOT / git["subPath"] / "llm_finetune.py").is_file()
    plugins = values["config"]["core"]["plugins_folder"]
    assert plugins == "/opt/airflow/dags/repo/plugins"  # gitSync checks out under .../repo
    assert (REPO_ROOT / "plugins" / "finetune").is_dir()
    assert values["triggerer"]["enabled"]  # the eks stages defer
    assert values["airflowVersion"] == next(
        line.split("==")[1] for line in (REPO_ROOT / "requirements.txt").read_text().split()
        if line.startswith("apache-airflow=="))


def test_every_component_that_calls_aws_has_the_irsa_role():
    values = yaml.safe_load(VALUES.read_text())
    roles = {c: values[c]["serviceAccount"]["annotations"].get(IRSA)
             for c in ("scheduler", "workers", "triggerer")}
    assert len(set(roles.values())) == 1 and all(
        r and r.startswith("arn:aws:iam::") for r in roles.values()), roles
