"""The chunked head + cross entropy equals the plain loss over whole logits: values, gradients."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from trainer.config import load_config
from trainer.loss import LOSS_METHOD, add_loss_method, causal_lm_loss_sum, linear_cross_entropy_sum
from trainer.model import build_model, materialize_weights
from trainer.parallel import apply_parallelism


def plain_loss_and_grads(hidden, weight, labels):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = F.cross_entropy((hidden @ weight.T).float(), labels, reduction="sum")
    (loss * 0.5).backward()
    return loss.detach(), hidden.grad, weight.grad


def chunked_loss_and_grads(hidden, weight, labels, chunk_tokens):
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = linear_cross_entropy_sum(hidden, weight, labels, chunk_tokens=chunk_tokens)
    (loss * 0.5).backward()
    return loss.detach(), hidden.grad, weight.grad


def random_problem(dtype, tokens=37, hidden=16, vocab=101):
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=generator).to(dtype)
    w = torch.randn(vocab, hidden, generator=generator).to(dtype)
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[::5] = -100  # ignored positions (prompt, padding)
    return h, w, labels


@pytest.mark.parametrize("chunk_tokens", [1, 8, 37, 1000])
def test_chunked_loss_and_gradients_equal_the_plain_cross_entropy(chunk_tokens):
    h, w, labels = random_problem(torch.float64)
    expected = plain_loss_and_grads(h, w, labels)
    actual = chunked_loss_and_grads(h, w, labels, chunk_tokens)
    assert actual[0].dtype == torch.float32
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a.double(), e.double(), rtol=1e-5, atol=1e-6)


def test_chunked_bf16_loss_matches_the_plain_loss_on_bf16_logits_upcast_to_fp32():
    h, w, labels = random_problem(torch.bfloat16, tokens=64, hidden=32, vocab=300)
    expected = plain_loss_and_grads(h, w, labels)
    actual = chunked_loss_and_grads(h, w, labels, chunk_tokens=16)
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-3, atol=0)
    for a, e in zip(actual[1:], expected[1:], strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), e.float(), rtol=2e-2, atol=2e-2)


def test_without_gradients_the_loss_is_the_same():
    h, w, labels = random_problem(torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy_sum(h, w, labels, chunk_tokens=8)
    torch.testing.assert_close(loss, plain_loss_and_grads(h, w, labels)[0])


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_a_frozen_input_gets_no_gradient_computed_so_a_frozen_head_costs_no_gemm(frozen):
    """LoRA's head is frozen: backward needs only the hidden states' gradient, so the chunked
    loss runs two GEMMs per chunk (logits, their gradient into the hidden states), not three,
    and the other gradient still equals the plain loss's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Gemms(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm,
                                       torch.ops.aten.addmm_, torch.ops.aten.matmul):
                Gemms.calls += 1
            return func(*args, **(kwargs or {}))

    h, w, labels = random_problem(torch.float64)
    _, grad_h, grad_w = plain_loss_and_grads(h, w, labels)
    h = h.clone().requires_grad_(frozen != "hidden")
    w = w.clone().requires_grad_(frozen != "weight")
    with Gemms():
        (linear_cross_entropy_sum(h, w, labels, chunk_tokens=8) * 0.5).backward()
    assert Gemms.calls == 2 * -(-h.shape[0] // 8)  # two per chunk
    trained, expected = (h, grad_h) if frozen == "weight" else (w, grad_w)
    torch.testing.assert_close(trained.grad, expected, rtol=1e-5, atol=1e-6)
    assert (w if frozen == "weight" else h).grad is None


def test_without_grad_mode_the_loss_runs_one_gemm_a_chunk_even_on_trained_inputs():
    """Evaluation and DPO's reference scoring run under no_grad on weights that train: no
    gradient buffers, no gradient GEMMs (a Function's needs_input_grad ignores the mode)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Gemms(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm,
                                       torch.ops.aten.addmm_):
                Gemms.calls += 1
            return func(*args, **(kwargs or {}))

    h, w, labels = random_problem(torch.float32)
    h, w = h.requires_grad_(), w.requires_grad_()
    with torch.no_grad(), Gemms():
        loss = linear_cross_entropy_sum(h, w, labels, chunk_tokens=8)
    assert Gemms.calls == -(-h.shape[0] // 8)
    torch.testing.assert_close(loss, plain_loss_and_grads(h, w, labels)[0])


def test_offloaded_blocks_take_a_quarter_of_the_loss_chunk_which_the_trainer_and_planner_share():
    from finetune_contract.rules import loss_chunk_tokens
    from finetune_contract.throughput import LOGITS_PER_CHUNK

    plain = load_config(None, {"activation_checkpointing": "full"})
    offloaded = load_config(None, {"activation_checkpointing": "full", "activation_offload": True})
    assert loss_chunk_tokens(plain, 128_256) == LOGITS_PER_CHUNK // 128_256 == 4185
    assert loss_chunk_tokens(offloaded, 128_256) == LOGITS_PER_CHUNK // 4 // 128_256 == 1046
    model = tiny_model()
    add_loss_method(model, chunk_tokens=7)
    assert getattr(model, LOSS_METHOD).keywords == {"chunk_tokens": 7}


def tiny_model(env=None, **overrides):
    config = load_config(None, overrides)
    model = build_model(config.model)
    if env is not None:
        apply_parallelism(model, config, env)
    materialize_weights(model, config.model, config.seed, torch.device("cpu"))
    return model


def batch(vocab: int):
    input_ids = torch.randint(0, vocab, (3, 20), generator=torch.Generator().manual_seed(1))
    labels = input_ids.clone()
    labels[:, :6] = -100  # the prompt carries no loss
    return input_ids, labels


def plain_model_loss(model, input_ids, labels):
    logits = model(input_ids=input_ids, use_cache=False).logits
    flat = logits[:, :-1].flatten(0, 1).float()
    return F.cross_entropy(flat, labels[:, 1:].flatten(), reduction="sum")


def test_the_causal_lm_loss_equals_the_models_own_logits_loss_and_gradients():
    model = tiny_model()
    input_ids, labels = batch(model.config.vocab_size)
    plain = plain_model_loss(model, input_ids, labels)
    plain.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    chunked = causal_lm_loss_sum(model, labels, chunk_tokens=7, input_ids=input_ids)
    chunked.backward()
    torch.testing.assert_close(chunked, plain)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-4, atol=1e-5)


def test_the_loss_method_of_a_sharded_model_gathers_its_weights_like_a_forward(world_of_one):
    plain, sharded = tiny_model(), tiny_model(world_of_one, cpu_offload=True)  # FSDP at one rank
    add_loss_method(sharded)
    input_ids, labels = batch(plain.config.vocab_size)
    expected = plain_model_loss(plain, input_ids, labels)
    expected.backward()
    for _ in range(2):  # the second call runs on FSDP's state after a whole step
        sharded.zero_grad()
        actual = getattr(sharded, LOSS_METHOD)(labels, input_ids=input_ids)
        actual.backward()
        torch.testing.assert_close(actual, expected)
    grads = dict(sharded.named_parameters())
    for name, param in plain.named_parameters():
        grad = grads[name].grad
        assert isinstance(grad, DTensor)  # reduced into the shard by FSDP's backward hooks
        torch.testing.assert_close(grad.full_tensor(), param.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled chunk loss runs on CUDA")
def test_on_cuda_the_compiled_chunked_loss_matches_the_plain_loss_in_less_memory():
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    tokens, hidden, vocab = 8192, 2048, 128256  # llama-1b's head, micro batch 2 of 4096
    h = torch.randn(tokens, hidden, device=device, generator=generator).bfloat16()
    w = (torch.randn(vocab, hidden, device=device, generator=generator) * 0.02).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    labels[:100] = -100

    def measured(loss_fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = loss_fn(h, w, labels)
        torch.cuda.synchronize()
        return result, torch.cuda.max_memory_allocated() - before

    (plain, plain_memory) = measured(plain_loss_and_grads)
    chunked_fn = functools.partial(chunked_loss_and_grads, chunk_tokens=None)
    chunked_loss_and_grads(h, w, labels, chunk_tokens=None)  # compile first
    (chunked, chunked_memory) = measured(chunked_fn)
    torch.testing.assert_close(chunked[0], plain[0], rtol=1e-4, atol=0)
    for a, e in zip(chunked[1:], plain[1:], strict=True):
        assert (a.float() - e.float()).norm() / e.float().norm() < 1e-2
    assert chunked_memory < plain_memory / 2


@pytest.mark.parametrize("chunk_tokens", [8, 1000])
def test_a_soft_capped_head_gives_the_loss_and_gradients_of_the_capped_logits(chunk_tokens):
    """Gemma 2/3's final_logit_softcapping: cap x tanh(logits / cap) before the cross entropy."""
    h, w, labels = random_problem(torch.float32)
    cap = 2.0
    hidden, weight = h.detach().requires_grad_(), w.detach().requires_grad_()
    expected = F.cross_entropy(cap * torch.tanh((hidden @ weight.T) / cap), labels,
                               reduction="sum")
    expected.backward()
    chunked_h, chunked_w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = linear_cross_entropy_sum(chunked_h, chunked_w, labels, chunk_tokens=chunk_tokens,
                                    cap=cap)
    loss.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(chunked_h.grad, hidden.grad)
    torch.testing.assert_close(chunked_w.grad, weight.grad)
    assert not torch.isclose(loss, linear_cross_entropy_sum(h, w, labels))  # the cap mattered
