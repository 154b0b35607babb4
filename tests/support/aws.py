"""AWS for the tests: moto in server mode (real HTTP; boto3 reaches it via AWS_ENDPOINT_URL),
one server for the session on a free loopback port."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from finetune.etcd import free_port


def moto_env(endpoint: str) -> dict[str, str]:
    """Environment that points boto3 (here and in torchrun's workers) at moto."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def point_boto3_at(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """boto3 (and so Airflow's AWS hooks) in this process pointed at moto, fake credentials."""
    for name, value in moto_env(endpoint).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def new_bucket(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> tuple[Any, str]:
    """(client, bucket): boto3 pointed at moto with fake credentials, and a fresh bucket."""
    import boto3

    point_boto3_at(monkeypatch, endpoint)
    client = boto3.client("s3")
    bucket = f"data-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return client, bucket


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """moto in server mode on a free loopback port, for the whole session."""
    binary = str(Path(sys.executable).with_name("moto_server"))
    if not Path(binary).exists():
        binary = shutil.which("moto_server") or binary
    port = free_port()
    proc = subprocess.Popen([binary, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url + "/moto-api/", timeout=2).close()
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail(f"moto_server did not start on {url}")
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def aws(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """boto3 (and so Airflow's AWS hooks) pointed at moto; moto's state reset afterwards."""
    point_boto3_at(monkeypatch, moto_endpoint)
    yield moto_endpoint
    req = urllib.request.Request(moto_endpoint + "/moto-api/reset", method="POST")
    urllib.request.urlopen(req, timeout=10).close()


@pytest.fixture
def s3(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, str]:
    """(client, bucket): boto3 pointed at moto with fake credentials, and a fresh bucket."""
    return new_bucket(monkeypatch, moto_endpoint)
