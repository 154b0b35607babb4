"""LoRA adapters (peft) in the decoder blocks, and their merge for the Hugging Face export.

peft's `inject_adapter_in_model` swaps each targeted Linear for a LoRA layer in place, so the model
keeps its class and module paths (a projection's weight moves to `<proj>.base_layer.weight`, the
adapters are `<proj>.lora_A.default.weight` and `<proj>.lora_B.default.weight`) and FSDP shards it
like any other. Only the adapters require gradients, so only they reach the optimizer.

Each LoRA Linear then moves one class up (`fuse_adapter_adds`): its forward adds the adapter's
output in place by a GEMM, forward and backward (`_fused_forward`), and falls back to peft's for
what that does not cover.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

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
    fuse_adapter_adds(model)
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


def fuse_adapter_adds(model: torch.nn.Module, fused: bool = True) -> None:
    """Each LoRA Linear adds its adapter's output in place, inside a GEMM (`_fused_forward`):
    the same parameters, names and modules, one class up. fused=False puts peft's own class
    back (the benchmark's A/B)."""
    for module in model.modules():
        if isinstance(module, _peft_linear()):
            module.__class__ = _fused_linear() if fused else _peft_linear()


@functools.cache
def _peft_linear() -> type[torch.nn.Module]:
    from peft.tuners.lora import Linear

    return Linear


@functools.cache
def _fused_linear() -> type[torch.nn.Module]:
    """`FusedLoraLinear`: peft's LoRA Linear with `_fused_forward`, made on first use (peft is
    imported only by runs with adapters) and found in this module by name, so a model pickles."""
    return type("FusedLoraLinear", (_peft_linear(),), {
        "forward": _fused_forward, "__doc__": _fused_forward.__doc__, "__module__": __name__})


def __getattr__(name: str) -> Any:
    if name == "FusedLoraLinear":  # what pickle looks the class up by
        return _fused_linear()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@torch.library.custom_op("trainer::add_matmul_", mutates_args=("out",))
def add_matmul_(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    """out += alpha * a @ b in place: one GEMM that reads out and writes it back (beta 1).

    An op of its own because a compiled graph would make `out.addmm_` out of place (a copy of out,
    then the GEMM); inductor runs a mutating custom op on its buffer as it is."""
    out.addmm_(a, b, alpha=alpha)


@add_matmul_.register_fake
def _(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float) -> None:
    return None


class _LoraLinear(torch.autograd.Function):
    """base(x) + scaling * (d A^T) B^T with a frozen base, d = dropout(x) or x itself (`dropped`
    None), the adapter's add in place in both directions: forward adds (d A^T) B^T into the base
    GEMM's output, backward adds (g B) A into g W when d is x (with dropout, it is d's gradient,
    which autograd takes back through the dropout). x is 2-D."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dropped: torch.Tensor | None, weight: torch.Tensor,
                bias: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor, scaling: float
                ) -> torch.Tensor:
        lora_in = x if dropped is None else dropped
        down = lora_in @ a.t()
        # .to: an NF4 weight (trainer/qlora.py) dequantized, as torchao's own linear does
        out = torch.nn.functional.linear(x, weight.to(x.dtype), bias)
        add_matmul_(out, down, b.t(), scaling)
        ctx.save_for_backward(lora_in, weight, a, b, down)
        ctx.scaling, ctx.dropout = scaling, dropped is not None
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # add_matmul_ has no derivative of its own
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        lora_in, weight, a, b, down = ctx.saved_tensors
        up = g @ b  # (tokens, rank)
        grad_x = grad_dropped = None
        if ctx.needs_input_grad[0]:
            grad_x = g @ weight.to(g.dtype)
            if not ctx.dropout:
                add_matmul_(grad_x, up, a, ctx.scaling)
        if ctx.needs_input_grad[1]:
            grad_dropped = (up @ a) * ctx.scaling
        grad_a = (up.t() @ lora_in) * ctx.scaling if ctx.needs_input_grad[4] else None
        grad_b = (g.t() @ down) * ctx.scaling if ctx.needs_input_grad[5] else None
        return grad_x, grad_dropped, None, None, grad_a, grad_b, None


def _fused_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's LoRA Linear, `base(x) + B(A(dropout(x))) * scaling`, with the adapter's output
    added in place by a GEMM (`_LoraLinear`): in forward into the base GEMM's output, in backward
    into the input's gradient. peft's forward writes B's output, scales it and adds it in passes
    of their own, each as wide as the layer (8B's MLP: 14,336 values a token), in every forward
    and recompute, and scales the gradient in backward; here the scaling rides in the GEMM.
    Dropout while training draws peft's mask for the adapter's input; the input's gradient then
    takes the adapter's part through it, outside the GEMM.

    Anything else runs peft's own forward: adapters disabled, merged or absent from the layer,
    several adapters, a variant such as DoRA, a bias on B, a trained base or one with a forward
    of its own (not exactly nn.Linear), tensor-parallel DTensors, mixed dtypes."""
    if not _fusable(self, x) or args or kwargs:
        return _peft_linear().forward(self, x, *args, **kwargs)
    base = self.base_layer
    rows = x.reshape(-1, x.shape[-1])
    dropout = self.lora_dropout[ADAPTER_NAME]
    # dropout while training: the adapter's input only, as peft's (the same draws)
    dropped = dropout(rows) if dropout.training and not isinstance(dropout, torch.nn.Identity) \
        else None
    out = _LoraLinear.apply(rows, dropped, _base_weight(base.weight, x.dtype), base.bias,
                            self.lora_A[ADAPTER_NAME].weight, self.lora_B[ADAPTER_NAME].weight,
                            self.scaling[ADAPTER_NAME])
    return out.view(*x.shape[:-1], out.shape[-1])


def _dequantize(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weight.to(dtype)


def _base_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The frozen base weight for `_LoraLinear`. An NF4 one (trainer/qlora.py) is dequantized
    there in forward and again in backward, only the 4-bit weight kept between. Compiled, the
    partitioner would merge the two into one and keep its bf16 output (4x the 4-bit weight; 13
    GiB at 8B without checkpointing) from forward to backward: dequantized here inside a
    checkpoint region instead, which marks it to be recomputed in backward."""
    if torch.compiler.is_compiling() and is_quantized(weight):
        return checkpoint(_dequantize, weight, dtype, use_reentrant=False)
    return weight


def is_quantized(param: torch.Tensor) -> bool:
    """Whether a weight is QLoRA's 4-bit NF4 (trainer/qlora.py)."""
    # No NF4 weight exists before quantize_into imported torchao: other runs never import it.
    torchao = sys.modules.get("torchao.quantization")
    if torchao is None:
        return False
    return isinstance(param, torchao.NF4Tensor) or isinstance(
        getattr(param, "data", None), torchao.NF4Tensor)


def _fusable(layer: Any, x: torch.Tensor) -> bool:
    """Whether `_fused_forward` computes what peft's forward would (its doc's list)."""
    if (layer.disable_adapters or layer.merged or layer.active_adapters != [ADAPTER_NAME]
            or ADAPTER_NAME not in layer.lora_A
            or ADAPTER_NAME in getattr(layer, "lora_variant", ())):  # older peft: no variants
        return False
    base, a, b = layer.base_layer, layer.lora_A[ADAPTER_NAME], layer.lora_B[ADAPTER_NAME]
    frozen = [base.weight] + ([] if base.bias is None else [base.bias])
    return (type(base) is torch.nn.Linear and not any(p.requires_grad for p in frozen)
            and b.bias is None
            and not any(isinstance(p, DTensor) for p in (*frozen, a.weight, b.weight))
            and x.dtype == a.weight.dtype == b.weight.dtype == base.weight.dtype)  # NF4: bf16


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
