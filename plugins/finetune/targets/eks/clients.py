"""The eks target's API clients: boto3 through Airflow's AWS connection, the official
`kubernetes` client for the stages and `kubernetes_asyncio` for the triggers, and the retry of
transient API errors (tenacity) that both use.

Kubernetes credentials, in this order: an Airflow Kubernetes connection (its kubeconfig), the
kubeconfig file named by FINETUNE_KUBECONFIG, or (EKS) the cluster's endpoint and CA from
describe_cluster with a bearer token from the amazon provider's EKS token utility, re-minted
before it expires.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import logging
import os
import stat
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import tenacity

from finetune.config import ConfigError
from finetune.polling import until_true

log = logging.getLogger(__name__)

KUBECONFIG_ENV = "FINETUNE_KUBECONFIG"
# EKS accepts a token for 15 minutes; re-mint well before that.
TOKEN_REFRESH_S = 10 * 60
# Answers that say "try again": throttling, a restarting API server, a gateway in between.
TRANSIENT_STATUS = (429, 500, 502, 503, 504)
TRANSIENT_AWS_CODES = ("Throttling", "ThrottlingException", "TooManyRequestsException",
                       "RequestLimitExceeded", "ServiceUnavailableException",
                       "InternalFailure", "ServerException")
RETRY_ATTEMPTS = 5


def transient(exc: BaseException) -> bool:
    """An API error worth retrying: throttled, 5xx, or the connection lost on the way."""
    import aiohttp
    import botocore.exceptions
    import urllib3.exceptions

    if isinstance(exc, botocore.exceptions.ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return error.get("Code") in TRANSIENT_AWS_CODES or status >= 500
    if isinstance(exc, (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError,
                        urllib3.exceptions.HTTPError, aiohttp.ClientConnectionError,
                        asyncio.TimeoutError)):
        return True
    # kubernetes' and kubernetes_asyncio's ApiException both carry the HTTP status; the sync
    # client raises a subclass of it for some (ServiceException for a 5xx).
    return any(c.__name__ == "ApiException" for c in type(exc).__mro__) and \
        getattr(exc, "status", None) in TRANSIENT_STATUS


def no_such_cluster(exc: BaseException) -> bool:
    """The cluster is not there to ask (EKS says there is no such cluster), or the run names
    none (no credentials): a definite answer, not an error that may pass."""
    import botocore.exceptions

    if isinstance(exc, ConfigError):
        return True
    return isinstance(exc, botocore.exceptions.ClientError) and \
        exc.response.get("Error", {}).get("Code") == "ResourceNotFoundException"


def _log_retry(state: tenacity.RetryCallState) -> None:
    log.warning("transient API error (attempt %d of %d), retrying: %s", state.attempt_number,
                RETRY_ATTEMPTS, state.outcome.exception() if state.outcome else "")


# On a read (or an idempotent write): sync and async functions alike.
retry_transient = tenacity.retry(
    retry=tenacity.retry_if_exception(transient), stop=tenacity.stop_after_attempt(RETRY_ATTEMPTS),
    wait=tenacity.wait_exponential(multiplier=0.5, max=10), before_sleep=_log_retry, reraise=True)


def aws_session(aws_conn_id: str) -> Any:
    """A boto3 session from the Airflow AWS connection (boto3's own chain when it is absent),
    reading botocore's data through the process's one loader (`botocore_loader`)."""
    from airflow.providers.amazon.aws.hooks.base_aws import AwsBaseHook

    session = AwsBaseHook(aws_conn_id=aws_conn_id or None, client_type="eks").get_session()
    core = session._session
    core.register_component("data_loader", botocore_loader(core.get_config_variable("data_path")))
    return session


@functools.cache
def botocore_loader(data_path: str | None) -> Any:
    """botocore's loader of its service models and endpoint data, one a process for each data
    path (AWS_DATA_PATH, botocore's default loader's too).

    Each new botocore session makes a loader of its own and reads those files again: a session
    with an S3 and an EKS client took 120 ms, against 21 ms through a loader that has read them
    (`python -m bench.aws_clients`). They are the installed botocore's files; the connection's
    credentials, region and endpoint stay with each session. The triggers make a session at
    each poll, in the triggerer's one process, whose GIL the parse holds.
    """
    import botocore.loaders

    return botocore.loaders.create_loader(data_path)


def eks_token(session: Any, cluster_name: str) -> str:
    """The bearer token EKS accepts (what `aws eks get-token` prints), from the amazon
    provider's token utility: a presigned GetCallerIdentity on the regional STS endpoint, the
    only one EKS accepts."""
    from airflow.providers.amazon.aws.utils.eks_get_token import fetch_access_token_for_cluster

    region = session.region_name
    sts_url = f"https://sts.{region}.amazonaws.com/?Action=GetCallerIdentity&Version=2011-06-15"
    return fetch_access_token_for_cluster(cluster_name, sts_url, region, session=session)


def eks_cluster_access(session: Any, cluster_name: str) -> tuple[str, str | None]:
    """(API server endpoint, CA bundle file or None) of an EKS cluster."""
    cluster = session.client("eks").describe_cluster(name=cluster_name)["cluster"]
    ca_data = (cluster.get("certificateAuthority") or {}).get("data")
    if not ca_data:
        return cluster["endpoint"], None
    return cluster["endpoint"], ca_bundle_file(base64.b64decode(ca_data))


def ca_bundle_file(ca: bytes) -> str:
    """The file of a CA bundle for the clients' TLS (they take a path): one per distinct CA,
    named by its hash, in a directory of this user's alone, written atomically (a rename) and
    read back before it is used. The clients are made several times a minute for hours: a new
    file each time would fill the temporary directory."""
    name = f"eks-ca-{hashlib.sha256(ca).hexdigest()[:32]}.crt"
    path = _ca_directory(tempfile.gettempdir()) / name
    with contextlib.suppress(FileNotFoundError):
        if path.read_bytes() == ca:
            return str(path)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=".eks-ca-", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(ca)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise
    return str(path)


@functools.cache
def _ca_directory(tmp: str) -> Path:
    """`<tmp>/finetune-eks-ca-<uid>`, mode 0700 and this user's; where another user holds that
    name, a new private directory (mkdtemp) for this process instead."""
    directory = Path(tmp) / f"finetune-eks-ca-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    info = directory.lstat()
    if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077:
        return directory
    log.warning("%s is not a private directory of this user: the CA goes to a new one", directory)
    return Path(tempfile.mkdtemp(prefix="finetune-eks-ca-", dir=tmp))


def eks_api_client(session: Any, cluster_name: str) -> Any:
    """A kubernetes ApiClient for an EKS cluster; its token is re-minted every 10 minutes."""
    import kubernetes

    conf = kubernetes.client.Configuration()
    conf.host, ca_file = eks_cluster_access(session, cluster_name)
    if ca_file:
        conf.ssl_ca_cert = ca_file
    minted: dict[str, float | None] = {"at": None}

    def refresh(c: Any) -> None:
        # Called before each request: waits that last hours outlive one token.
        at = minted["at"]
        if at is None or time.monotonic() - at > TOKEN_REFRESH_S:
            c.api_key["authorization"] = eks_token(session, cluster_name)
            c.api_key_prefix["authorization"] = "Bearer"
            minted["at"] = time.monotonic()

    refresh(conf)
    conf.refresh_api_key_hook = refresh
    return kubernetes.client.ApiClient(conf)


def kube_credentials(cfg: Any) -> dict[str, str]:
    """Where the run's cluster credentials come from (`kube_api_client`); serialisable, so a
    trigger gets them as kwargs."""
    return {"kubernetes_conn_id": cfg.kubernetes_conn_id, "aws_conn_id": cfg.aws_conn_id,
            "cluster_name": cfg.cluster_name}


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
        raise _no_credentials()
    return eks_api_client(aws_session(aws_conn_id), cluster_name)


def _no_credentials() -> ConfigError:
    return ConfigError([("kubernetes_conn_id", f"no Kubernetes credentials: set "
                         f"kubernetes_conn_id, {KUBECONFIG_ENV} or cluster_name")])


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
        raise _no_credentials()
    try:
        yield api
    finally:
        await api.close()


class KubeClient:
    """A kubernetes_asyncio client that is re-opened (fresh token) every `refresh_interval`."""

    def __init__(self, credentials: dict[str, str], refresh_interval: float):
        self.credentials, self.refresh_interval = credentials, refresh_interval
        self._context: Any = None
        self._opened = 0.0

    async def get(self) -> Any:
        if self._context is None or time.monotonic() - self._opened > self.refresh_interval:
            await self.close()
            self._context = async_kube_api_client(**self.credentials)
            self._api = await self._context.__aenter__()
            self._opened = time.monotonic()
        return self._api

    async def close(self) -> None:
        if self._context is not None:
            context, self._context = self._context, None
            await context.__aexit__(None, None, None)


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


def adopt_or_create(what: str, found: dict[str, Any] | None, failed: bool,
                    create: Any, delete: Any) -> bool:
    """Never two of a kind for one run or tag: adopt `found` (an earlier try's object) unless it
    `failed`, which is deleted (`delete(name)` returns once it is gone) and created again; a
    create that meets a concurrent one (409) adopts it. True when adopted."""
    import kubernetes

    if found is not None:
        name = found["metadata"]["name"]
        if not failed:
            log.info("adopting %s %s, created by an earlier try", what, name)
            return True
        log.info("%s %s failed in an earlier try: deleting it to start again", what, name)
        delete(name)
    try:
        create()
    except kubernetes.client.ApiException as exc:
        if exc.status != 409:
            raise
        log.info("%s already exists: adopting it", what)
        return True
    return False


def delete_object(delete: Any, read: Any, wait: bool = False, timeout: float = 300.0,
                  poll_interval: float = 0.5) -> bool:
    """`delete()` a namespaced object; False when it was not there. With `wait`, return once
    `read()` says it is gone (a new object of its name may be created then), or at `timeout`."""
    import kubernetes

    try:
        delete()
    except kubernetes.client.ApiException as exc:
        if exc.status == 404:
            return False
        raise

    def gone() -> bool:
        try:
            read()
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    if wait:
        until_true(timeout, poll_interval)(gone)
    return True
