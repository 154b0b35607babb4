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


def etcd_or_skip() -> str:
    """The etcd binary; CI sets FINETUNE_REQUIRE_ETCD=1 so a missing etcd fails, not skips."""
    from finetune.etcd import etcd_binary

    binary = etcd_binary()
    if binary is None:
        if os.environ.get("FINETUNE_REQUIRE_ETCD") == "1":
            pytest.fail("etcd is required (FINETUNE_REQUIRE_ETCD=1) but not installed")
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    return binary


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
    """A copy of trainer/ and containers/ to change without touching the checkout."""
    root = tmp_path / "repo"
    for part in ("trainer", "containers"):
        if (REPO_ROOT / part).is_dir():
            shutil.copytree(REPO_ROOT / part, root / part,
                            ignore=shutil.ignore_patterns("__pycache__"))
    return root
