"""A real Airflow for the tests: `Airflow` and `Api` from tools.airflow_components (the docs'
screenshots start the same one), and `wait_for`, whose timeout fails the test with the
components' logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import airflow_components
from tools.airflow_components import Airflow, Api

__all__ = ["Airflow", "Api", "wait_for"]


def wait_for(what: str, check, timeout: float, logs: Path, interval: float = 1.0):
    """tools.airflow_components.wait_for, failing the test instead of raising TimeoutError."""
    try:
        return airflow_components.wait_for(what, check, timeout, logs, interval)
    except TimeoutError as timeout_error:
        pytest.fail(str(timeout_error), pytrace=False)
