"""Model shapes: the built-in configs as plain data, and the shape of a model directory.

The trainer builds its LlamaConfig from `BUILTIN_MODELS`; `validate` checks sequence length and
tensor parallelism against the same numbers, or against a model directory's config.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from finetune_contract.families import (
    BUILTIN_MODEL_TYPE,
    architecture_problem,
    attention_kernel,
    attention_windows,
    model_type_of,
)

_LLAMA3_ROPE = {"rope_type": "default", "rope_theta": 500000.0}

# LlamaConfig kwargs. tiny-llama is sized for the CPU demo; the others are Llama 3.x shapes.
BUILTIN_MODELS: dict[str, dict[str, Any]] = {
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
    "llama-70b": {
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "rope_parameters": _LLAMA3_ROPE,
        "rms_norm_eps": 1e-5,
    },
}


def _llama2(hidden: int, layers: int, heads: int, kv_heads: int, mlp: int) -> dict[str, Any]:
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "intermediate_size": mlp, "vocab_size": 32000,
            "max_position_embeddings": 4096, "tie_word_embeddings": False}


def _hub(model_type: str, hidden: int, layers: int, heads: int, kv_heads: int, mlp: int,
         vocab: int, positions: int, tied: bool, **more: Any) -> dict[str, Any]:
    return {"model_type": model_type, "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": mlp, "vocab_size": vocab, "max_position_embeddings": positions,
            "tie_word_embeddings": tied, **more}


# The shapes (config.json's) of hub models the presets name, so the planner can size them at
# validate without downloading anything; the trainer still loads the real config.
HUB_MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "meta-llama/Llama-2-7b-hf": _llama2(4096, 32, 32, 32, 11008),
    "meta-llama/Llama-2-13b-hf": _llama2(5120, 40, 40, 40, 13824),
    "meta-llama/Llama-2-70b-hf": _llama2(8192, 80, 64, 8, 28672),
    "meta-llama/Meta-Llama-3-8B": {**BUILTIN_MODELS["llama-8b"], "max_position_embeddings": 8192},
    "meta-llama/Llama-3.1-70B": BUILTIN_MODELS["llama-70b"],
    "Qwen/Qwen2.5-1.5B": _hub("qwen2", 1536, 28, 12, 2, 8960, 151936, 131072, True),
    "Qwen/Qwen2.5-7B": _hub("qwen2", 3584, 28, 28, 4, 18944, 152064, 131072, False),
    "Qwen/Qwen3-8B": _hub("qwen3", 4096, 36, 32, 8, 12288, 151936, 40960, False, head_dim=128),
    "mistralai/Mistral-7B-v0.3": _hub("mistral", 4096, 32, 32, 8, 14336, 32768, 32768, False,
                                      sliding_window=None),
    "microsoft/Phi-3.5-mini-instruct": _hub("phi3", 3072, 32, 32, 32, 8192, 32064, 131072,
                                            False),
}


@dataclass(frozen=True)
class ModelShape:
    """What the rules need of a model: heads, MLP width, positions (None: not stated) and its
    architecture."""

    name: str
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    max_position_embeddings: int | None = None
    model_type: str = BUILTIN_MODEL_TYPE  # config.json's: its row of finetune_contract.families
    architecture_problem: str | None = None  # why the trainer cannot run it (not in the table)
    head_dim: int | None = None  # config head_dim, else hidden_size / num_attention_heads
    rope_type: str = "default"  # its rotary embedding's: how far extended_rope can stretch it
    # what FA4's kernel path hands to sdpa: a sliding window on some layer, soft-capped scores
    windowed: bool = False
    soft_capped: bool = False

    @classmethod
    def from_config(cls, name: str, config: Any) -> ModelShape:
        """From a config mapping (config.json, BUILTIN_MODELS) or a transformers config object."""
        get = config.get if isinstance(config, dict) else lambda key: getattr(config, key, None)

        def number(key: str) -> int | None:
            value = get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        heads = number("num_attention_heads")
        hidden = number("hidden_size")
        head_dim = number("head_dim") or (hidden // heads if hidden and heads else None)
        problem = architecture_problem(config)
        known = problem is None and number("num_hidden_layers") is not None
        return cls(name, heads, number("num_key_value_heads") or heads,
                   number("intermediate_size"), number("max_position_embeddings"),
                   model_type_of(config), problem, head_dim,
                   rope_type_of(get("rope_parameters") or get("rope_scaling")),
                   windowed=known and any(w is not None for w in attention_windows(config)),
                   soft_capped=known and attention_kernel(config) == "eager")


# Rotary embeddings the trainer stretches to a seq_len beyond max_position_embeddings: default
# and linear by position interpolation (a linear factor), llama3 by its own factor.
STRETCHED_ROPE = ("default", "linear", "llama3")


def rope_type_of(rope: Any) -> str:
    """config.json's rope_parameters (transformers 5) or rope_scaling (older): its type."""
    if not isinstance(rope, dict):
        return "default"
    return str(rope.get("rope_type") or rope.get("type") or "default")


def extended_rope(rope: dict[str, Any] | None, max_positions: int, seq_len: int
                  ) -> dict[str, Any] | None:
    """The rope parameters that let a model of `max_positions` positions train on `seq_len`
    tokens: positions interpolated by seq_len / max_positions (default and linear: a linear
    factor; llama3: its factor times that), as Unsloth and position interpolation (Chen et al.,
    2023) stretch them. None: no change needed. A type not in STRETCHED_ROPE raises ValueError
    (the rules refuse it first)."""
    if seq_len <= max_positions:
        return None
    stretch = seq_len / max_positions
    rope = dict(rope or {})
    kind = rope_type_of(rope)
    if kind not in STRETCHED_ROPE:
        raise ValueError(f"rope type {kind!r} is not one the trainer stretches "
                         f"({', '.join(STRETCHED_ROPE)})")
    rope.pop("type", None)
    if kind == "default":
        return {**rope, "rope_type": "linear", "factor": stretch}
    return {**rope, "rope_type": kind, "factor": float(rope.get("factor", 1.0)) * stretch}


def model_config(model: str, model_dir: Path | None = None) -> dict[str, Any] | None:
    """A built-in or stored hub model's config, or a model directory's config.json; None when
    not known here (another hub id: `finetune.hub` may read it; a path read in the trainer's
    pod: the trainer checks it at start)."""
    if model in BUILTIN_MODELS:
        return BUILTIN_MODELS[model]
    if model_dir is None and model in HUB_MODEL_CONFIGS:
        return HUB_MODEL_CONFIGS[model]
    if model_dir is None or not (model_dir / "config.json").is_file():
        return None
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None  # loading it names what is wrong with the file
    return config if isinstance(config, dict) else None


def model_shape(model: str, model_dir: Path | None = None) -> ModelShape | None:
    """The shape of `model_config`'s config, or None."""
    config = model_config(model, model_dir)
    return ModelShape.from_config(model, config) if config is not None else None
