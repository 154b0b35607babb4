"""MLflow for the tests: a real `mlflow server` (SQLite backend; artifacts in a local folder or
an S3 bucket on moto), one per test that asks, on a free loopback port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from finetune.etcd import free_port

MLFLOW = str(Path(sys.executable).with_name("mlflow"))
# Without MLflow's job runner: its seven huey consumers (GenAI jobs nothing here runs) took 40
# CPU seconds to start and 78 of a 3-run promotion test's 215 on 2 cores (2026-12-04).
NO_JOBS = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def start_mlflow(home: Path, artifacts: str, env: dict[str, str] | None = None
                 ) -> tuple[subprocess.Popen, str]:
    """`mlflow server` with a SQLite store in `home` and `artifacts` (a path or s3:// URI)
    proxied through it; (process, URL) once it answers /health."""
    port = free_port()
    log = (home / "mlflow-server.log").open("w")
    proc = subprocess.Popen(
        [MLFLOW, "server", "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}",
         "--artifacts-destination", artifacts, "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **NO_JOBS, **(env or {})},
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited:\n{(home / 'mlflow-server.log').read_text()}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    pytest.fail(f"mlflow server did not answer:\n{(home / 'mlflow-server.log').read_text()}")


def stop_mlflow(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()


@pytest.fixture
def mlflow_server(tmp_path_factory) -> Iterator[str]:
    """A real MLflow tracking server with local artifacts; its URL."""
    home = tmp_path_factory.mktemp("mlflow")
    proc, url = start_mlflow(home, str(home / "artifacts"))
    yield url
    stop_mlflow(proc)
