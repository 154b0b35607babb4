"""The architecture table at validate: what the trainer would refuse is refused before any cost,
read from the model directory's config.json (finetune_contract.families, torch-free)."""

import json

import pytest

from finetune_contract.families import (
    ATTENTION_INPUT_RANK_HEADS,
    COLWISE,
    COLWISE_DTENSOR,
    COLWISE_FUSED,
    FAMILIES,
    ROWWISE,
    TP_STYLES,
    adapter_params,
    architecture_problem,
    attended_length,
    attention_windows,
    flops_per_token,
    lora_targets,
    pieces,
    size,
)
from finetune_contract.models import model_shape
from finetune_contract.rules import config_problems
from finetune_contract.train_config import TrainConfig

SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100}


def saved_config(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, **config}))
    return model_shape(str(tmp_path), tmp_path)


def problems(shape, world: int = 2, **fields):
    return config_problems(TrainConfig(**fields), world_size=world, local_world_size=world,
                           shape=shape)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_family_accepts_lora_with_the_default_targets_and_tp_where_it_has_a_plan(
        tmp_path, model_type):
    shape = saved_config(tmp_path, model_type=model_type)
    assert problems(shape, lora_rank=8) == []
    tp = problems(shape, tp_degree=2)
    assert tp == [] if not FAMILIES[model_type].tp_refused else [f for f, _ in tp] == ["tp_degree"]


def test_phi3_lora_defaults_to_its_fused_projections_and_refuses_llama_names(tmp_path):
    shape = saved_config(tmp_path, model_type="phi3")
    assert lora_targets({"model_type": "phi3"}, "auto") == ["qkv_proj", "o_proj",
                                                            "gate_up_proj", "down_proj"]
    [(field, message)] = problems(shape, lora_rank=8, lora_target_modules="q_proj,v_proj")
    assert field == "lora_target_modules"
    assert "q_proj, v_proj" in message and "qkv_proj" in message and "Phi-3" in message


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_every_linear_of_a_planned_family_is_split_and_a_fused_one_piece_by_piece(model_type):
    """A Linear left out of the plan would stay whole beside split ones (a mesh mismatch at
    the first step); a fused projection (q+2kv, 2mlp) split as one piece computes another
    rank's heads; a fused q/k/v is sliced by the rank's head counts."""
    family = FAMILIES[model_type]
    plan = dict(family.tp_plan)
    if not plan:
        assert family.tp_refused
        return
    for linear in family.linears:
        fused = len(pieces(SHAPE, linear.fan_out)) > 1
        assert plan[linear.path] in (COLWISE_FUSED if fused else COLWISE, COLWISE_DTENSOR,
                                     ROWWISE), linear.path
        if fused and linear.path.startswith("self_attn."):
            assert plan["self_attn"] == ATTENTION_INPUT_RANK_HEADS


def test_a_shape_of_the_table_is_its_pieces_side_by_side():
    dims = {**SHAPE, "head_dim": 8}  # q = 4 x 8, kv = 2 x 8
    assert pieces(dims, "q+2kv") == (32, 16, 16) and size(dims, "q+2kv") == 64
    assert pieces(dims, "2mlp") == (128, 128) and pieces(dims, "hidden") == (64,)
    with pytest.raises(ValueError, match="'3x'"):
        pieces(dims, "q+3x")


@pytest.mark.parametrize(("config", "words"), [
    ({"model_type": "mixtral", "num_local_experts": 8}, "mixture-of-experts"),
    ({"model_type": "qwen3_moe"}, "mixture-of-experts"),
    ({"model_type": "llama", "num_experts": 4}, "mixture-of-experts"),
    ({"model_type": "gemma3"}, "gemma3_text"),
    ({"model_type": "gpt2"}, "not in the trainer's architecture table"),
])
def test_an_architecture_outside_the_table_is_refused_naming_it_and_why(tmp_path, config, words):
    [(field, message)] = problems(saved_config(tmp_path, **config))
    assert field == "model"
    assert config["model_type"] in message and words in message


def test_tp_degree_is_checked_against_the_models_kv_heads(tmp_path):
    shape = saved_config(tmp_path, model_type="qwen3", num_key_value_heads=1)
    assert [f for f, _ in problems(shape, tp_degree=2)] == ["tp_degree"]


def test_every_tp_style_of_the_table_is_a_known_style():
    assert {style for family in FAMILIES.values() for _, style in family.tp_plan} <= set(TP_STYLES)


def test_attention_flops_use_heads_times_head_dim_not_hidden():
    config = {"model_type": "gemma2", **SHAPE, "head_dim": 32, "tie_word_embeddings": True}
    wider = flops_per_token(config, 1000) - flops_per_token({**config, "head_dim": 16}, 1000)
    # per layer: 6 x the q/k/v/o weights that grew + 12 x seq_len x the q width that grew
    grown = 4 * 64 + 2 * (2 * 2 * 64)  # q and o: 4 heads x 16 more x 64; k and v: 2 heads
    assert wider == 2 * (6 * 16 * grown + 12 * 1000 * 4 * 16)


def test_attention_flops_count_the_keys_a_sliding_window_leaves():
    """Gemma 3 1B's layout: 26 layers, every 6th global, the rest a 512-token window. At seq
    4096 a windowed layer counts 2 x 512 - 512^2 / 4096 = 960 keys per query, a global 4096."""
    gemma3 = {"model_type": "gemma3_text", **SHAPE, "num_hidden_layers": 26, "head_dim": 16,
              "sliding_window": 512, "tie_word_embeddings": True}
    full = {**gemma3, "sliding_window": None}
    windows = attention_windows(gemma3)
    assert [i for i, w in enumerate(windows) if w is None] == [5, 11, 17, 23]
    q = 4 * 16
    assert flops_per_token(full, 4096) - flops_per_token(gemma3, 4096) == \
        12 * q * 22 * (4096 - 960)
    # a window no shorter than the sequence changes nothing; nor does Llama's ignored key
    assert flops_per_token(gemma3, 512) == flops_per_token(full, 512)
    llama = {**SHAPE, "sliding_window": 16}
    assert attention_windows(llama) == [None, None]
    assert attended_length(4096, 4096) == attended_length(4096, None) == 4096


def test_lora_adapter_params_follow_the_familys_linear_shapes():
    phi3 = {"model_type": "phi3", **SHAPE}
    # qkv: 64 -> 64 + 2 x 32; o: 64 -> 64; gate_up: 64 -> 256; down: 128 -> 64
    assert adapter_params(phi3, 8, "auto") == 2 * 8 * ((64 + 128) + 128 + (64 + 256) + 192)


def test_every_family_row_is_its_own_architecture():
    for model_type, family in FAMILIES.items():
        assert family.model_type == model_type
        assert architecture_problem({"model_type": model_type}) is None
        assert set(family.lora_default) <= {linear.name for linear in family.linears}


def test_validate_refuses_a_phi3_directory_with_llama_lora_targets_and_a_moe_directory(tmp_path):
    """validate_params reads the directory's config.json before any cost: what the trainer
    would refuse at start is named at validate."""
    from finetune.config import ConfigError
    from finetune.validate import validate_params

    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, "model_type": "phi3"}))
    with pytest.raises(ConfigError) as error:
        validate_params({"model": str(tmp_path), "lora_rank": 8, "lora_target_modules":
                         "q_proj,v_proj"}, run_id="r")
    assert "lora_target_modules" in str(error.value) and "qkv_proj" in str(error.value)
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, "model_type": "mixtral"}))
    with pytest.raises(ConfigError, match="mixture-of-experts"):
        validate_params({"model": str(tmp_path)}, run_id="r")
