"""Gradient clipping folded into the fused AdamW step equals clipping the gradients first."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainer.optim import clip_grad_norm, clipped_step

# Adam's update hardly changes when every gradient is scaled alike: clipping shows in steps whose
# gradients differ in size, as in the second case.
GRAD_SIZES = {"below-max-norm": (1e-3, 2e-3, 1e-3), "clipped": (1e3, 1e-3, 1e2)}


def sharded_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    return model


def train(fused: bool, grad_sizes: tuple[float, ...], max_norm: float):
    """(last grad norm, weights) after one step per gradient size."""
    model = sharded_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, fused=fused)
    generator = torch.Generator().manual_seed(1)
    for size in grad_sizes:
        (model(torch.randn(8, 16, generator=generator)).square().mean() * size).backward()
        if fused:
            norm = clipped_step(model, optimizer, max_norm).item()
            assert not hasattr(optimizer, "grad_scale")  # GradScaler's slot left free
        else:
            norm = clip_grad_norm(model, max_norm)
            optimizer.step()
        optimizer.zero_grad()
    return norm, [p.full_tensor().clone() for p in model.parameters()]


@pytest.mark.parametrize("case", GRAD_SIZES)
def test_fused_adamw_with_the_clip_factor_as_grad_scale_equals_clip_then_step(world_of_one, case):
    norm_ref, ref = train(False, GRAD_SIZES[case], max_norm=1.0)
    norm, got = train(True, GRAD_SIZES[case], max_norm=1.0)
    assert norm == pytest.approx(norm_ref, rel=1e-5)
    for a, b in zip(ref, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_the_clipped_case_differs_from_not_clipping(world_of_one):
    _, clipped = train(True, GRAD_SIZES["clipped"], max_norm=1.0)
    _, unclipped = train(True, GRAD_SIZES["clipped"], max_norm=1e9)
    assert any(not torch.allclose(a, b, rtol=1e-3) for a, b in zip(clipped, unclipped))


def test_clipped_step_returns_the_norm_before_clipping(world_of_one):
    model = sharded_model()
    (model(torch.randn(8, 16)).square().mean() * 1e3).backward()
    expected = torch.linalg.vector_norm(
        torch.cat([p.grad.full_tensor().flatten() for p in model.parameters()])
    ).item()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    assert expected > 1.0
    assert clipped_step(model, optimizer, max_norm=1.0).item() == pytest.approx(expected)
