"""Test set-up shared by every folder: import paths and a project-local Airflow, as make sets."""

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
for path in (REPO_ROOT / "plugins", REPO_ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

# Before anything imports airflow: this project's DAGs and plugins, no examples.
os.environ.setdefault("AIRFLOW_HOME", str(REPO_ROOT / ".airflow"))
os.environ.setdefault("AIRFLOW__CORE__DAGS_FOLDER", str(REPO_ROOT / "dags"))
os.environ.setdefault("AIRFLOW__CORE__PLUGINS_FOLDER", str(REPO_ROOT / "plugins"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")


def system_binary_or_skip(name: str, package: str) -> str:
    """A program from Debian the tests need (etcd, prometheus, chromium).

    CI sets FINETUNE_REQUIRE_SYSTEM_DEPS=1 (`make test` installs them) so a missing one fails
    there instead of silently skipping.
    """
    binary = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK)
                                    else None)
    if binary is None:
        if os.environ.get("FINETUNE_REQUIRE_SYSTEM_DEPS") == "1":
            pytest.fail(f"{name} is required (FINETUNE_REQUIRE_SYSTEM_DEPS=1) but not installed")
        pytest.skip(f"{name} is not installed (apt-get install {package})")
    return binary


def etcd_or_skip() -> str:
    """The etcd binary torchrun's etcd rendezvous and the reset tests use."""
    from finetune.etcd import etcd_binary

    return etcd_binary() or system_binary_or_skip("etcd", "etcd-server")


@pytest.fixture
def etcd_server(tmp_path):
    """A real etcd (v2 API enabled) on loopback, stopped after the test."""
    from finetune.etcd import LocalEtcd

    server = LocalEtcd.start(etcd_or_skip(), tmp_path / "etcd-logs")
    yield server
    server.stop()
    assert not Path(server.data_dir).exists()


@pytest.fixture
def repo_copy(tmp_path):
    """A copy of the image context (trainer/, the contract, containers/) to change without
    touching the checkout."""
    from finetune.image import IMAGE_CONTEXT

    root = tmp_path / "repo"
    for part in IMAGE_CONTEXT:
        if (REPO_ROOT / part).is_dir():
            shutil.copytree(REPO_ROOT / part, root / part,
                            ignore=shutil.ignore_patterns("__pycache__"))
    return root
