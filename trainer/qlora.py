"""QLoRA: the frozen Linear weights of the decoder blocks in 4-bit NormalFloat (torchao's NF4).

`quantize_base: nf4` with LoRA. Each weight is drawn or read whole, in the compute dtype, and
quantized at once (blocks of 64 values with a scale each, the scales themselves quantized in
blocks of 256: QLoRA's double quantization), so neither fp32 nor bf16 copies of the base ever
exist together: a 70B's base takes about 35 GiB. Forward dequantizes a weight to the input's
dtype for its matmul (torchao's `linear_nf4`); backward gives gradients to the input and the
adapters only. The 4-bit weights are not sharded by FSDP (every rank holds the whole quantized
base); FSDP shards the adapters, norms, embeddings and head as in any LoRA run.
"""

from __future__ import annotations

import torch

from finetune_contract.planner import NF4_BLOCK_SIZE as BLOCK_SIZE
from finetune_contract.planner import NF4_SCALER_BLOCK_SIZE as SCALER_BLOCK_SIZE
from trainer.blocks import decoder_blocks
from trainer.lora import is_adapter_param, is_quantized

# The model attribute that lists the weights to quantize: {fqn: full shape}, set before the
# weights are allocated (materialize_weights) and read as each is drawn or loaded.
PENDING = "_trainer_nf4_pending"


def quantized_weight_fqns(model: torch.nn.Module) -> list[str]:
    """The frozen Linear weights of the decoder blocks (LoRA's base layers and the Linears it
    does not target): what `quantize_base` stores in NF4. Adapters, norms, embeddings and the
    head keep their dtype."""
    blocks = decoder_blocks(model)
    prefix = next(name for name, module in model.named_modules() if module is blocks)
    return [
        f"{prefix}.{name}.weight"
        for name, module in blocks.named_modules()
        if isinstance(module, torch.nn.Linear) and not is_adapter_param(f"{name}.weight")
    ]


def quantized_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights `quantize_base` will quantize, as they are before materialize: FSDP must
    leave them alone (`fully_shard(ignored_params=...)`)."""
    params = dict(model.named_parameters())
    return [params[fqn] for fqn in quantized_weight_fqns(model)]


def defer_quantized(model: torch.nn.Module) -> None:
    """Swap each weight to quantize for an empty placeholder, so `to_empty` allocates nothing
    for it; `quantize_into` then fills it when its turn comes in the init or load order."""
    pending: dict[str, torch.Size] = {}
    for fqn in quantized_weight_fqns(model):
        module_name, name = fqn.rsplit(".", 1)
        module = model.get_submodule(module_name)
        pending[fqn] = module.weight.shape
        setattr(module, name, torch.nn.Parameter(torch.empty(0, device="meta"),
                                                 requires_grad=False))
    setattr(model, PENDING, pending)


def pending_shape(model: torch.nn.Module, fqn: str) -> torch.Size | None:
    """The full shape of a placeholder weight `defer_quantized` made, else None."""
    return getattr(model, PENDING, {}).get(fqn)


@torch.no_grad()
def quantize_into(model: torch.nn.Module, fqn: str, full: torch.Tensor, dtype: torch.dtype
                  ) -> None:
    """Quantize a whole weight (any dtype, on the device) to NF4 and set it as the module's
    frozen parameter in place of its placeholder."""
    from torchao.quantization import to_nf4

    module_name, name = fqn.rsplit(".", 1)
    if full.numel() % BLOCK_SIZE:
        raise ValueError(f"quantize_base: {fqn} has {full.numel()} values, not a multiple of "
                         f"NF4's block of {BLOCK_SIZE}; set quantize_base to none")
    nf4 = to_nf4(full.to(dtype), BLOCK_SIZE, scaler_block_size(full.numel() // BLOCK_SIZE))
    setattr(model.get_submodule(module_name), name, torch.nn.Parameter(nf4, requires_grad=False))
    del getattr(model, PENDING)[fqn]


def scaler_block_size(blocks: int) -> int:
    """SCALER_BLOCK_SIZE, or for a small weight (a test model's) the largest power of two below
    it that divides its number of blocks."""
    size = SCALER_BLOCK_SIZE
    while blocks % size:
        size //= 2
    return size


def dequantized(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of an NF4 weight (the export merges the adapters into it)."""
    data = getattr(tensor, "data", tensor)
    return data.get_original_weight() if is_quantized(data) else tensor


def nf4_bytes(model: torch.nn.Module) -> int:
    """Bytes the 4-bit weights take on the device, scales included."""
    total = 0
    for param in model.parameters():
        if is_quantized(param):
            data = param.data
            total += sum(t.numel() * t.element_size() for t in (
                data.quantized_data, data.quantized_scalers, data.quantization_factor,
                data.scaler_mean, data.nf4))
    return total
