"""Build the causal LM: a built-in Llama shape with seeded random init, or a local HF model dir."""

from __future__ import annotations

from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

_LLAMA3_ROPE = {"rope_type": "default", "rope_theta": 500000.0}

# LlamaConfig kwargs. tiny-llama is sized for the CPU demo; the others are Llama 3.x shapes.
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 352,
        "vocab_size": 725,  # len() of trainer/demo/tokenizer
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "rms_norm_eps": 1e-5,
    },
    "llama-1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rope_parameters": _LLAMA3_ROPE,
        "rms_norm_eps": 1e-5,
    },
    "llama-3b": {
        "hidden_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "rope_parameters": _LLAMA3_ROPE,
        "rms_norm_eps": 1e-5,
    },
    "llama-8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "rope_parameters": _LLAMA3_ROPE,
        "rms_norm_eps": 1e-5,
    },
}


def builtin_config(name: str, tokenizer: PreTrainedTokenizerBase | None = None) -> LlamaConfig:
    """The LlamaConfig of a built-in model, with special token ids taken from `tokenizer`."""
    kwargs = dict(BUILTIN_CONFIGS[name])
    if tokenizer is not None:
        if len(tokenizer) > kwargs["vocab_size"]:
            raise ValueError(
                f"tokenizer has {len(tokenizer)} tokens, more than model {name}'s vocab_size "
                f"{kwargs['vocab_size']}"
            )
        kwargs.update(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    config = LlamaConfig(**kwargs, attn_implementation="sdpa")
    config.architectures = [LlamaForCausalLM.__name__]
    return config


def build_model(
    model: str, seed: int, tokenizer: PreTrainedTokenizerBase | None = None
) -> PreTrainedModel:
    """An fp32 model on the CPU, identical on every rank (FSDP then keeps each rank's shard)."""
    if model in BUILTIN_CONFIGS:
        torch.manual_seed(seed)
        return LlamaForCausalLM(builtin_config(model, tokenizer))
    try:
        return AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.float32, attn_implementation="sdpa"
        )
    except OSError as error:
        raise ValueError(
            f"model must be one of {', '.join(BUILTIN_CONFIGS)}, a local Hugging Face model dir or "
            f"a hub id; {model!r} could not be loaded: {error}"
        ) from error


def decoder_blocks(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The repeated transformer blocks: the unit of sharding and of activation checkpointing."""
    blocks = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no model.layers; only Llama-like models are supported"
        )
    return blocks
