"""Export the trained model as a Hugging Face directory: safetensors, config, tokenizer."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from huggingface_hub import save_torch_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase


def export_hf(
    model: torch.nn.Module,
    config: PretrainedConfig,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    rank: int,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Gather the full weights to rank 0's CPU and write them for `from_pretrained`.

    Every rank must call this (the gather is a collective); only rank 0 writes.
    """
    state = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank != 0:
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if config.tie_word_embeddings:
        # One tensor under two names; from_pretrained re-ties the head to the embedding.
        state.pop("lm_head.weight", None)
    # A copy per tensor: gathered shards of uneven size are views into a larger, padded buffer.
    state = {name: tensor.to(dtype, copy=True) for name, tensor in state.items()}
    save_torch_state_dict(state, out, max_shard_size="5GB")
    config = copy.deepcopy(config)
    config.dtype = dtype
    config.use_cache = True
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
