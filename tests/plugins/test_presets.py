"""Presets: each one validates, a run's own fields override it, unknown names are refused."""

from __future__ import annotations

import re

import pytest

from finetune.config import ConfigError
from finetune.params import dag_params
from finetune.run_plan import plan_run
from finetune.validate import config_table, validate_params
from finetune_contract.families import model_type_of
from finetune_contract.instance_types import INSTANCE_TYPES
from finetune_contract.models import HUB_MODEL_CONFIGS
from finetune_contract.parameters import defaults as default_params
from finetune_contract.presets import PRESETS, apply_preset

# What a deployment adds to an eks preset (its cluster, node group, output and image).
EKS_SITE = {"cluster_name": "gpu", "nodegroup": "p5", "output_dir": "s3://bucket/runs",
            "image": "111122223333.dkr.ecr.us-east-1.amazonaws.com/finetune-trainer:abc"}


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_validates_with_its_values(name):
    preset = PRESETS[name]
    site = EKS_SITE if preset.values["target"] == "eks" else {}
    cfg = validate_params({"preset": name, **site}, run_id="r")
    assert cfg.preset == name and cfg.preset_version == preset.version >= 1
    for key, value in preset.values.items():
        assert getattr(cfg, key) == value, key


@pytest.mark.parametrize("name", [n for n, p in PRESETS.items() if p.values["target"] == "eks"])
def test_gpu_presets_use_every_gpu_and_fit_the_gpu_by_the_planner_with_room_to_spare(name):
    v = PRESETS[name].values
    assert v["procs_per_node"] == INSTANCE_TYPES[v["instance_type"]].gpus
    cfg = validate_params({"preset": name, **EKS_SITE}, run_id="r")
    plan = plan_run(cfg)
    assert plan.estimate.fits and plan.estimate.peak_gib < 0.6 * plan.estimate.gpu_memory_gib
    assert v["mixed_precision"] == "bf16"


def test_a_rest_conf_overrides_the_preset_even_with_a_default_value():
    cfg = validate_params({"preset": "llama2-13b-p5", **EKS_SITE, "nodes": 1,
                           "strategy": "FULL_SHARD", "shard_group_size": 0}, run_id="r")
    assert cfg.nodes == 1 == default_params()["nodes"]  # the preset says 2
    assert cfg.seq_len == 4096  # not given: the preset's


def test_a_full_form_conf_keeps_preset_values_where_fields_are_at_their_defaults():
    form = {**default_params(), "preset": "tiny-local", "max_steps": 12, "tokenizer": None}
    merged, preset = apply_preset(form, default_params(), given=form)
    assert preset is PRESETS["tiny-local"]
    assert merged["seq_len"] == 96 and merged["eval_interval"] == 20  # the preset's
    assert merged["max_steps"] == 12  # changed in the form
    assert merged["tokenizer"] == ""  # an empty optional field is not an override


def test_without_a_preset_params_are_taken_as_they_are():
    cfg = validate_params({"max_steps": 7, "procs_per_node": 1}, run_id="r")
    assert cfg.preset == "none" and cfg.preset_version == 0 and cfg.max_steps == 7


def test_an_unknown_preset_is_refused_naming_the_known_ones():
    with pytest.raises(ConfigError) as err:
        validate_params({"preset": "llama9-1t"}, run_id="r")
    assert err.value.errors[0][0] == "preset"
    assert "llama9-1t" in str(err.value) and "tiny-local" in str(err.value)


def test_an_override_outside_the_bounds_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="- micro_batch: must be >= 1"):
        validate_params({"preset": "tiny-local", "micro_batch": 0}, run_id="r")


def test_the_form_shows_what_each_preset_sets_and_the_rule_for_fields_left_at_their_default():
    params = dag_params()
    preset_md = params["preset"].schema["description_md"]
    assert "A field left at its built-in default takes the preset's value" in preset_md
    assert "- `tiny-local`: seq_len **96**, warmup_steps **4**, max_steps **40**" in preset_md
    # a field a preset changes says so where it is set; one no preset changes does not
    assert params["max_steps"].description.endswith(
        "leaving this at its default (150) runs the preset's value: 40 (tiny-local); 1000 "
        "(llama2-7b-p4de, llama2-13b-p5, llama2-70b-p5, llama3-8b-p5, qwen2.5-1.5b-g5, "
        "phi3.5-mini-lora-g6, qwen2.5-7b-p4de, mistral-7b-p5, qwen3-8b-p5e).")
    assert "preset" not in params["seed"].description


def test_the_validate_table_says_where_each_value_comes_from():
    form = {**default_params(), "preset": "tiny-local", "max_steps": 12}
    table = config_table(validate_params(form, run_id="r", given=form))
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[2:]
            if not line.strip().startswith("[")}
    assert rows["seq_len"] == ["96", "preset", "tiny-local"]
    assert rows["max_steps"] == ["12", "this", "run"]
    assert rows["seed"] == ["1234", "default"]


def test_every_gpu_instance_class_has_a_preset_of_a_family_other_than_llama():
    """g5, g6, p4, p5: a preset of another family of the architecture table on each."""
    def instance_class(name: str) -> str:
        return re.match(r"[a-z]+\d+", name).group()

    classes = {instance_class(name) for name in INSTANCE_TYPES}
    covered = {instance_class(p.values["instance_type"]) for p in PRESETS.values()
               if p.values["target"] == "eks"
               and model_type_of(HUB_MODEL_CONFIGS[p.values["model"]]) != "llama"}
    assert covered == classes
