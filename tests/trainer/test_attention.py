"""attention fa4: the FlashAttention 4 custom ops, their autograd and compile, and the rules.

On the CPU the ops run their torch reference (trainer/attention.py), so these tests prove the
wiring (registration, fake shapes, backward, transformers' dispatch, compile) and the function
the kernels must compute; the kernels against cuDNN are checked on the GPU by the benchmark
(`python -m bench.train --attention-check`).
"""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import trainer.attention as attention
from finetune_contract.fields import ContractError
from finetune_contract.models import ModelShape
from finetune_contract.rules import config_problems, device_problems
from finetune_contract.train_config import TrainConfig
from trainer.config import load_config
from trainer.parallel import check_start


def qkv(batch=2, seq=33, heads=4, kv_heads=2, dim=16, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seq)
    shape = lambda h: (batch, seq, h, dim)  # noqa: E731
    return [torch.randn(shape(h), generator=generator, dtype=dtype, requires_grad=True)
            for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("causal", [True, False])
def test_fa4_ops_compute_sdpa_attention_and_its_gradients_with_grouped_kv_heads(causal):
    q, k, v = qkv()
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = attention.fa4_fwd(q, k, v, scale, causal)
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
        enable_gqa=True).transpose(1, 2)
    assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    torch.testing.assert_close(out, expected.to(out.dtype), rtol=1e-6, atol=1e-6)
    # Seeded: the reference computes in fp32, so its error (~1e-6) depends on the draw.
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_fa4_ops_pass_torch_library_opcheck():
    q, k, v = qkv(dtype=torch.float32)
    torch.library.opcheck(torch.ops.trainer.fa4_fwd.default, (q, k, v, 0.25, True))
    out, lse = attention.fa4_fwd(q.detach(), k.detach(), v.detach(), 0.25, True)
    torch.library.opcheck(torch.ops.trainer.fa4_bwd.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse,
                           0.25, True))


def losses_of(monkeypatch, implementation, compile, steps=3):
    """Losses of `steps` AdamW steps of a small Llama (head dim 64, grouped KV heads) in bf16,
    and how many times the fa4 forward ran (the trainer refuses fa4 on a CPU at start, so the
    model is built here as trainer/model.py builds it, without the trainer's start check)."""
    calls = []
    reference = attention._reference_fwd
    monkeypatch.setattr(attention, "_reference_fwd",
                        lambda *a: calls.append(1) or reference(*a))
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation=implementation)
    model.to(torch.bfloat16)
    if compile:  # per decoder block, as trainer/parallel.py compiles (masks are made outside)
        for layer in model.model.layers:
            layer.compile(backend="aot_eager")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    input_ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, len(calls)


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_fa4_trains_to_the_losses_of_sdpa(monkeypatch, compile):
    torch._dynamo.reset()
    sdpa, sdpa_calls = losses_of(monkeypatch, "sdpa", compile)
    fa4, fa4_calls = losses_of(monkeypatch, attention.attn_implementation("fa4"), compile)
    assert sdpa_calls == 0
    assert fa4_calls > 0  # the fa4 op ran, not sdpa's fallback
    assert sdpa[-1] < sdpa[0]
    assert fa4 == pytest.approx(sdpa, rel=1e-2)


def test_fa4_hands_masked_and_fp32_attention_to_sdpa():
    q = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)
    assert attention.kernel_takes(q, q, None, 0.0, {})
    assert not attention.kernel_takes(q, q, torch.ones(1, 1, 8, 8, dtype=torch.bool), 0.0, {})
    assert not attention.kernel_takes(q.float(), q.float(), None, 0.0, {})
    assert not attention.kernel_takes(q, q[:, :, :1], None, 0.0, {})  # decoding with a cache
    assert not attention.kernel_takes(q, q, None, 0.0, {"sliding_window": 4096})
    assert not attention.kernel_takes(q[..., :48], q[..., :48], None, 0.0, {})


@pytest.mark.parametrize("overrides, wrong", [
    ({"tp_degree": 2, "mixed_precision": "bf16"}, "tp_degree"),
    ({"mixed_precision": "fp32"}, "fp32"),
])
def test_validate_and_the_trainer_refuse_what_fa4_cannot_run(overrides, wrong):
    cfg = TrainConfig(attention="fa4", **overrides)
    problems = config_problems(cfg, world_size=2, local_world_size=2, shape=None)
    assert [field for field, _ in problems] == ["attention"]
    assert wrong in problems[0][1] and "sdpa" in problems[0][1]


def test_fa4_refuses_a_head_dim_its_kernels_lack():
    shape = ModelShape.from_config("odd", {"num_attention_heads": 4, "hidden_size": 192})
    assert shape.head_dim == 48
    problems = config_problems(TrainConfig(attention="fa4", mixed_precision="bf16"),
                               world_size=1, local_world_size=1, shape=shape)
    assert problems and "48" in problems[0][1]


@pytest.mark.parametrize("gpu, capability, refused", [
    (False, None, True), (True, (8, 0), True), (True, (8, 9), True), (True, (9, 0), False),
    (True, (10, 0), False)])
def test_fa4_needs_a_hopper_or_blackwell_gpu(gpu, capability, refused):
    problems = device_problems(quantize_base="none", gpu=gpu, attention="fa4",
                               capability=capability)
    assert bool(problems) == refused
    assert not device_problems(quantize_base="none", gpu=gpu, attention="sdpa",
                               capability=capability)


def test_the_trainer_refuses_fa4_at_start_on_a_cpu(world_of_one):
    config = load_config(None, {"attention": "fa4", "mixed_precision": "bf16"})
    with pytest.raises(ContractError, match="attention.*no CUDA GPU"):
        check_start(config, world_of_one)


def test_fa4_varlen_ops_attend_within_each_document_as_separate_calls_would():
    """Packed documents (varlen: all tokens in one sequence, bounded by cu_seqlens): each
    document's output, log-sum-exp and gradients are those of its own causal call."""
    lengths = [5, 11, 1, 16]
    q, k, v = (t.detach()[0].requires_grad_(True) for t in qkv(batch=1, seq=sum(lengths)))
    bounds = torch.tensor([0, 5, 16, 17, 33], dtype=torch.int32)
    out, lse = attention.fa4_fwd(q, k, v, 0.25, True, bounds, max(lengths))
    assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    # Seeded: the reference computes in fp32, so its error (~1e-6) depends on the draw.
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(0), dtype=out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    for start, end in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        part = [t.detach()[start:end][None].requires_grad_(True) for t in (q, k, v)]
        alone, alone_lse = attention.fa4_fwd(*part, 0.25, True)
        torch.testing.assert_close(out[start:end], alone[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse[:, start:end], alone_lse[0], rtol=1e-5, atol=1e-6)
        alone_grads = torch.autograd.grad((alone[0] * weights[start:end]).sum(), part)
        for got, want in zip(grads, alone_grads, strict=True):
            torch.testing.assert_close(got[start:end], want[0], rtol=1e-5, atol=1e-6)


def test_fa4_varlen_ops_pass_torch_library_opcheck():
    q, k, v = (t.detach()[0] for t in qkv(batch=1, dtype=torch.float32))
    bounds = torch.tensor([0, 7, 33], dtype=torch.int32)
    torch.library.opcheck(torch.ops.trainer.fa4_fwd.default, (q, k, v, 0.25, True, bounds, 26))
    out, lse = attention.fa4_fwd(q, k, v, 0.25, True, bounds, 26)
    torch.library.opcheck(torch.ops.trainer.fa4_bwd.default,
                          (torch.randn_like(out), q, k, v, out, lse, 0.25, True, bounds, 26))


@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_packed_rows_under_fa4_give_sdpas_masked_losses_and_gradients_without_a_mask(
        monkeypatch, compile):
    """Two rows of packed documents (and a row's padding): fa4's varlen path against sdpa's
    block-diagonal mask, bf16, the same loss and gradients; the fa4 attention got no mask and
    ran the varlen op (compiled: the decoder blocks, as trainer/parallel.py compiles them)."""
    from trainer.batch import Batch
    from trainer.loss import add_loss_method
    from trainer.train import token_loss_sum

    masks, varlen_calls = [], []
    forward = attention.fa4_attention_forward

    def spy(module, query, key, value, attention_mask, *args, **kwargs):
        masks.append(attention_mask)
        varlen_calls.append(kwargs.get("cu_seq_lens_q") is not None)
        return forward(module, query, key, value, attention_mask, *args, **kwargs)

    monkeypatch.setattr(attention, "fa4_attention_forward", spy)
    attention.register.cache_clear()
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
                              [0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 0, 1, 2, 3]])  # 2nd: padding
    ids = torch.randint(1, 256, positions.shape, generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, 12:] = -100  # the padding's labels
    batch = Batch(ids, labels, int((labels != -100).sum()), positions)
    results = []
    for implementation in ("sdpa", attention.attn_implementation("fa4")):
        torch.manual_seed(0)
        model = LlamaForCausalLM._from_config(config, attn_implementation=implementation)
        model.to(torch.bfloat16)
        if compile:
            torch._dynamo.reset()
            for layer in model.model.layers:
                layer.compile(backend="aot_eager", fullgraph=True)
        add_loss_method(model)
        loss = token_loss_sum(model, batch)
        loss.backward()
        results.append((loss.detach().float(), {n: p.grad.float() for n, p in
                                                 model.named_parameters()}))
    try:
        assert varlen_calls and all(varlen_calls) and all(m is None for m in masks)
        (sdpa_loss, sdpa_grads), (fa4_loss, fa4_grads) = results
        torch.testing.assert_close(fa4_loss, sdpa_loss, rtol=1e-2, atol=0)
        for name, grad in sdpa_grads.items():
            assert torch.nn.functional.cosine_similarity(
                fa4_grads[name].flatten(), grad.flatten(), dim=0) > 0.99, name
    finally:
        monkeypatch.undo()
        attention.register.cache_clear()
        attention.register()


def test_fa4_with_packing_is_refused_only_where_a_layer_would_leave_the_kernel():
    packed = TrainConfig(attention="fa4", packing=True, mixed_precision="bf16")
    llama = ModelShape("llama", 32, 8, 14336, 131072, head_dim=128)
    assert config_problems(packed, world_size=1, local_world_size=1, shape=llama) == []
    for shape, what in ((ModelShape("mistral", 32, 8, 14336, 32768, "mistral", head_dim=128,
                                    windowed=True), "sliding windows"),
                        (ModelShape("gemma2", 8, 4, 9216, 8192, "gemma2", head_dim=128,
                                    soft_capped=True), "soft-capped")):
        (field, message), = config_problems(packed, world_size=1, local_world_size=1,
                                            shape=shape)
        assert field == "packing" and what in message and "sdpa" in message


def test_a_batch_moved_for_a_varlen_kernel_carries_the_documents_found_on_the_host():
    """Batch.to(varlen=True) finds the varlen bounds from the host's position ids: on a meta
    device, where packed_documents cannot run, the model still gets them (no device sync at the
    step). Moved to the CPU they are packed_documents'; replaced positions are not served stale
    bounds, and without varlen nothing is found."""
    import dataclasses

    from trainer.batch import Batch, packed_documents

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 5, 0, 1]])
    ids = torch.arange(16).view(2, 8)
    batch = Batch(ids, ids, 16, positions)
    on_meta = batch.to(torch.device("meta"), varlen=True).model_inputs(varlen=True)
    assert on_meta["cu_seq_lens_q"].device.type == "meta"
    with pytest.raises(NotImplementedError):  # what finding them there would meet
        packed_documents(positions.to("meta"))
    moved = batch.to(torch.device("cpu"), varlen=True)
    inputs = moved.model_inputs(varlen=True)
    assert inputs["cu_seq_lens_q"].tolist() == [0, 3, 5, 8, 14, 16]
    for key, value in packed_documents(positions).items():
        assert torch.equal(inputs[key], value) if isinstance(value, torch.Tensor) else (
            inputs[key] == value), key
    replaced = dataclasses.replace(moved, position_ids=torch.arange(8).repeat(2, 1))
    assert replaced.model_inputs(varlen=True)["cu_seq_lens_q"].tolist() == [0, 8, 16]
    assert batch.to(torch.device("cpu")).documents is None
    assert "cu_seq_lens_q" not in moved.model_inputs(varlen=False)


def test_fa4s_backward_asks_for_the_kernels_fixed_order_only_under_deterministic_algorithms():
    """torch.use_deterministic_algorithms(True) makes fa4's backward run the kernel's
    semaphore-ordered sums (bitwise repeatable; on the GPU: docs/trainer.md); otherwise the
    faster atomics. The caller's setting is read at each call."""
    from trainer.attention import backward_order

    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        assert backward_order() == {"deterministic": True}
        torch.use_deterministic_algorithms(False)
        assert backward_order() == {"deterministic": False}
    finally:
        torch.use_deterministic_algorithms(was)
