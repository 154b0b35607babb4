"""Every text field has a length bound and a character set (or a fixed set of values), checked
by validate and by the trainer from the parameter table (finetune_contract.parameters);
every message quotes a value through the one cutting function (`quoted`)."""

from __future__ import annotations

import re

import pytest

from finetune.config import ConfigError
from finetune.validate import validate_params
from finetune_contract.fields import (
    CONN_ID,
    CONN_ID_MAX_LEN,
    MAX_QUOTED,
    ContractError,
    hub_id_problem,
)
from finetune_contract.parameters import (
    FORM_PARAMETERS,
    PARAMETERS,
    SECRET_NAMES,
    TRAINER_PARAMETERS,
)
from finetune_contract.rules import split_s3
from finetune_contract.train_config import TrainConfig
from tests.support.eks import EKS_PARAMS

TEXT_SPECS = [p for p in FORM_PARAMETERS if p.type is str]
TRAINER_TEXT_FIELDS = [p.name for p in TRAINER_PARAMETERS if p.type is str]
TEXTS = {p.name: p.text for p in PARAMETERS if p.text is not None}
CHOICES = {p.name: p.choices for p in PARAMETERS if p.choices is not None}
SECRET_FIELDS = SECRET_NAMES
TARGETS = {"local": {"procs_per_node": 1}, "eks": EKS_PARAMS}
# The rules of the form's fields (prepared_data is the trainer's only: the pipeline sets it).
FORM_TEXTS = sorted(name for name in TEXTS if name in {spec.name for spec in TEXT_SPECS})


def errors_of(conf: dict) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as err:
        validate_params(conf, run_id="manual__r")
    return err.value.errors


def test_every_text_field_has_a_length_bound_and_a_pattern_or_a_set_of_choices():
    """A new text field (in the form or the trainer's config) without a rule fails here."""
    unruled = [spec.name for spec in TEXT_SPECS
               if spec.name not in CHOICES and spec.name not in TEXTS]
    unruled += [name for name in TRAINER_TEXT_FIELDS
                if name not in CHOICES and name not in TEXTS]
    assert not unruled, f"text fields without a length bound and a pattern: {unruled}"
    for name, rule in TEXTS.items():
        assert 0 < rule.max_length <= 4096 and rule.pattern and rule.what, name
        re.compile(rule.pattern)


def test_the_connection_id_rule_is_the_installed_airflows():
    from airflow.models import connection

    assert connection.RE_SANITIZE_CONN_ID.pattern == f"^{CONN_ID}$"
    assert connection.CONN_ID_MAX_LEN == CONN_ID_MAX_LEN
    assert all(TEXTS[name].pattern == CONN_ID for name in TEXTS if name.endswith("_conn_id"))


@pytest.mark.parametrize("name", FORM_TEXTS)
def test_a_value_one_character_over_the_bound_is_refused_naming_the_field(name):
    rule = TEXTS[name]
    errors = errors_of({**TARGETS["eks"], name: "a" * (rule.max_length + 1)})
    assert any(field == name and f"at most {rule.max_length}" in message
               for field, message in errors), errors


@pytest.mark.parametrize("name", FORM_TEXTS)
@pytest.mark.parametrize("control", ["\0", "\n", "\t", "\x7f"])
def test_a_control_character_in_any_text_field_is_refused_naming_the_field(name, control):
    errors = errors_of({**TARGETS["eks"], name: f"a{control}b"})
    assert any(field == name for field, _ in errors), errors


@pytest.mark.parametrize("name", sorted(set(TRAINER_TEXT_FIELDS) & set(TEXTS)))
def test_the_trainer_refuses_what_validate_refuses(name):
    with pytest.raises(ContractError) as err:
        TrainConfig(**{name: "a\nb"})
    assert [field for field, _ in err.value.errors] == [name]


@pytest.mark.parametrize(("field", "value", "words"), [
    ("cluster_name", "-train", "not an EKS cluster name"),
    ("cluster_name", "train.prod", "not an EKS cluster name"),
    ("cluster_name", "c" * 101, "at most 100"),
    ("nodegroup", "gpu.p4de", "not an EKS node group name"),
    ("image", "registry.example/a/../b:1", "no '..'"),
    ("image", "registry.example/Trainer:1", "not an image reference"),
    ("image", "r/" + "t" * 500, "at most"),
    ("aws_conn_id", "aws default", "not an Airflow connection id"),
    ("kubernetes_conn_id", "k8s;drop", "not an Airflow connection id"),
    ("prometheus_conn_id", "p" * 251, "at most 250"),
    ("prometheus_url", "http://prom:99999", "port is not 1-65535"),
    ("prometheus_url", "http://prom:0/", "port is not 1-65535"),
    ("prometheus_url", "http://bad_host!:9090", "host is not a host name"),
    ("model", "org/" + "m" * 97, "the hub allows 96"),
    ("model", "org--x/model", "'--'"),
    ("model", "org/model..v2", "'..'"),
])
def test_each_text_field_class_is_refused_by_its_own_rule(field, value, words):
    errors = errors_of({**TARGETS["eks"], field: value})
    assert any(f == field and words in m for f, m in errors), errors
    if field in SECRET_FIELDS:
        assert all(value not in m for _, m in errors)


@pytest.mark.parametrize("value", ["meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-0.5B",
                                   "org_x/model.v2", "google/gemma-2-2b-it"])
def test_real_hub_ids_pass_the_hubs_rule(value):
    assert hub_id_problem(value, namespaced=True) is None


@pytest.mark.parametrize("value", ["org/x--y", "a/b/c", "org/.hidden", "org/m.git",
                                   "x" * 97, "org/"])
def test_ids_the_hub_refuses_are_refused(value):
    assert hub_id_problem(value) is not None


@pytest.mark.parametrize("key", ["data\0.jsonl", "data\n.jsonl", "runs/\r/x", "a\tb", "a\x7f"])
@pytest.mark.parametrize("field", ["dataset", "output_dir", "eval_dataset"])
def test_an_s3_key_with_a_control_character_is_refused(key, field):
    with pytest.raises(ValueError, match="control character"):
        split_s3(f"s3://bucket/{key}")
    errors = errors_of({**TARGETS["eks"], field: f"s3://bucket/{key}"})
    assert any(f == field for f, _ in errors), errors


def _fillers(name: str) -> list[str]:
    """Long values of every shape: far over the bound, at the bound with only allowed
    characters (so the later checks see it), at the bound with refused ones."""
    bound = TEXTS[name].max_length if name in TEXTS else 4096
    return ["x" * 10_000, "x" * bound, "!" * bound, "s3://bucket/" + "k" * (bound - 12)]


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", [spec.name for spec in TEXT_SPECS])
def test_no_message_echoes_a_long_value_whole(target, name):
    """A 10,000-character value (and one at the field's bound) in any text field: every message
    is short and quotes at most MAX_QUOTED characters of it."""
    for value in _fillers(name):
        try:
            validate_params({**TARGETS[target], name: value}, run_id="manual__r")
            continue
        except ConfigError as err:
            errors = err.errors
        filler = value[-1]
        for field, message in errors:
            longest = max((len(run) for run in re.findall(f"{re.escape(filler)}+", message)),
                          default=0)
            assert longest <= MAX_QUOTED and len(message) < 2000, (field, message[:300])
