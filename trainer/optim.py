"""The optimizer and gradient clipping, apart from train.py so that the benchmark shares them."""

from __future__ import annotations

import torch

from trainer.config import TrainConfig


def build_optimizer(
    model: torch.nn.Module, config: TrainConfig, device: torch.device
) -> torch.optim.Optimizer:
    """AdamW; norms (1-D weights) take no weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=config.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda"
    )


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    # Sharded gradients give a DTensor norm; the full value is the same on every rank.
    return (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).item()


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
        grad_norm = clip_grad_norm(model, max_grad_norm)
        optimizer.step()
        return grad_norm, False
    scaler.unscale_(optimizer)
    grad_norm = clip_grad_norm(model, max_grad_norm)
    scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    return grad_norm, scaler.get_scale() < scale
