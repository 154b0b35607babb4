"""Small random configs of every family of the architecture table (transformers config
classes; the demo tokenizer's special tokens): fixture-free helpers the trainer tests share."""

from transformers import AutoConfig, AutoTokenizer

from tests.support import REPO_ROOT

TOKENIZER = "trainer/demo/tokenizer"
# Every family of the table, with what its tiny config sets beyond SHAPE: a head_dim that is not
# hidden / heads where the family has one, soft caps small enough to change the numbers.
MATRIX: dict[str, dict[str, object]] = {
    "llama": {"attention_bias": True},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "mistral": {"sliding_window": 16},
    "gemma2": {"head_dim": 16, "final_logit_softcapping": 2.0, "query_pre_attn_scalar": 16},
    "gemma3_text": {"head_dim": 16, "final_logit_softcapping": 2.0, "sliding_window": 16},
    "phi3": {},
    "olmo2": {},
}
# 726: an even vocabulary (the demo tokenizer has 725 tokens), so TP splits the embedding.
SHAPE = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 726,
         "max_position_embeddings": 256}


def family_config(model_type: str):
    tokenizer = AutoTokenizer.from_pretrained(REPO_ROOT / TOKENIZER)
    return AutoConfig.for_model(model_type, **SHAPE, **MATRIX[model_type],
                                pad_token_id=tokenizer.pad_token_id,
                                bos_token_id=tokenizer.bos_token_id,
                                eos_token_id=tokenizer.eos_token_id)
