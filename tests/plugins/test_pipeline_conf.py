"""The scheduled DAG's conf from its Airflow Variable: a Variable that is not a JSON object is
refused naming it, instead of being read as {} and training the DAG file's defaults."""

from __future__ import annotations

import pytest

from finetune.config import ConfigError
from finetune.pipeline import variable_conf

NAME = "llm_finetune_scheduled_test"
ENV = "AIRFLOW_VAR_" + NAME.upper()


def test_a_missing_variable_is_no_override(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert variable_conf(NAME) == {}


def test_a_variable_holding_a_json_object_overrides(monkeypatch):
    monkeypatch.setenv(ENV, '{"max_steps": 5}')
    assert variable_conf(NAME) == {"max_steps": 5}


@pytest.mark.parametrize(("value", "words"), [
    ('{"max_steps": 5', "is not valid JSON"),
    ("max_steps=5", "is not valid JSON"),
    ("[1, 2]", "must hold a JSON object"),
])
def test_a_variable_that_is_not_a_json_object_is_refused_naming_it(monkeypatch, value, words):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ConfigError) as err:
        variable_conf(NAME)
    (field, message), = err.value.errors
    assert field == f"Variable {NAME}" and words in message
