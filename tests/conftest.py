"""Test set-up shared by every folder: import paths and a project-local Airflow, as make sets,
and the fixtures of tests/support that any folder may use."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# The one place tests touch sys.path: `finetune` (plugins/), `trainer` and `tests.support`.
for path in (REPO_ROOT / "plugins", REPO_ROOT):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

# Bytecode is cached, as make test has it, when a file is run by hand where the environment sets
# PYTHONDONTWRITEBYTECODE (the Makefile says why): for this process and its subprocesses.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# No test reaches the Hugging Face hub (transformers, datasets, and validate's read of a hub id's
# config.json, finetune.hub); tests/plugins/test_hub_config.py serves a hub of its own.
os.environ["HF_HUB_OFFLINE"] = "1"

# Before anything imports airflow: this project's DAGs and plugins, no examples.
os.environ.setdefault("AIRFLOW_HOME", str(REPO_ROOT / ".airflow"))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs the suite in two processes (pytest-xdist): each gets its own copy of the
    # migrated Airflow home (its database, with the pool `make airflow-db` made), so their DAG
    # runs and logs never share a SQLite file.
    _home = Path(tempfile.mkdtemp(prefix=f"finetune-tests-{os.environ['PYTEST_XDIST_WORKER']}-"))
    shutil.copytree(os.environ["AIRFLOW_HOME"], _home, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("logs", "*.pid", "*.log"))
    os.environ["AIRFLOW_HOME"] = str(_home)
    os.environ["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"] = f"sqlite:///{_home}/airflow.db"
os.environ.setdefault("AIRFLOW__CORE__DAGS_FOLDER", str(REPO_ROOT / "dags"))
os.environ.setdefault("AIRFLOW__CORE__PLUGINS_FOLDER", str(REPO_ROOT / "plugins"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")
# DAG runs on the local target track in MLflow: the tests' runs go to a store of their own for
# the session, never to the checkout's mlflow.db that `make demo` fills.
os.environ.setdefault("AIRFLOW__FINETUNE__MLFLOW_TRACKING_URI", "sqlite:///" + str(
    Path(tempfile.mkdtemp(prefix="finetune-tests-mlflow-")) / "mlflow.db"))

# OpenMP threads spin a while before they sleep: libgomp's default spin made two trainings
# sharing 2 cores each many times slower (make test's fast tier runs two processes).
os.environ.setdefault("GOMP_SPINCOUNT", "20000")

# Light to import (no Airflow, no kmock): the folders needing heavier fixtures import them.
pytest_plugins = ["tests.support.aws", "tests.support.etcd", "tests.support.mlflow"]


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
