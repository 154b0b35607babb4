import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from finetune_contract.throughput import PEAK_FLOPS_BY_DEVICE, flops_per_token, parameter_count
from trainer.metrics import peak_flops

SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 160,
    "vocab_size": 100,
}


def test_flops_per_token_counts_six_per_matmul_parameter_plus_attention():
    # Per block: q 64x64 + k 64x32 + v 64x32 + o 64x64 = 12288; MLP 3x64x160 = 30720; norms 128.
    # Two blocks + final norm: 2 x 43136 + 64 = 86336. The head's matmul: 100 x 64 = 6400.
    # 6 x (86336 + 6400) = 556416; attention 12 x 2 layers x 64 hidden x 32 seq_len = 49152.
    expected = 556416 + 49152
    for tied in (True, False):
        config = LlamaConfig(**SMALL, tie_word_embeddings=tied)
        assert flops_per_token(config, seq_len=32) == expected


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_from_config_matches_the_built_model(tied):
    config = LlamaConfig(**SMALL, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    assert sum(parameter_count(config).values()) == sum(p.numel() for p in model.parameters())


def test_peak_flops_is_the_datasheet_number_on_known_gpus_a_measured_rate_on_others_none_on_cpu(
    world_of_one,
):
    peak, source = peak_flops(world_of_one.device, torch.bfloat16)
    if world_of_one.device.type == "cpu":
        assert peak is None and source.startswith("none")
    elif source.startswith("spec:"):
        assert peak == PEAK_FLOPS_BY_DEVICE[source.removeprefix("spec:")]
    else:
        assert source.endswith("bfloat16-matmul") and peak > 1e9
