"""LoRA adapters (peft) in the decoder blocks, and their merge for the Hugging Face export.

peft's `inject_adapter_in_model` swaps each targeted Linear for a LoRA layer in place, so the model
keeps its class and module paths (a projection's weight moves to `<proj>.base_layer.weight`, the
adapters are `<proj>.lora_A.default.weight` and `<proj>.lora_B.default.weight`) and FSDP shards it
like any other. Only the adapters require gradients, so only they reach the optimizer.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from finetune_contract.families import lora_target_problem, lora_targets

if TYPE_CHECKING:
    from peft import LoraConfig

    from trainer.config import TrainConfig

ADAPTER_NAME = "default"  # peft's name of the one adapter
ADAPTER_DIR = "adapter"  # beside the merged weights: model/adapter/
_BASE = ".base_layer"
_A, _B = f".lora_A.{ADAPTER_NAME}.weight", f".lora_B.{ADAPTER_NAME}.weight"
# PeftModel.save_pretrained's tensor names: the path under a PeftModel, without the adapter name.
_PEFT_PREFIX = "base_model.model."


def is_adapter_param(fqn: str) -> bool:
    return ".lora_A." in fqn or ".lora_B." in fqn


def apply_lora(model: torch.nn.Module, config: TrainConfig) -> int:
    """Inject LoRA adapters into the decoder blocks and freeze everything else; returns the
    number of adapter parameters. Run on the meta-device model, before any wrapping."""
    from peft import LoraConfig, inject_adapter_in_model

    problem = lora_target_problem(model.config, config.lora_target_modules)
    if problem:
        raise ValueError(f"lora_target_modules {problem}")
    targets = lora_targets(model.config, config.lora_target_modules)
    lora_config = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=targets,
        bias="none",
        base_model_name_or_path=config.model,
    )
    inject_adapter_in_model(lora_config, model)
    adapters = 0
    for fqn, param in model.named_parameters():
        param.requires_grad_(is_adapter_param(fqn))
        adapters += param.numel() if param.requires_grad else 0
    if not adapters:
        raise ValueError(f"lora_target_modules ({config.lora_target_modules}) matched no Linear")
    return adapters


def lora_config_of(model: torch.nn.Module) -> LoraConfig | None:
    """The LoraConfig `apply_lora` gave the model, or None for a model without adapters."""
    configs = getattr(model, "peft_config", None)
    return configs[ADAPTER_NAME] if configs else None


@torch.no_grad()
def init_adapter_weights(fqn: str, full: torch.Tensor, generator: torch.Generator) -> None:
    """peft's default init, drawn whole: A uniform in +-1/sqrt(fan_in) (kaiming_uniform with
    a=sqrt(5)), B zero, so that training starts from the base model's outputs exactly."""
    if fqn.endswith(_B):
        full.zero_()
    else:
        bound = 1.0 / full.shape[1] ** 0.5
        full.uniform_(-bound, bound, generator=generator)


def merge_adapters(
    state: dict[str, torch.Tensor], lora_config: LoraConfig
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(merged, adapter) from a full state dict of a model with adapters.

    merged: the plain model's tensors, each adapted weight W replaced by W + alpha/r * B @ A (in
    fp32), under the names `from_pretrained` expects. adapter: the adapter tensors under the names
    `PeftModel.from_pretrained` expects.
    """
    scaling = lora_config.lora_alpha / (
        lora_config.r**0.5 if lora_config.use_rslora else lora_config.r
    )
    merged: dict[str, torch.Tensor] = {}
    adapter: dict[str, torch.Tensor] = {}
    for fqn, tensor in state.items():
        if is_adapter_param(fqn):
            adapter[_PEFT_PREFIX + fqn.replace(f".{ADAPTER_NAME}.", ".")] = tensor
        elif f"{_BASE}." in fqn:
            prefix = fqn[: fqn.index(_BASE)]
            weight = tensor.float()
            if fqn.endswith(f"{_BASE}.weight"):
                a, b = state[prefix + _A].float(), state[prefix + _B].float()
                weight = weight + scaling * (b @ a)
            # fp32 at least: a base kept in bf16 (trainer/master_weights.py) merges without
            # rounding the adapters' update away; the export casts to its dtype after
            merged[fqn.replace(_BASE, "")] = weight.to(
                torch.promote_types(tensor.dtype, torch.float32))
        else:
            merged[fqn] = tensor
    return merged, adapter


def save_adapter(
    adapter: dict[str, torch.Tensor], lora_config: LoraConfig, out_dir: Path, dtype: torch.dtype
) -> None:
    """adapter_model.safetensors + adapter_config.json, as PeftModel.save_pretrained writes."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {name: t.to(dtype, copy=True).contiguous() for name, t in adapter.items()},
        str(out_dir / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    saved = copy.deepcopy(lora_config)
    saved.inference_mode = True
    saved.save_pretrained(str(out_dir))


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model inside: every LoRA layer skips its adapter (DPO's reference, no copy)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    # The flag the layers' forward reads; enable_adapters() would also flip requires_grad.
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False
