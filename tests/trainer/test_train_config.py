import json
from pathlib import Path

import pytest

from trainer.config import TrainConfig, load_config, parse_args
from trainer.demo import DEMO_TOKENIZER


def write_config(tmp_path: Path, values: dict) -> Path:
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(values))
    return path


def test_json_values_and_cli_overrides_are_typed_and_cli_wins(tmp_path):
    path = write_config(tmp_path, {"lr": 0.001, "max_steps": 10, "strategy": "NO_SHARD"})
    config = parse_args(["--config", str(path), "--max_steps", "3", "--lr", "2e-4"])
    assert config.max_steps == 3 and isinstance(config.max_steps, int)
    assert config.lr == 2e-4
    assert config.strategy == "NO_SHARD"


def test_relative_paths_resolve_against_the_working_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(None, {"dataset": "data/rows.jsonl", "output_dir": "out"})
    assert config.dataset == str(tmp_path / "data" / "rows.jsonl")
    assert config.output_dir == str(tmp_path / "out")


def test_tokenizer_defaults_to_the_demo_tokenizer_for_builtin_models_else_the_model_dir(tmp_path):
    assert load_config(None, {"model": "llama-1b"}).tokenizer == str(DEMO_TOKENIZER)
    model_dir = tmp_path / "my-model"
    assert load_config(None, {"model": str(model_dir)}).tokenizer == str(model_dir)


def test_a_hub_id_is_not_mistaken_for_a_relative_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(None, {"model": "meta-llama/Llama-3.2-1B"})
    assert config.model == config.tokenizer == "meta-llama/Llama-3.2-1B"


def test_optional_fields_accept_null_from_the_command_line():
    assert parse_args(["--text_field", "text"]).text_field == "text"
    assert parse_args(["--text_field", "none"]).text_field is None


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"lr": -1.0}, "lr"),
        ({"lr": "fast"}, "lr"),
        ({"micro_batch": 0}, "micro_batch"),
        ({"micro_batch": 2.5}, "micro_batch"),
        ({"max_steps": True}, "max_steps"),
        ({"strategy": "ZERO3"}, "strategy"),
        ({"mixed_precision": "fp8"}, "mixed_precision"),
        ({"dataset_format": "xml"}, "dataset_format"),
        ({"activation_checkpointing": "some"}, "activation_checkpointing"),
        ({"eval_fraction": 1.0}, "eval_fraction"),
        ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
        ({"max_grad_norm": float("nan")}, "max_grad_norm"),
        ({"keep_checkpoints": 0}, "keep_checkpoints"),
        ({"output_dir": ""}, "output_dir"),
        ({"model": 7}, "model"),
        ({"learning_rate": 0.1}, "learning_rate"),
    ],
)
def test_bad_values_and_unknown_keys_raise_an_error_naming_the_field(tmp_path, values, field):
    with pytest.raises(ValueError, match=field):
        load_config(write_config(tmp_path, values))


def test_an_unknown_command_line_option_is_named():
    with pytest.raises(ValueError, match="--learning_rate"):
        parse_args(["--learning_rate", "0.1"])


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        TrainConfig().lr = 1.0  # type: ignore[misc]
