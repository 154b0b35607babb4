"""Airflow Params (the trigger form) built from the one parameter spec in finetune.config."""

from __future__ import annotations

from airflow.sdk import Param

from finetune.config import PARAM_SPECS


def dag_params() -> dict[str, Param]:
    return {spec.name: Param(spec.default, **spec.schema()) for spec in PARAM_SPECS}
