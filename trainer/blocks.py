"""Where a model keeps its repeated decoder blocks: the one layout rule the trainer relies on.

The unit of FSDP sharding, activation checkpointing, tensor parallelism and NF4 quantization.
Torch only: the model builder (trainer/model.py) and every module that walks the blocks import it
from here, so none of them imports another for it.
"""

from __future__ import annotations

import torch


def decoder_blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The repeated transformer blocks: the unit of sharding and of activation checkpointing."""
    blocks = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__} has no model.layers; only Llama-like models are supported"
        )
    return blocks
