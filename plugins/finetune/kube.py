"""Clients for the eks target: boto3 through Airflow's AWS connection, and the official
`kubernetes` client for the cluster.

Kubernetes credentials, in this order: an Airflow Kubernetes connection (its kubeconfig), the
kubeconfig file named by FINETUNE_KUBECONFIG, or (EKS) the cluster's endpoint and CA from
describe_cluster with a bearer token minted from STS, re-minted before it expires.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import tempfile
import time
from collections.abc import AsyncIterator
from typing import Any

KUBECONFIG_ENV = "FINETUNE_KUBECONFIG"
TOKEN_PREFIX = "k8s-aws-v1."
# EKS accepts a token for 15 minutes; re-mint well before that.
TOKEN_TTL_S = 60
TOKEN_REFRESH_S = 10 * 60


def aws_session(aws_conn_id: str) -> Any:
    """A boto3 session from the Airflow AWS connection (boto3's own chain when it is absent)."""
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

    return AwsBaseHook(aws_conn_id=aws_conn_id or None, client_type="eks").get_session()


def eks_token(session: Any, cluster_name: str) -> str:
    """The bearer token EKS accepts: a presigned STS GetCallerIdentity URL naming the cluster.

    What `aws eks get-token` prints: 'k8s-aws-v1.' + unpadded base64url of the URL, signed with
    the x-k8s-aws-id header.
    """
    from botocore.signers import RequestSigner

    region = session.region_name
    sts = session.client("sts", region_name=region)
    signer = RequestSigner(sts.meta.service_model.service_id, region, "sts", "v4",
                           session.get_credentials(), session.events)
    url = signer.generate_presigned_url(
        {"method": "GET",
         "url": f"https://sts.{region}.amazonaws.com/?Action=GetCallerIdentity&Version=2011-06-15",
         "body": {}, "headers": {"x-k8s-aws-id": cluster_name}, "context": {}},
        region_name=region, expires_in=TOKEN_TTL_S, operation_name="")
    return TOKEN_PREFIX + base64.urlsafe_b64encode(url.encode()).decode().rstrip("=")


def eks_cluster_access(session: Any, cluster_name: str) -> tuple[str, str | None]:
    """(API server endpoint, CA bundle file or None) of an EKS cluster."""
    cluster = session.client("eks").describe_cluster(name=cluster_name)["cluster"]
    ca_data = (cluster.get("certificateAuthority") or {}).get("data")
    if not ca_data:
        return cluster["endpoint"], None
    with tempfile.NamedTemporaryFile("wb", prefix="eks-ca-", suffix=".crt", delete=False) as ca:
        ca.write(base64.b64decode(ca_data))
    return cluster["endpoint"], ca.name


def eks_api_client(session: Any, cluster_name: str) -> Any:
    """A kubernetes ApiClient for an EKS cluster; its token is re-minted every 10 minutes."""
    import kubernetes

    conf = kubernetes.client.Configuration()
    conf.host, ca_file = eks_cluster_access(session, cluster_name)
    if ca_file:
        conf.ssl_ca_cert = ca_file
    minted = {"at": 0.0}

    def refresh(c: Any) -> None:
        # Called before each request: waits that last hours outlive one token.
        if time.monotonic() - minted["at"] > TOKEN_REFRESH_S:
            c.api_key["authorization"] = eks_token(session, cluster_name)
            c.api_key_prefix["authorization"] = "Bearer"
            minted["at"] = time.monotonic()

    refresh(conf)
    conf.refresh_api_key_hook = refresh
    return kubernetes.client.ApiClient(conf)


def kube_api_client(*, kubernetes_conn_id: str = "", aws_conn_id: str = "",
                    cluster_name: str = "") -> Any:
    """The cluster's ApiClient from the first credentials source that is set (module doc)."""
    import kubernetes

    if kubernetes_conn_id:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

        return KubernetesHook(conn_id=kubernetes_conn_id).api_client
    if os.environ.get(KUBECONFIG_ENV):
        return kubernetes.config.new_client_from_config(config_file=os.environ[KUBECONFIG_ENV])
    if not cluster_name:
        raise ValueError(f"no Kubernetes credentials: set kubernetes_conn_id, {KUBECONFIG_ENV} "
                         "or cluster_name")
    return eks_api_client(aws_session(aws_conn_id), cluster_name)


@contextlib.asynccontextmanager
async def async_kube_api_client(*, kubernetes_conn_id: str = "", aws_conn_id: str = "",
                                cluster_name: str = "") -> AsyncIterator[Any]:
    """A kubernetes_asyncio ApiClient from the same credentials as `kube_api_client`.

    On EKS its token is minted once: a trigger that waits longer re-opens the client.
    """
    from kubernetes_asyncio import client, config

    if kubernetes_conn_id:
        from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook

        async with AsyncKubernetesHook(conn_id=kubernetes_conn_id).get_conn() as api:
            yield api
        return
    if os.environ.get(KUBECONFIG_ENV):
        api = await config.new_client_from_config(config_file=os.environ[KUBECONFIG_ENV])
    elif cluster_name:
        # boto3 blocks: keep it off the triggerer's event loop.
        session = await asyncio.to_thread(aws_session, aws_conn_id)
        host, ca_file = await asyncio.to_thread(eks_cluster_access, session, cluster_name)
        conf = client.Configuration(host=host)
        if ca_file:
            conf.ssl_ca_cert = ca_file
        # kubernetes_asyncio names the bearer token "BearerToken" (the sync client:
        # "authorization").
        conf.api_key = {"BearerToken": await asyncio.to_thread(eks_token, session,
                                                               cluster_name)}
        conf.api_key_prefix = {"BearerToken": "Bearer"}
        api = client.ApiClient(conf)
    else:
        raise ValueError(f"no Kubernetes credentials: set kubernetes_conn_id, {KUBECONFIG_ENV} "
                         "or cluster_name")
    try:
        yield api
    finally:
        await api.close()


def create_or_replace(create: Any, replace: Any, manifest: dict[str, Any]) -> None:
    """Create a namespaced object, or replace it when it exists (a retry of the same run)."""
    import kubernetes

    meta = manifest["metadata"]
    try:
        create(meta["namespace"], manifest)
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise
        replace(meta["name"], meta["namespace"], manifest)
