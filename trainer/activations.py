"""Activation memory: checkpointing (every block, every k-th block, per op) and offload to CPU."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.autograd.graph import save_on_cpu, saved_tensors_hooks
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from finetune_contract.models import BUILTIN_MODELS
from finetune_contract.planner import AUTO, GIB, Hardware, resolve_checkpointing
from finetune_contract.rules import selective_every
from finetune_contract.train_config import TrainConfig

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


def resolve_auto_checkpointing(config: TrainConfig, world_size: int, local_world_size: int,
                               device: torch.device) -> tuple[TrainConfig, str]:
    """`activation_checkpointing: auto` for this GPU (the contract's planner, as validate ran it
    for the instance type), and the line saying what it chose; other values pass through."""
    if config.activation_checkpointing != AUTO:
        return config, ""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        hardware = Hardware.of_gpu(props.name, props.total_memory / GIB)
    else:
        hardware = Hardware(gpu_memory_gib=None, peak_flops=None, name=device.type)
    model_config = BUILTIN_MODELS.get(config.model)
    if model_config is None:
        from transformers import AutoConfig  # a model directory or hub id: its config.json

        model_config = AutoConfig.from_pretrained(config.model)
    return resolve_checkpointing(config, world_size=world_size,
                                 local_world_size=local_world_size, hardware=hardware,
                                 config=model_config)


def checkpoint_activations(blocks: torch.nn.ModuleList, mode: str, selective_ac: str) -> None:
    """Wrap blocks in place: none, full (every block), selective (every k-th block or per op)."""
    if mode == "none":
        return
    if mode == AUTO:  # resolve_auto_checkpointing makes it concrete at start
        raise ValueError("activation_checkpointing auto must be resolved before wrapping blocks")
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
