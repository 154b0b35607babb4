"""The optimizer and gradient clipping, apart from train.py so that the benchmark shares them."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from trainer.config import TrainConfig
from trainer.master_weights import follow_optimizer


def build_optimizer(
    model: torch.nn.Module, config: TrainConfig, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW; norms (1-D weights) take no weight decay."""
    reshard(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(
        groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda"
    )
    follow_optimizer(model, optimizer)  # one rank without FSDP: its compute copies
    return optimizer


def reshard(model: torch.nn.Module) -> None:
    """Register FSDP's sharded parameters on every module, freeing the unsharded ones.

    A forward without a backward (an eval, DPO's precomputed reference pass) leaves the modules
    that keep their weights after forward (the root; every block under SHARD_GRAD_OP) holding
    the unsharded parameters: an optimizer built from `model.parameters()` then would step copies
    that the next backward discards, and those weights would never train.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def grad_norm(model: torch.nn.Module) -> torch.Tensor:
    """The total L2 norm of the gradients, as a tensor on their device (no host sync).

    Sharded gradients give a DTensor norm; its full value is the same on every rank.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    norm = grad_norm(model)
    params = [p for p in model.parameters() if p.grad is not None]
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
    return norm.item()


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    return all(group.get("fused") for group in optimizer.param_groups)


def clipped_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float
) -> torch.Tensor:
    """Clip the gradients to `max_norm` and step; returns the norm before clipping (a tensor).

    A fused Adam/AdamW takes the clip factor as its `grad_scale` (the divisor torch.amp's
    GradScaler hands it), so clipping costs no extra pass over the gradients; the others clip
    first. No host sync either way: read the returned norm after the step is queued.
    """
    norm = grad_norm(model)
    if _fused(optimizer) and isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        # clip_grads_with_norm_'s factor: min(1, max_norm / (norm + 1e-6)); grads / (1 / factor)
        factor = (max_norm / (norm.float() + 1e-6)).clamp(max=1.0)
        optimizer.grad_scale = factor.reciprocal()  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale  # type: ignore[attr-defined]
    else:
        params = [p for p in model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        optimizer.step()
    return norm


def build_grad_scaler(mixed_precision: str, device: torch.device) -> torch.amp.GradScaler | None:
    """A loss scaler for fp16, whose range underflows small gradients; None for bf16 and fp32.

    torch.amp's scaler suits FSDP2: its inf check on DTensor gradients reduces over the mesh, so
    every rank skips the same steps.
    """
    return torch.amp.GradScaler(device.type) if mixed_precision == "fp16" else None


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    max_grad_norm: float,
    scaler: torch.amp.GradScaler | None = None,
) -> tuple[float, bool]:
    """Clip the gradients and step; returns (grad norm, whether the step was skipped).

    With a scaler the gradients are unscaled before clipping, and a step whose gradients hold an
    inf or NaN on any rank is skipped while the scale backs off.
    """
    if scaler is None:
        return clipped_step(model, optimizer, max_grad_norm).item(), False
    scaler.unscale_(optimizer)
    norm = clip_grad_norm(model, max_grad_norm)
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return norm, scaler.get_scale() < scale
