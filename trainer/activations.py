"""Activation memory: checkpointing (every block, every k-th block, per op) and offload to CPU."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from finetune_contract.rules import selective_every

_aten = torch.ops.aten
# Per-op checkpointing keeps these outputs: matmuls and attention are what costs to recompute
# (and a tensor-parallel reduce-scatter, communication); the elementwise rest is recomputed.
SAVED_OPS = frozenset(
    {
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
    }
)


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpoint_activations(blocks: torch.nn.ModuleList, mode: str, selective_ac: str) -> None:
    """Wrap blocks in place: none, full (every block), selective (every k-th block or per op)."""
    if mode == "none":
        return
    every, kwargs = 1, {}
    if mode == "selective":
        every = selective_every(selective_ac)
        if every is None:
            every = 1
            kwargs["context_fn"] = functools.partial(
                create_selective_checkpoint_contexts, _save_matmuls
            )
    for i, block in enumerate(blocks):
        if (i + 1) % every == 0:
            blocks[i] = checkpoint_wrapper(block, **kwargs)


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)


class ActivationsToCPU(saved_tensors_hooks):
    """save_on_cpu for activations only: weights saved for backward stay where they are.

    FSDP frees a block's gathered weights after forward and gathers them again for backward, so a
    CPU copy of them would only add transfers.
    """

    def __init__(self, pin_memory: bool):
        to_cpu = save_on_cpu(pin_memory=pin_memory)

        def pack(tensor: torch.Tensor) -> Any:
            return tensor if _is_parameter(tensor) else to_cpu.pack_hook(tensor)

        def unpack(packed: Any) -> torch.Tensor:
            return packed if isinstance(packed, torch.Tensor) else to_cpu.unpack_hook(packed)

        super().__init__(pack, unpack)


def offload_activations(blocks: torch.nn.ModuleList, device: torch.device) -> None:
    """Keep what each block saves for backward in CPU memory until its backward needs it.

    Hooks on the outermost block module (after checkpoint or compile wrapping): a checkpointed
    block then offloads just its saved inputs, and compiled code runs inside the hooks.
    """
    hooks = ActivationsToCPU(pin_memory=device.type == "cuda")
    for block in blocks:
        block.register_forward_pre_hook(lambda *_: hooks.__enter__())
        block.register_forward_hook(lambda *_: hooks.__exit__(), always_call=True)
