"""Family shapes: the published configs of other model families (Qwen2.5 7B, Mistral 7B, Gemma 2
2B, Gemma 3 1B and 4B), which the benchmark builds with random weights (`python -m bench.train
--models gemma2-2b`) and the planner's calibration rows at released depths name
(bench/plan_calibration.py, RELEASED_ROWS). No product code reads them: validate and the planner
size a run's model from the contract's shapes (finetune_contract.models) or its config.json.
"""

from __future__ import annotations

from typing import Any

# (class, kwargs); model_type and soft caps explicit: the planner reads them without transformers.
FAMILY_SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2.5-7b": ("Qwen2Config", dict(
        model_type="qwen2",
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "mistral-7b": ("MistralConfig", dict(
        model_type="mistral",
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        rope_theta=1e6, sliding_window=None, tie_word_embeddings=False)),
    "gemma2-2b": ("Gemma2Config", dict(
        model_type="gemma2", attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        sliding_window=4096, query_pre_attn_scalar=256,
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=8192, tie_word_embeddings=True)),
    "gemma3-1b": ("Gemma3TextConfig", dict(
        model_type="gemma3_text",
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
        query_pre_attn_scalar=256, max_position_embeddings=32768, tie_word_embeddings=True)),
    "gemma3-4b": ("Gemma3TextConfig", dict(
        model_type="gemma3_text",
        vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, sliding_window=1024,
        query_pre_attn_scalar=256, max_position_embeddings=131072, tie_word_embeddings=True)),
}
