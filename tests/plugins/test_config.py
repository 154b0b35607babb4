"""validate_params: each bad value is refused naming the field; good params give a RunConfig."""

from __future__ import annotations

import dataclasses
import json

import pytest

from finetune.config import ConfigError, RunConfig
from finetune.names import dns_label, run_dir_name
from finetune.params import dag_params
from finetune.targets.local.machine import local_cpu_count, local_resources
from finetune.trainer_config import trainer_config
from finetune.validate import validate_params
from finetune_contract.parameters import FORM_PARAMETERS, defaults


def _data_file(tmp_path, rows: int) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "response": f"a{i}"}) + "\n"
                            for i in range(rows)))
    return str(path)


# (conf overrides, field that must be named, a word the message must contain)
BAD_CONFS = [
    ({"target": "gcp"}, "target", "allowed: local, eks"),
    ({"target": "eks"}, "cluster_name", "required for target eks"),
    ({"target": "eks", "cluster_name": "c", "nodegroup": "g"}, "build_bucket", "required"),
    ({"strategy": "ZERO3"}, "strategy", "FULL_SHARD"),
    ({"nodes": 0}, "nodes", ">= 1"),
    ({"nodes": -3}, "nodes", ">= 1"),
    ({"procs_per_node": 10_000}, "procs_per_node", "<= 64"),
    ({"procs_per_node": 64}, "procs_per_node", "do not fit this machine"),
    ({"lr": 0}, "lr", "> 0"),
    ({"lr": -1e-4}, "lr", "> 0"),
    ({"lr": float("nan")}, "lr", "finite"),
    ({"seq_len": "long"}, "seq_len", "positive integer"),
    ({"seq_len": 1.5}, "seq_len", "positive integer"),
    ({"seq_len": 0}, "seq_len", ">= 8"),
    ({"micro_batch": True}, "micro_batch", "integer"),
    ({"model": "/no/such/model"}, "model", "built-in config"),
    ({"model": "not a model"}, "model", "tiny-llama"),
    ({"dataset": "missing/data.jsonl"}, "dataset", "does not exist"),
    ({"dataset": ""}, "dataset", "empty"),
    ({"dataset": "org/data.jsonl"}, "dataset", "does not exist"),
    ({"dataset_format": "xml"}, "dataset_format", "jsonl"),
    ({"mixed_precision": "fp8"}, "mixed_precision", "bf16"),
    ({"activation_checkpointing": "some"}, "activation_checkpointing", "full"),
    ({"micro_batch": 4000}, "micro_batch", "too few for an eval split of 4000"),
    ({"strategy": "HYBRID_SHARD", "procs_per_node": 2, "shard_group_size": 3},
     "shard_group_size", "does not divide"),
    ({"shard_group_size": 2}, "shard_group_size", "HYBRID_SHARD only"),
    ({"text_field": "", "prompt_field": ""}, "prompt_field", "must not be empty"),
    ({"warmup_steps": -1}, "warmup_steps", ">= 0"),
    ({"rdzv_endpoint": "localhost"}, "rdzv_endpoint", "host:port"),
    ({"output_dir": "s3://bucket/runs"}, "output_dir", "target eks"),
    ({"max_stepz": 10}, "max_stepz", "unknown parameter"),
    ({"tp_degree": 3}, "tp_degree", "does not divide the processes per node (2)"),
    ({"tp_degree": 2, "seq_len": 99}, "tp_degree", "does not divide seq_len"),
    ({"activation_checkpointing": "selective", "selective_ac": "every"}, "selective_ac",
     "positive integer"),
    ({"selective_ac": "2"}, "selective_ac", "applies only to activation_checkpointing selective"),
    ({"compile": "yes"}, "compile", "true or false"),
    ({"packing": 1}, "packing", "true or false"),
    ({"prompt_template": "alpaca"}, "prompt_template", "instruction, chat"),
]


@pytest.mark.parametrize(("conf", "field", "needle"), BAD_CONFS,
                         ids=[f"{c[1]}-{i}" for i, c in enumerate(BAD_CONFS)])
def test_bad_param_is_refused_naming_the_field(conf, field, needle):
    with pytest.raises(ConfigError) as err:
        validate_params(conf, run_id="manual__bad")
    messages = [m for f, m in err.value.errors if f == field]
    assert messages, err.value
    assert any(needle in m for m in messages), messages
    assert f"- {field}: " in str(err.value)


def test_all_errors_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        validate_params({"nodes": 0, "lr": -1, "strategy": "X"}, run_id="r")
    assert {f for f, _ in err.value.errors} == {"nodes", "lr", "strategy"}


def test_defaults_give_a_valid_config_for_this_machine():
    if local_cpu_count() < 2:
        pytest.skip("the defaults use 2 processes")
    cfg = validate_params({}, run_id="manual__2026-11-29T10:00:00+00:00")
    assert cfg.target == "local" and cfg.model == "tiny-llama"
    assert cfg.world_size == 2
    assert cfg.run_name == run_dir_name(cfg.run_id)
    assert cfg.run_dir.endswith("/runs/" + cfg.run_name)


def test_run_config_is_immutable_and_round_trips_through_json():
    cfg = validate_params({"procs_per_node": 1}, run_id="r1")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0  # type: ignore[misc]
    assert RunConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_integer_learning_rate_and_padded_strings_are_normalised():
    cfg = validate_params({"lr": 1, "strategy": " FULL_SHARD ", "procs_per_node": 1},
                          run_id="r")
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert cfg.strategy == "FULL_SHARD"


def test_micro_batch_check_counts_training_rows_after_the_eval_split(tmp_path):
    # The eval split is 5% of the rows but at least micro_batch rows, as the trainer splits.
    data = _data_file(tmp_path, 40)
    validate_params({"dataset": data, "micro_batch": 20, "procs_per_node": 1}, run_id="r")
    with pytest.raises(ConfigError, match="19 training rows are fewer than micro_batch"):
        validate_params({"dataset": data, "micro_batch": 21, "procs_per_node": 1}, run_id="r")


def test_empty_data_set_is_refused(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ConfigError, match="has no rows"):
        validate_params({"dataset": str(path), "procs_per_node": 1}, run_id="r")


def test_model_directory_needs_a_config_json(tmp_path):
    conf = {"model": str(tmp_path), "tokenizer": "trainer/demo/tokenizer", "procs_per_node": 1}
    with pytest.raises(ConfigError, match="no config.json"):
        validate_params(conf, run_id="r")
    (tmp_path / "config.json").write_text("{}")
    assert validate_params(conf, run_id="r")


@pytest.mark.parametrize("dataset", ["s3://bucket/data/train.jsonl", "s3://bucket/prefix/",
                                     "tatsu-lab/alpaca"])
def test_s3_and_hub_data_sets_are_left_to_the_trainer(dataset):
    cfg = validate_params({"dataset": dataset, "procs_per_node": 1}, run_id="r")
    assert trainer_config(cfg)["dataset"] == dataset


def test_a_directory_of_data_files_is_accepted(tmp_path):
    _data_file(tmp_path, 30)
    cfg = validate_params({"dataset": str(tmp_path), "procs_per_node": 1}, run_id="r")
    assert trainer_config(cfg)["dataset"] == str(tmp_path)


def test_hub_ids_are_accepted_as_models():
    cfg = validate_params({"model": "meta-llama/Llama-3.2-1B", "procs_per_node": 1}, run_id="r")
    assert cfg.model == "meta-llama/Llama-3.2-1B"


def test_every_param_has_a_form_entry_with_title_description_and_section():
    params = dag_params()
    assert list(params) == [p.name for p in FORM_PARAMETERS]
    for name, param in params.items():
        schema = param.schema
        assert schema["title"] and schema["section"], name
        assert param.description or schema["description_md"], name
    assert params["target"].schema["enum"] == ["local", "eks"]
    assert params["strategy"].schema["enum"] == [
        "FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"]
    assert params["nodes"].schema["minimum"] == 1


def test_form_defaults_are_the_validated_defaults():
    assert {k: p.value for k, p in dag_params().items()} == defaults()


def test_run_dir_names_are_safe_and_distinct_for_distinct_run_ids():
    a = run_dir_name("manual__2026-11-29T10:00:00+00:00")
    b = run_dir_name("manual__2026-11-29T10:00:00-00:00")
    assert a != b
    for name in (a, b, run_dir_name("ünïcode run / with spaces"), run_dir_name("../../etc")):
        assert "/" not in name and not name.startswith(".") and name


def test_rendezvous_ids_are_dns_labels_unique_per_run():
    ids = {dns_label("llm_finetune", f"manual__2026-11-29T10:00:0{i}+00:00") for i in range(5)}
    assert len(ids) == 5
    long_id = dns_label("llm_finetune", "x" * 500 + "Ä b")
    for rid in ids | {long_id}:
        assert len(rid) <= 63
        assert rid.replace("-", "").isalnum() and rid == rid.lower()
        assert not rid.startswith("-") and not rid.endswith("-")


def test_trainer_config_uses_only_fields_the_trainer_knows():
    from trainer.config import TrainConfig

    cfg = validate_params({"procs_per_node": 1}, run_id="r")
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(trainer_config(cfg)) <= known


def test_checkpoint_async_reaches_the_trainer_and_must_be_a_boolean():
    from trainer.config import TrainConfig

    cfg = validate_params({"procs_per_node": 1, "checkpoint_async": True}, run_id="r")
    assert TrainConfig(**trainer_config(cfg)).checkpoint_async is True
    with pytest.raises(ConfigError, match="checkpoint_async: must be true or false"):
        validate_params({"checkpoint_async": "yes"}, run_id="r")


def test_bad_rows_reaches_the_trainer_and_only_skip_or_error_is_accepted():
    assert trainer_config(validate_params({}, run_id="r"))["bad_rows"] == "skip"
    cfg = validate_params({"bad_rows": "error"}, run_id="r")
    assert trainer_config(cfg)["bad_rows"] == trainer_config(cfg, local_paths=False)["bad_rows"] \
        == "error"
    with pytest.raises(ConfigError, match="- bad_rows: unknown value 'drop'; allowed: skip, error"):
        validate_params({"bad_rows": "drop"}, run_id="r")


def test_seq_len_beyond_a_model_directorys_positions_is_refused_where_its_rope_cannot_stretch(
        tmp_path):
    """Default, linear and llama3 RoPE stretch to seq_len (trainer.model.stretch_positions);
    another type is refused naming the positions, the type and the ones that stretch."""
    conf = {"model": str(tmp_path), "tokenizer": "trainer/demo/tokenizer"}
    (tmp_path / "config.json").write_text(
        '{"max_position_embeddings": 64, "rope_parameters": {"rope_type": "yarn", "factor": 2}}')
    with pytest.raises(ConfigError) as err:
        validate_params({**conf, "seq_len": 128}, run_id="manual__bad")
    assert dict(err.value.errors)["seq_len"].startswith(
        f"128 exceeds model {tmp_path}'s max_position_embeddings (64) and its rope type 'yarn' "
        "is not one the trainer stretches (default, linear, llama3)")
    validate_params({**conf, "seq_len": 64}, run_id="manual__ok")
    for rope in ({}, {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
                 {"rope_scaling": {"type": "linear", "factor": 2.0}}):
        (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 64, **rope}))
        assert validate_params({**conf, "seq_len": 128}, run_id="manual__ok").seq_len == 128


def test_omp_num_threads_where_the_stage_runs_caps_each_processs_threads(monkeypatch):
    monkeypatch.setattr("finetune.targets.local.machine.local_cpu_count", lambda: 8)
    monkeypatch.setattr("finetune.targets.local.machine.gpu_count", lambda: 0)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert {k: local_resources(1, 2)[k] for k in ("threads_per_process", "threads")} == \
        {"threads_per_process": 4, "threads": 8}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert {k: local_resources(1, 2)[k] for k in ("threads_per_process", "threads")} == \
        {"threads_per_process": 3, "threads": 3}
    assert local_resources(1, 8)["threads_per_process"] == 1  # the cores shared out still
    for ignored in ("0", "", "many"):
        monkeypatch.setenv("OMP_NUM_THREADS", ignored)
        assert local_resources(1, 1)["threads"] == 8
