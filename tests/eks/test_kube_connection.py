"""The cluster reached through an Airflow Kubernetes connection (any Kubernetes, not only EKS):
the sync client the stages use and the kubernetes_asyncio client the triggers use, both against
the emulator over HTTP, with the connection given as Airflow reads it from the environment."""

from __future__ import annotations

import asyncio
import json

import kubernetes
import pytest

from finetune.targets.eks.clients import async_kube_api_client, kube_api_client
from tests.support.kube import add_nodes

CONN_ID = "emulated_cluster"


@pytest.fixture
def kube_connection(cluster, monkeypatch):
    monkeypatch.delenv("FINETUNE_KUBECONFIG")  # only the connection may lead to the cluster
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", json.dumps({
        "conn_type": "kubernetes", "extra": {"kube_config_path": str(cluster.kubeconfig)}}))
    add_nodes(cluster, 2)
    return cluster


def test_the_stages_client_comes_from_the_kubernetes_connection(kube_connection):
    api = kube_api_client(kubernetes_conn_id=CONN_ID)
    nodes = kubernetes.client.CoreV1Api(api).list_node().items
    assert [n.metadata.name for n in nodes] == ["ip-10-0-0-0", "ip-10-0-0-1"]


def test_the_triggers_client_comes_from_the_kubernetes_connection(kube_connection):
    async def node_names() -> list[str]:
        from kubernetes_asyncio import client

        async with async_kube_api_client(kubernetes_conn_id=CONN_ID) as api:
            return [n.metadata.name for n in (await client.CoreV1Api(api).list_node()).items]

    assert asyncio.run(node_names()) == ["ip-10-0-0-0", "ip-10-0-0-1"]


def test_without_any_credentials_source_the_error_names_them(monkeypatch):
    monkeypatch.delenv("FINETUNE_KUBECONFIG", raising=False)
    with pytest.raises(ValueError, match="set kubernetes_conn_id, FINETUNE_KUBECONFIG or "
                                         "cluster_name"):
        kube_api_client()
