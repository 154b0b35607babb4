"""Build the causal LM on the meta device, then fill its shards: seeded random or pretrained."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import snapshot_download
from safetensors import safe_open
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from finetune_contract.families import attention_kernel, family_of
from finetune_contract.models import BUILTIN_MODELS, extended_rope
from trainer.attention import attn_implementation
from trainer.lora import init_adapter_weights, is_adapter_param
from trainer.master_weights import frozen_in_compute_dtype
from trainer.qlora import defer_quantized, pending_shape, quantize_into


def builtin_config(name: str, tokenizer: PreTrainedTokenizerBase | None = None) -> LlamaConfig:
    """The LlamaConfig of a built-in model, with special token ids taken from `tokenizer`."""
    kwargs = dict(BUILTIN_MODELS[name])
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


def build_model(model: str, tokenizer: PreTrainedTokenizerBase | None = None,
                attention: str = "sdpa", seq_len: int | None = None) -> PreTrainedModel:
    """The model's modules on the meta device, fp32 and without storage; `attention` the
    contract's kernel (trainer/attention.py); `seq_len` beyond the model's positions stretches
    its rotary embedding (`stretch_positions`), which the export's config.json then holds.

    Shard it first, then `materialize_weights` allocates each rank's shards and fills them, so no
    process ever holds the whole model.
    """
    if model in BUILTIN_MODELS:
        config = builtin_config(model, tokenizer)
    else:
        config = AutoConfig.from_pretrained(pretrained_dir(model))
    if seq_len is not None:
        stretch_positions(config, seq_len)
    return model_on_meta(config, attention)


def stretch_positions(config: PretrainedConfig, seq_len: int) -> None:
    """A config whose max_position_embeddings is below seq_len: its rope parameters stretched
    to seq_len (finetune_contract.models.extended_rope) and its positions raised to it."""
    rope = extended_rope(getattr(config, "rope_parameters", None), config.max_position_embeddings,
                         seq_len)
    if rope is not None:
        config.rope_parameters = rope
        config.max_position_embeddings = seq_len


def model_on_meta(config: Any, attention: str = "sdpa") -> PreTrainedModel:
    """The model of `config` on the meta device, fp32, with the attention the trainer runs:
    soft-capped scores (eager) win over the contract's kernel; else sdpa or fa4."""
    implementation = attention_kernel(config)  # ValueError outside the architecture table
    if implementation == "sdpa":
        implementation = attn_implementation(attention)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=implementation
        )


def pretrained_dir(model: str) -> Path:
    """A local Hugging Face model dir, or the local snapshot of a hub id (config and weights)."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    try:
        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors"]))
    except (OSError, ValueError) as error:
        raise ValueError(
            f"model must be one of {', '.join(BUILTIN_MODELS)}, a local Hugging Face model dir or "
            f"a hub id; {model!r} could not be loaded: {error}"
        ) from error


@torch.no_grad()
def materialize_weights(
    model: PreTrainedModel,
    source: str,
    seed: int,
    device: torch.device,
    quantize_dtype: torch.dtype | None = None,
    random_init: bool = False,
) -> None:
    """Allocate the (sharded) parameters of a `build_model` model on `device` and fill them.

    `source` is the `build_model` name: a built-in config (or any, with `random_init`: the
    benchmark's shapes, which have no checkpoint) gets seeded random weights, anything else its
    pretrained weights. Run after sharding (fully_shard), before the first forward.
    quantize_dtype: QLoRA (trainer/qlora.py): the blocks' frozen Linear weights are made in this
    dtype and stored in NF4 one at a time, the same numbers as an unquantized run's draw.
    """
    if quantize_dtype is not None:
        defer_quantized(model)
    frozen_in_compute_dtype(model)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives an unsharded (non-DTensor) head its own new tensor
    if random_init or source in BUILTIN_MODELS:
        init_random_weights(model, seed, quantize_dtype)
    else:
        load_pretrained_weights(model, pretrained_dir(source), quantize_dtype)
    init_adapters(model, seed)
    init_buffers(model)


@torch.no_grad()
def init_buffers(model: PreTrainedModel) -> None:
    """Non-persistent buffers (the rotary frequencies, Gemma's embedding scale) are in no
    checkpoint: recompute them. A module with parameters too gets only its buffers filled, from
    the attributes the architecture table names (its init would redraw the weights)."""
    values = dict(family_of(model.config).buffer_values)
    for module in model.modules():
        buffers = dict(module.named_buffers(recurse=False))
        if not buffers:
            continue
        if next(module.parameters(recurse=False), None) is None:
            model._init_weights(module)
            continue
        unknown = [name for name in buffers if name not in values]
        if unknown:
            raise ValueError(f"{type(module).__name__} has parameters and buffers "
                             f"({', '.join(unknown)}) the architecture table does not fill "
                             "(finetune_contract.families buffer_values)")
        for name, buffer in buffers.items():
            buffer.fill_(getattr(module, values[name]))


@torch.no_grad()
def init_adapters(model: torch.nn.Module, seed: int) -> None:
    """LoRA adapters (trainer.lora), drawn whole from their own stream and cut to the shard, so
    the base weights are the same numbers with or without adapters."""
    generator: torch.Generator | None = None
    for fqn, param in model.named_parameters():
        if not is_adapter_param(fqn):
            continue
        if generator is None:
            generator = torch.Generator(param.device).manual_seed(seed + 1)
        full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        init_adapter_weights(fqn, full, generator)
        _local(param).copy_(_shard_of(full, param))


@torch.no_grad()
def init_random_weights(
    model: torch.nn.Module, seed: int, quantize_dtype: torch.dtype | None = None
) -> None:
    """Hugging Face's init for the table's families: normal(0, initializer_range) matrices and
    embeddings (padding row zero), norms the family's norm_init (one; Gemma's zero), biases zero.

    Each parameter is drawn whole on its device, in model order from one generator seeded with
    `seed`, then cut to this rank's shard: every rank draws the same numbers, so the model is the
    same on every rank and for every world size (the device type decides the random stream).
    """
    std = model.config.initializer_range  # type: ignore[union-attr]
    norm_init = family_of(model.config).norm_init
    generator: torch.Generator | None = None
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen or is_adapter_param(f"{module_name}.{name}"):
                continue  # a tied weight, drawn once; adapters: init_adapters
            seen.add(id(param))
            if generator is None:
                generator = torch.Generator(param.device).manual_seed(seed)
            fqn = f"{module_name}.{name}"
            shape = pending_shape(model, fqn)
            # drawn in fp32 whatever the parameter's dtype (a frozen base made in bf16): the
            # same numbers, rounded once, as an fp32 master cast to its compute copy
            dtype = torch.promote_types(param.dtype, torch.float32) \
                if param.is_floating_point() else param.dtype
            full = torch.empty(shape or param.shape, dtype=dtype, device=param.device)
            if name == "bias":
                full.zero_()
            elif isinstance(module, torch.nn.Linear | torch.nn.Embedding):
                full.normal_(0.0, std, generator=generator)
                if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
                    full[module.padding_idx] = 0
            elif "Norm" in type(module).__name__:
                full.fill_(norm_init)
            else:
                raise ValueError(f"no init for {type(module).__name__}.{name}: not in the "
                                 "architecture table's families")
            if shape is not None:
                quantize_into(model, fqn, full, quantize_dtype)
            else:
                _local(param).copy_(_shard_of(full, param))


@torch.no_grad()
def load_pretrained_weights(
    model: torch.nn.Module, path: Path, quantize_dtype: torch.dtype | None = None
) -> None:
    """Copy a Hugging Face safetensors checkpoint into the (sharded) parameters.

    Each rank reads from the memory-mapped files only the slice of each tensor its shard holds,
    so CPU memory stays at about one shard of one tensor, whatever the model's size.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    elif (path / "model.safetensors").is_file():
        with safe_open(path / "model.safetensors", framework="pt") as f:
            weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    else:
        raise ValueError(f"{path} has no safetensors weights (model.safetensors or its index)")
    with ExitStack() as stack:
        files: dict[str, Any] = {}
        for fqn, param in model.named_parameters():
            if is_adapter_param(fqn):
                continue  # not in the base model: init_adapters
            key = fqn.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
            key = key.replace(".base_layer.", ".")  # a Linear that LoRA wrapped
            if key not in weight_map:
                raise ValueError(f"{path}: the checkpoint has no tensor {key}")
            file = weight_map[key]
            if file not in files:
                files[file] = stack.enter_context(safe_open(path / file, framework="pt"))
            stored = files[file].get_slice(key)
            shape = pending_shape(model, fqn)
            if tuple(stored.get_shape()) != tuple(shape or param.shape):
                raise ValueError(
                    f"{path}: {key} has shape {tuple(stored.get_shape())}, the model "
                    f"{tuple(shape or param.shape)}"
                )
            if shape is not None:
                quantize_into(model, fqn, stored[:].to(param.device), quantize_dtype)
            else:
                _local(param).copy_(_read_shard(stored, param))


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter, to write into (no_grad: the storage itself)."""
    return param.to_local() if isinstance(param, DTensor) else param


def _shard_of(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    if not isinstance(param, DTensor):
        return full
    # src_data_rank=None: every rank holds the same full tensor, so cut locally, no traffic.
    return distribute_tensor(
        full, param.device_mesh, param.placements, src_data_rank=None
    ).to_local()


def _read_shard(stored: Any, param: torch.Tensor) -> torch.Tensor:
    """Read this rank's shard of `param` from a safetensors slice, reading no other rows."""
    if isinstance(param, DTensor) and all(type(p) in (Shard, Replicate) for p in param.placements):
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
        return stored[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
    return _shard_of(stored[:], param)  # strided shards (FSDP over TP): one whole tensor
