"""fp16 loss scaling and activation checkpointing, in this process (a world of one where needed)."""

import math
from collections import Counter

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaForCausalLM

from finetune_contract.models import BUILTIN_MODELS
from trainer.activations import checkpoint_activations
from trainer.model import builtin_config
from trainer.optim import build_grad_scaler, optimizer_step
from trainer.parallel import mixed_precision_policy

aten = torch.ops.aten
SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default  # what sdpa runs on a CPU
LAYERS = BUILTIN_MODELS["tiny-llama"]["num_hidden_layers"]


def test_an_fp16_step_with_an_inf_gradient_is_skipped_and_the_scale_backs_off(world_of_one):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model, mesh=mesh, mp_policy=mixed_precision_policy("fp16"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scaler = build_grad_scaler("fp16", world_of_one.device)

    def weights() -> list[torch.Tensor]:
        return [p.full_tensor().clone() for p in model.parameters()]

    scaler.scale(model(torch.ones(2, 8)).mean()).backward()
    model[0].weight.grad.fill_(float("inf"))  # an overflow in the backward
    before = weights()
    grad_norm, skipped = optimizer_step(model, optimizer, 1.0, scaler)
    assert skipped and not math.isfinite(grad_norm)
    assert all(torch.equal(a, b) for a, b in zip(before, weights()))
    assert scaler.get_scale() == 2.0**15

    optimizer.zero_grad()
    scaler.scale(model(torch.ones(2, 8)).mean()).backward()
    grad_norm, skipped = optimizer_step(model, optimizer, 1.0, scaler)
    assert not skipped and math.isfinite(grad_norm)
    assert not any(torch.equal(a, b) for a, b in zip(before, weights()))
    assert scaler.get_scale() == 2.0**15


def test_bf16_and_fp32_need_no_grad_scaler():
    assert build_grad_scaler("bf16", torch.device("cpu")) is None
    assert build_grad_scaler("fp32", torch.device("cpu")) is None


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))


def backward_ops_and_grads(mode: str, selective_ac: str = "op") -> tuple[Counter, list]:
    """The aten ops run by the backward of tiny-llama checkpointed so, and its gradients."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(builtin_config("tiny-llama"))
    checkpoint_activations(model.model.layers, mode, selective_ac)
    input_ids = torch.arange(32).reshape(2, 16)
    loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    with OpCounter() as counter:
        loss.backward()
    return counter.counts, [p.grad for p in model.parameters()]


@pytest.fixture(scope="module")
def no_checkpointing():
    return backward_ops_and_grads("none")


@pytest.mark.parametrize(
    ("mode", "selective_ac", "recomputed_attention"),
    [("full", "op", LAYERS), ("selective", "2", LAYERS // 2), ("selective", "op", 0)],
    ids=["full", "every_2nd_block", "per_op"],
)
def test_checkpointing_recomputes_the_chosen_blocks_and_ops_to_the_same_gradients(
    no_checkpointing, mode, selective_ac, recomputed_attention
):
    plain_ops, plain_grads = no_checkpointing
    ops, grads = backward_ops_and_grads(mode, selective_ac)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    assert plain_ops[SDPA] == 0 and ops[SDPA] == recomputed_attention
    if mode == "selective" and selective_ac == "op":
        # Per op: matmul outputs are saved (no more matmuls than plain backward), norms recomputed.
        assert ops[aten.mm.default] == plain_ops[aten.mm.default]
        assert ops[aten.rsqrt.default] > plain_ops[aten.rsqrt.default]
    else:
        assert ops[aten.mm.default] > plain_ops[aten.mm.default]


def test_auto_checkpointing_at_trainer_start_is_the_choice_validate_makes_for_that_gpu(
        monkeypatch):
    from types import SimpleNamespace

    from finetune.run_plan import hardware_of
    from finetune_contract.instance_types import INSTANCE_TYPES
    from finetune_contract.planner import GIB, resolve_checkpointing
    from finetune_contract.train_config import TrainConfig
    from trainer.activations import resolve_auto_checkpointing

    config = TrainConfig(model="llama-3b", seq_len=4096, micro_batch=4, strategy="SHARD_GRAD_OP",
                         mixed_precision="bf16", activation_checkpointing="auto")
    on_cpu, why = resolve_auto_checkpointing(config, 1, 1, torch.device("cpu"))
    assert on_cpu.activation_checkpointing == "none" and "no GPU memory known" in why
    p5 = INSTANCE_TYPES["p5.48xlarge"]  # 80 GiB H100s: 3B micro-batch 4 needs checkpointing
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(
        name=p5.gpu_model, total_memory=p5.gpu_memory_gib * GIB))
    at_start, _ = resolve_auto_checkpointing(config, 1, 1, torch.device("cuda", 0))
    at_validate, _ = resolve_checkpointing(config, world_size=1, local_world_size=1,
                                           hardware=hardware_of(p5))
    assert at_start == at_validate and at_start.activation_checkpointing != "none"
