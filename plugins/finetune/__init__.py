"""Airflow side of the LLM fine-tuning pipeline: run config, targets, reports.

Importing this package is cheap (standard library only): the scheduler parses the DAG that
imports it every few seconds. Targets import their heavier dependencies when a task runs.
"""

from pathlib import Path

# The repository root holds dags/, plugins/, trainer/ and containers/.
REPO_ROOT = Path(__file__).resolve().parents[2]
