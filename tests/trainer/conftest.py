"""Shared fixtures for the trainer tests: repo root on sys.path, offline Hugging Face, torchrun,
a moto S3 server."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
# Before `datasets` is imported: keep its cache out of the home dir, and never reach the hub.
os.environ.setdefault("HF_DATASETS_CACHE", str(Path(tempfile.gettempdir()) / "trainer-tests-cache"))
os.environ["HF_HUB_OFFLINE"] = "1"


def demo_rows(n: int) -> list[dict[str, str]]:
    from trainer.demo import DEMO_DATASET

    with open(DEMO_DATASET) as f:
        return [json.loads(line) for _, line in zip(range(n), f)]


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def torchrun(args: list[str], nproc: int = 2, timeout: float = 300) -> subprocess.CompletedProcess:
    """torchrun `args` (`-m module ...` or `script ...`) in the repo root; fail with its output."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", *args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if result.returncode != 0:
        pytest.fail(
            f"{' '.join(command)} failed:\n{result.stdout[-5000:]}\n{result.stderr[-5000:]}"
        )
    return result


def read_metrics(output_dir: Path) -> list[dict[str, object]]:
    with open(output_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def world_of_one():
    """A one-process gloo (or NCCL) group in this process, as `python -m trainer.train` makes."""
    import torch.distributed as dist

    from trainer.parallel import init_distributed

    env = init_distributed()
    yield env
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def moto_endpoint():
    """A real moto S3 server on a free loopback port."""
    port = _free_port()
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=2).close()
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"moto_server did not start on {url}")
            time.sleep(0.2)
    yield url
    server.terminate()
    server.wait(timeout=10)


def moto_env(endpoint: str) -> dict[str, str]:
    """Environment that points boto3 (here and in torchrun's workers) at moto."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


def new_bucket(monkeypatch, endpoint: str):
    """(client, bucket): boto3 pointed at moto with fake credentials, and a fresh bucket."""
    import boto3

    for name, value in moto_env(endpoint).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    client = boto3.client("s3")
    bucket = f"data-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=bucket)
    return client, bucket


@pytest.fixture
def s3(moto_endpoint, monkeypatch):
    """(client, bucket): boto3 pointed at moto with fake credentials, and a fresh bucket."""
    return new_bucket(monkeypatch, moto_endpoint)
