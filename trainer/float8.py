"""float8 matmuls in the decoder blocks with torchao (dynamic scaling, tensorwise or rowwise).

Each nn.Linear of a block becomes torchao's Float8Linear before FSDP wraps it: inputs, weights and
output gradients are cast to float8 with a per-tensor scale and multiplied on the float8 tensor
cores (Ada, Hopper and later: FLOAT8_MIN_CAPABILITY; the trainer's start refuses a device without
them by the rule validate asks, `rules.device_problems`). With sharded weights FSDP all-gathers
them in float8 (half the bytes of bf16); their scales are computed for all weights at once after
each optimizer step. The embeddings and the head stay in bf16. float8 runs are judged by tokens/s:
MFU's peak is the bf16 one.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

# Tests only: run torchao's emulation (float8 casts, matmuls in high precision) on any device.
EMULATE_ENV = "TRAINER_FLOAT8_EMULATE"


def emulated() -> bool:
    """Whether float8 is emulated here: then it runs on any device (check_start asks)."""
    return os.environ.get(EMULATE_ENV, "") == "1"


def _fits_float8(module: torch.nn.Module, _fqn: str) -> bool:
    """float8 matmuls need both dims of the weight divisible by 16."""
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def float8_config(recipe: str, sharded: bool) -> Any:
    """torchao's Float8LinearConfig for `recipe` (tensorwise or rowwise).

    sharded: the weights are sharded by FSDP; tensorwise then all-gathers them in float8 (one
    scale per tensor survives sharding; torchao has no float8 all-gather for rowwise).
    """
    from torchao.float8 import Float8LinearConfig

    if recipe == "tensorwise":
        return Float8LinearConfig(enable_fsdp_float8_all_gather=sharded, emulate=emulated())
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulated())


def is_float8_linear(module: torch.nn.Module) -> bool:
    """Whether `module` is torchao's Float8Linear (by name: torchao is imported only for float8)."""
    return type(module).__name__ == "Float8Linear"


def uses_float8_all_gather(model: torch.nn.Module) -> bool:
    """Whether the scales of float8 all-gathered weights must be precomputed after each step."""
    return any(getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False)
               for m in model.modules() if is_float8_linear(m))


def convert_to_float8(blocks: torch.nn.ModuleList, sharded: bool,
                      recipe: str = "tensorwise") -> int:
    """Swap the blocks' nn.Linear layers for Float8Linear; returns how many were swapped."""
    from torchao.float8 import convert_to_float8_training

    config = float8_config(recipe, sharded)
    for block in blocks:
        convert_to_float8_training(block, module_filter_fn=_fits_float8, config=config)
    converted = sum(map(is_float8_linear, blocks.modules()))
    if not converted:
        raise ValueError("float8: no Linear layer of the decoder blocks has dims divisible by 16")
    return converted


def precompute_float8_scales(model: torch.nn.Module) -> None:
    """After each optimizer step: the float8 scales of all sharded weights in one all-reduce
    (tensorwise with float8 all-gather only; otherwise nothing to do)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    if uses_float8_all_gather(model):
        precompute_float8_dynamic_scale_for_fsdp(model)
