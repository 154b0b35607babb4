"""Each run parameter is declared once, in finetune_contract.parameters, and every view holds every
parameter as declared: the trigger form's Params and JSON schema, RunConfig, the trainer's
TrainConfig, what a target hands the trainer, and docs/parameters.md. A name declared again
anywhere else (a dataclass field, a dict of defaults, a spec call) fails the scan below."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from finetune.config import ConfigError, RunConfig
from finetune.params import dag_params, param_schema
from finetune.trainer_config import trainer_config
from finetune.validate import config_table, validate_params
from finetune_contract.parameters import (
    BY_NAME,
    FORM_PARAMETERS,
    PARAMETERS,
    TRAINER_PARAMETERS,
    Parameter,
)
from finetune_contract.train_config import TrainConfig

REPO_ROOT = Path(__file__).resolve().parents[2]
NAMES = {p.name for p in PARAMETERS}
DECLARATION = REPO_ROOT / "plugins" / "finetune_contract" / "parameters.py"
# Values, not declarations: a preset sets parameters by name (finetune_contract.presets).
VALUES_ONLY = {REPO_ROOT / "plugins" / "finetune_contract" / "presets.py"}
# A copy of the table: this many fields or keys named as parameters, each taken from an object
# of the same name (`"seq_len": cfg.seq_len`) or a class field; or this many defaults restated.
COPIED, RESTATED = 8, 3


def _product_modules() -> list[Path]:
    return sorted(p for folder in ("plugins", "trainer", "dags")
                  for p in (REPO_ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _restates_default(name: str, value: ast.expr | None) -> bool:
    return isinstance(value, ast.Constant) and type(value.value) is BY_NAME[name].type \
        and value.value == BY_NAME[name].default


def redeclarations(path: Path) -> list[str]:
    """Where a module declares parameters again: a class or dict holding many of them (or
    restating their defaults), or a call `f("name", default, "description", ...)` as a spec."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            fields = [(n.target.id, n.value) for n in node.body if isinstance(n, ast.AnnAssign)
                      and isinstance(n.target, ast.Name) and n.target.id in NAMES]
            restated = [name for name, value in fields if _restates_default(name, value)]
            if len(fields) >= COPIED or len(restated) >= RESTATED:
                found.append(f"class {node.name} (line {node.lineno}): fields "
                             f"{[name for name, _ in fields]}")
        elif isinstance(node, ast.Dict):
            items = [(k.value, v) for k, v in zip(node.keys, node.values)
                     if isinstance(k, ast.Constant) and k.value in NAMES]
            copied = [name for name, value in items
                      if isinstance(value, ast.Attribute) and value.attr == name]
            restated = [name for name, value in items if _restates_default(name, value)]
            if len(copied) >= COPIED or len(restated) >= RESTATED:
                found.append(f"dict at line {node.lineno}: keys {[name for name, _ in items]}")
        elif isinstance(node, ast.Call) and len(node.args) >= 3:
            first = node.args[0]
            if isinstance(first, ast.Constant) and first.value in NAMES and any(
                    isinstance(a, ast.Constant) and isinstance(a.value, str) and len(a.value) > 20
                    for a in node.args[1:]):  # a name, a default and a description
                found.append(f"call at line {node.lineno}: declares {first.value!r}")
    return found


def test_no_module_but_the_table_declares_a_parameter():
    found = {str(path.relative_to(REPO_ROOT)): problems for path in _product_modules()
             if path != DECLARATION and path not in VALUES_ONLY
             and (problems := redeclarations(path))}
    assert found == {}, "parameters declared outside finetune_contract.parameters"


def test_the_scan_finds_a_copy_of_the_table(tmp_path):
    """The scan above is able to fail: each form of a second declaration is caught."""
    copy = tmp_path / "copy.py"
    copy.write_text(
        "import dataclasses\n"
        "@dataclasses.dataclass\nclass Knobs:\n    seq_len: int = 128\n    lr: float = 3e-3\n"
        "    micro_batch: int = 8\n"
        "DEFAULTS = {'seq_len': 128, 'lr': 3e-3, 'micro_batch': 8}\n"
        "SPEC = spec('seq_len', 128, 'Training', 'Tokens per sequence, declared again here')\n"
        "def handoff(cfg):\n    return {" + ", ".join(
            f"'{p.name}': cfg.{p.name}" for p in TRAINER_PARAMETERS[:COPIED]) + "}\n")
    found = redeclarations(copy)
    assert sorted(line.split(" ")[0] for line in found) == ["call", "class", "dict", "dict"]


def test_each_name_is_declared_once_with_a_default_its_own_rules_allow():
    assert len(NAMES) == len(PARAMETERS)
    for p in PARAMETERS:
        assert p.problem(p.default) is None, p.name
        assert p.type_problem(p.default) is None, p.name
        assert p.title and p.description and p.section, p.name
        if p.type in (int, float):
            assert p.bounds is not None, f"{p.name}: a number without bounds"
        if p.type is str and p.choices is None:
            assert p.text is not None, f"{p.name}: a text without a length and character rule"


def test_every_view_holds_every_parameter_as_declared():
    params = dag_params()
    assert list(params) == [p.name for p in FORM_PARAMETERS]
    assert {name: param.value for name, param in params.items()} == \
        {p.name: p.default for p in FORM_PARAMETERS}
    run_fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    for p in PARAMETERS:
        assert run_fields[p.name].default == p.default and run_fields[p.name].type is p.type
    train_fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    assert list(train_fields) == [p.name for p in TRAINER_PARAMETERS]
    for p in TRAINER_PARAMETERS:
        assert train_fields[p.name].default == (None if p.optional else p.default), p.name
    cfg = validate_params({"procs_per_node": 1}, run_id="manual__views")
    assert set(trainer_config(cfg)) == set(train_fields)
    page = (REPO_ROOT / "docs" / "parameters.md").read_text()
    missing = [p.name for p in PARAMETERS if f"| `{p.name}` " not in page]
    assert missing == [], "docs/parameters.md lacks them: run make docs"
    table = config_table(cfg)
    assert all(re.search(rf"^  {p.name} ", table, re.M) for p in FORM_PARAMETERS)


def test_a_parameter_set_in_the_conf_reaches_the_trainer_unchanged():
    """Every trainer parameter the form sets arrives in the trainer's config as given."""
    conf = {"procs_per_node": 1, "weight_decay": 0.05, "max_grad_norm": 0.5, "log_interval": 3,
            "keep_checkpoints": 4, "min_lr_ratio": 0.0, "eval_fraction": 0.1, "seq_len": 96}
    train = TrainConfig(**trainer_config(validate_params(conf, run_id="manual__r")))
    assert {name: getattr(train, name) for name in conf if name != "procs_per_node"} == \
        {name: value for name, value in conf.items() if name != "procs_per_node"}


def test_every_form_schema_is_a_draft_07_schema_that_keeps_its_default():
    """Airflow checks each Param's schema against the draft it names every time it resolves the
    Param, thousands of times a DAG serialization here; draft-07's check is the fast one."""
    for sweep in (False, True):
        for name, param in dag_params(sweep=sweep).items():
            validator = jsonschema.validators.validator_for(param.schema, default=None)
            assert validator is jsonschema.Draft7Validator, name
            validator.check_schema(param.schema)
            assert param.resolve() == param.value, name


TEXT_RULED = [p for p in FORM_PARAMETERS if p.text is not None and not p.secret]


@pytest.mark.parametrize("p", TEXT_RULED, ids=lambda p: p.name)
@settings(max_examples=60, deadline=None)
@given(value=st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
       | st.sampled_from(["", " ", "a", "a\nb", "x" * 5000, "ok-name", "s3://b/k", "a..b"]))
def test_the_form_schema_refuses_a_text_exactly_when_its_rule_does(p: Parameter, value: str):
    schema = param_schema(p)
    schema_ok = jsonschema.validators.validator_for(schema)(schema).is_valid(value)
    rule_ok = p.text.problem(value, "v") is None and not (p.required and not value.strip())
    # The form does not strip; validate strips the value before its rule: compare stripped.
    if value == value.strip():
        assert schema_ok == rule_ok, (value, schema.get("pattern"))


@pytest.mark.parametrize("name", ["dpo_beta", "chosen_field", "dpo_loss"])
def test_a_preference_field_set_for_an_sft_run_is_refused_naming_it(name):
    value = {"dpo_beta": 0.5, "chosen_field": "better", "dpo_loss": "ipo"}[name]
    with pytest.raises(ConfigError) as err:
        validate_params({"procs_per_node": 1, name: value}, run_id="manual__r")
    assert [field for field, _ in err.value.errors] == [name]
    assert "applies to method dpo only" in str(err.value)


def test_the_validate_log_says_which_values_the_target_does_not_use():
    cfg = validate_params({"procs_per_node": 1, "namespace": "ml", "max_nodes": 4},
                          run_id="manual__r")
    lines = {line.split()[0]: line for line in config_table(cfg).splitlines()[2:]
             if not line.strip().startswith("[")}
    assert lines["namespace"].endswith("this run; not used by target local")
    assert lines["max_nodes"].endswith("this run; not used by target local")
    assert lines["seq_len"].endswith("default")
    assert BY_NAME["namespace"].targets == ("eks",)
