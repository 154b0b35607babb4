"""Fixtures for the eks tests: moto in server mode (AWS) and the Kubernetes emulator."""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from eks_support import SCALING, Cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """moto in server mode on a free loopback port."""
    binary = str(Path(sys.executable).with_name("moto_server"))
    if not Path(binary).exists():
        binary = shutil.which("moto_server") or binary
    port = _free_port()
    proc = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def aws(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """boto3 (and so Airflow's AWS hooks) pointed at moto; moto's state reset afterwards."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    yield moto_endpoint
    req = urllib.request.Request(moto_endpoint + "/moto-api/reset", method="POST")
    urllib.request.urlopen(req, timeout=10).close()


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    monkeypatch.setenv("FINETUNE_KUBECONFIG", str(c.kubeconfig))
    yield c
    c.close()


@pytest.fixture
def nodegroup(aws: str) -> Any:
    """The cluster and its GPU node group in moto (scaled to zero)."""
    eks = boto3.client("eks")
    eks.create_cluster(name="train", roleArn="arn:aws:iam::123456789012:role/eks",
                       resourcesVpcConfig={"subnetIds": ["subnet-1"]})
    eks.create_nodegroup(clusterName="train", nodegroupName="gpu-p4de",
                         nodeRole="arn:aws:iam::123456789012:role/node", subnets=["subnet-1"],
                         scalingConfig=SCALING, instanceTypes=["p4de.24xlarge"])
    return eks


@pytest.fixture
def task_log() -> Any:
    """What the eks target writes to the task log (Airflow's logging does not reach caplog)."""
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("finetune")
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)
