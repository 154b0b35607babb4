"""One unsharded rank trains without FSDP (trainer/master_weights.py), to FSDP's numbers."""

import gc
import weakref

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from finetune_contract.parallel_dims import ParallelDims
from trainer.batch import Batch
from trainer.blocks import decoder_blocks
from trainer.config import TrainConfig
from trainer.lora import apply_lora
from trainer.loss import add_loss_method
from trainer.master_weights import (
    ATTRIBUTE,
    GRAD_INTO_GEMM_ENV,
    GradIntoLinear,
    compute_weights,
    weight_grad_into,
)
from trainer.model import build_model, materialize_weights
from trainer.optim import build_optimizer, optimizer_step
from trainer.parallel import apply_parallelism
from trainer.train import evaluate, train_step

MODEL, SEQ, STEPS = "tiny-llama", 32, 4


def batches(vocab: int, count: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(7)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (2, SEQ), generator=generator)
        labels = ids.clone()
        labels[0, : SEQ // 2] = -100  # a prompt: no loss on its tokens
        out.append(Batch(ids, labels, ids.numel()))
    return out


def build(env, **options):
    config = TrainConfig(model=MODEL, seq_len=SEQ, lr=1e-2, warmup_steps=0, **options)
    model = build_model(MODEL)
    if config.lora_rank:
        apply_lora(model, config)
    apply_parallelism(model, config, env)
    materialize_weights(model, MODEL, config.seed, env.device)
    add_loss_method(model)
    return model, build_optimizer(model, config, env.device), config


def train(env, steps: int = STEPS, **options):
    """(losses, grad norms, eval loss, model) of `steps` steps of 2 micro batches each."""
    model, optimizer, config = build(env, **options)
    data = batches(model.config.vocab_size, 2 * steps + 2)
    losses, norms = [], []
    for step in range(steps):
        loss, _ = train_step(model, data[2 * step : 2 * step + 2], env)
        norm, _ = optimizer_step(model, optimizer, config.max_grad_norm)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
        norms.append(norm)
    return losses, norms, evaluate(model, data[-2:], env.device), model


@pytest.fixture
def fsdp_at_one_rank(monkeypatch):
    """FSDP at one rank, as every strategy ran there before master weights: the reference."""
    def train_with_fsdp(env, **options):
        with monkeypatch.context() as patch:
            patch.setattr(ParallelDims, "needs_fsdp", lambda self, cpu_offload: True)
            return train(env, **options)
    return train_with_fsdp


@pytest.mark.parametrize(("precision", "strategy"), [
    ("bf16", "SHARD_GRAD_OP"), ("fp16", "FULL_SHARD"),
    # the other two with the slow tests
    pytest.param("bf16", "FULL_SHARD", marks=pytest.mark.slow),
    pytest.param("fp16", "SHARD_GRAD_OP", marks=pytest.mark.slow)])
def test_one_unsharded_rank_trains_without_fsdp_to_the_losses_and_grad_norms_of_fsdp(
    world_of_one, fsdp_at_one_rank, precision, strategy
):
    plain = train(world_of_one, strategy=strategy, mixed_precision=precision)
    fsdp = fsdp_at_one_rank(world_of_one, strategy="FULL_SHARD", mixed_precision=precision)
    assert not isinstance(plain[3], FSDPModule) and isinstance(fsdp[3], FSDPModule)
    # Same numerics: compute copies in `precision`, gradients accumulated and stepped in fp32.
    assert plain[0] == pytest.approx(fsdp[0], rel=1e-6)
    assert plain[1] == pytest.approx(fsdp[1], rel=1e-5)
    assert plain[2] == pytest.approx(fsdp[2], rel=1e-6)
    # Between steps the parameters are the fp32 masters, as the optimizer and checkpoints see.
    assert {p.dtype for p in plain[3].parameters()} == {torch.float32}


def test_the_compute_copies_follow_every_optimizer_step(world_of_one):
    """Losses drift from FSDP's at once if a step's new masters never reach the copies."""
    model, optimizer, config = build(world_of_one, strategy="NO_SHARD", mixed_precision="bf16")
    head = model.get_output_embeddings().weight
    data = batches(model.config.vocab_size, 2)
    train_step(model, data, world_of_one)
    optimizer_step(model, optimizer, config.max_grad_norm)
    with compute_weights(model):
        assert head.dtype == torch.bfloat16
        copy = head.detach().clone()
    assert head.dtype == torch.float32
    torch.testing.assert_close(copy, head.detach().to(torch.bfloat16), rtol=0, atol=0)
    with torch.no_grad():  # as a checkpoint load writes the masters
        head.mul_(2)
    with compute_weights(model):
        torch.testing.assert_close(head.detach(), copy * 2, rtol=0, atol=0)


@pytest.mark.parametrize("grad_accum", [1, 2], ids=["cast-and-add", "in-the-gemm"])
def test_gradients_of_several_micro_batches_accumulate_in_fp32(world_of_one, grad_accum):
    model, _, _ = build(world_of_one, strategy="SHARD_GRAD_OP", mixed_precision="bf16",
                        grad_accum=grad_accum)
    linears = [m for m in model.modules() if isinstance(m, GradIntoLinear)]
    assert len(linears) == (7 * model.config.num_hidden_layers if grad_accum > 1 else 0)
    data = batches(model.config.vocab_size, 2)
    params = [p for p in model.parameters() if p.requires_grad]
    parts = []
    for batch in data:
        train_step(model, [batch], world_of_one)
        parts.append([p.grad.clone() for p in params])
        model.zero_grad(set_to_none=True)
    train_step(model, data, world_of_one)  # both micro batches, one global-batch normalisation
    for p, a, b in zip(params, *parts):
        assert p.grad.dtype == torch.float32
        # Each part was normalised by its own labelled tokens; both batches label the same count.
        torch.testing.assert_close(p.grad, (a + b) / 2, rtol=1e-6, atol=1e-9)


def test_backward_outside_compute_weights_is_an_error_not_a_silent_bf16_gradient(world_of_one):
    model, _, _ = build(world_of_one, strategy="SHARD_GRAD_OP", mixed_precision="bf16")
    batch = batches(model.config.vocab_size, 1)[0].to(world_of_one.device)
    with compute_weights(model):
        loss = model.causal_lm_loss_sum(batch.labels, input_ids=batch.input_ids)
    with pytest.raises(RuntimeError, match="outside compute_weights"):
        loss.backward()


def test_cpu_offload_and_fp32_at_one_rank_keep_their_own_paths(world_of_one):
    assert isinstance(build(world_of_one, strategy="FULL_SHARD", cpu_offload=True)[0], FSDPModule)
    assert isinstance(build(world_of_one, strategy="NO_SHARD", cpu_offload=True)[0], FSDPModule)
    model = build(world_of_one, strategy="SHARD_GRAD_OP", mixed_precision="fp32")[0]
    assert not isinstance(model, FSDPModule)
    with compute_weights(model):  # no copies: fp32 computes on the masters
        assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_model_with_master_weights_is_freed_when_dropped(world_of_one):
    """The gradient hooks live in autograd's C++ metadata: a strong reference from them to the
    model would keep it, its copies and its optimizer state alive for good (the benchmark's
    Hugging Face run after ours then ran out of GPU memory)."""
    *_, model = train(world_of_one, steps=1, strategy="SHARD_GRAD_OP", mixed_precision="bf16")
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("options", [{"strategy": "FULL_SHARD", "cpu_offload": True},
                                     {"strategy": "NO_SHARD", "cpu_offload": True}],
                         ids=["FULL_SHARD-cpu_offload", "NO_SHARD-cpu_offload"])
def test_an_optimizer_built_after_a_forward_without_backward_steps_every_weight(
    world_of_one, options
):
    """A forward with no backward (an eval; DPO's precomputed reference pass) leaves FSDP's root
    holding its unsharded weights: an optimizer built then stepped copies, and the embeddings,
    final norm and head never trained (dpo_reference precompute's losses drifted from step 2)."""
    config = TrainConfig(model=MODEL, seq_len=SEQ, lr=1e-2, warmup_steps=0, **options)
    model = build_model(MODEL)
    apply_parallelism(model, config, world_of_one)
    materialize_weights(model, MODEL, config.seed, torch.device("cpu"))
    add_loss_method(model)
    data = batches(model.config.vocab_size, 2)
    evaluate(model, data[:1], world_of_one.device)
    optimizer = build_optimizer(model, config, world_of_one.device)
    before = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    train_step(model, data[1:], world_of_one)
    optimizer_step(model, optimizer, config.max_grad_norm)
    unchanged = [name for name, p in model.named_parameters()
                 if torch.equal(p.full_tensor(), before[name])]
    assert unchanged == []


def test_a_frozen_base_keeps_only_its_compute_copy_and_trains_to_the_losses_of_fsdp(
    world_of_one, fsdp_at_one_rank
):
    """LoRA at one rank: the frozen weights are bf16 alone (no fp32 master: 4 bytes a parameter
    saved), the adapters fp32 masters; the same losses, grad
    norms and eval loss as FSDP's LoRA, which keeps fp32 shards of everything."""
    lora = {"lora_rank": 4, "lora_alpha": 8, "mixed_precision": "bf16"}
    plain = train(world_of_one, strategy="SHARD_GRAD_OP", **lora)
    fsdp = fsdp_at_one_rank(world_of_one, strategy="FULL_SHARD", **lora)
    assert plain[0] == pytest.approx(fsdp[0], rel=1e-6)
    assert plain[1] == pytest.approx(fsdp[1], rel=1e-5)
    assert plain[2] == pytest.approx(fsdp[2], rel=1e-6)
    dtypes = {(p.requires_grad, p.dtype) for p in plain[3].parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}


@pytest.mark.parametrize(("compile", "lora"), [
    (False, {}), pytest.param(True, {}, marks=pytest.mark.slow),
    pytest.param(True, {"lora_rank": 4, "lora_alpha": 8}, marks=pytest.mark.slow)],
    ids=["eager", "compiled", "compiled-lora"])
def test_micro_batches_accumulated_in_the_gemm_train_to_the_losses_of_the_cast_and_add(
    world_of_one, monkeypatch, compile, lora
):
    """grad_accum > 1 at one rank: each block Linear's weight-gradient GEMM adds into the fp32
    gradient (compiled: the op called in place from the block's backward). Its sums are of
    fp32 products where the cast-and-add rounds each product to bf16 first: the same training
    within that rounding, and nothing left in bf16."""
    monkeypatch.setenv("TRAINER_COMPILE_BACKEND", "aot_eager")
    options = {"strategy": "SHARD_GRAD_OP", "mixed_precision": "bf16", "grad_accum": 2,
               "compile": compile, **lora}
    fused = train(world_of_one, **options)
    torch._dynamo.reset()  # the blocks' compiled variants are per model: not two models' worth
    monkeypatch.setenv(GRAD_INTO_GEMM_ENV, "0")
    cast = train(world_of_one, **options)
    assert any(isinstance(m, GradIntoLinear) for m in fused[3].modules())
    assert not any(isinstance(m, GradIntoLinear) for m in cast[3].modules())
    assert fused[0] == pytest.approx(cast[0], rel=2e-3)
    assert fused[1] == pytest.approx(cast[1], rel=2e-2)
    assert fused[2] == pytest.approx(cast[2], rel=2e-3)
    assert {p.dtype for p in fused[3].parameters() if p.requires_grad} == {torch.float32}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fp32-output GEMM runs on CUDA")
def test_the_weight_gradient_gemm_adds_into_the_fp32_gradient_in_place_on_cuda():
    """cuBLAS with beta 1 and an fp32 output: the gradient's own memory, the fp32 sum of the
    bf16 inputs' exact products (no bf16 rounding of the product, as the cast-and-add has)."""
    generator = torch.Generator("cuda").manual_seed(0)
    dy, x = (torch.randn(2, 2048, n, device="cuda", generator=generator).to(torch.bfloat16)
             for n in (1024, 512))
    grad = torch.randn(1024, 512, device="cuda", generator=generator)
    start, pointer = grad.clone(), grad.data_ptr()
    weight_grad_into(grad, dy, x)
    exact = start.double() + dy.flatten(0, 1).double().t() @ x.flatten(0, 1).double()
    cast = start + (dy.flatten(0, 1).t() @ x.flatten(0, 1)).float()
    assert grad.data_ptr() == pointer
    error = ((grad.double() - exact).norm() / exact.norm()).item()
    assert error < 1e-5 < ((cast.double() - exact).norm() / exact.norm()).item()


def _offloaded_and_plain(env, monkeypatch, **options):
    monkeypatch.setenv("TRAINER_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr("trainer.parallel.MLP_TILE_TOKENS", 24)  # 64 tokens: 3 slices
    setup = {"strategy": "SHARD_GRAD_OP", "activation_checkpointing": "full", **options}
    return train(env, activation_offload=True, **setup), train(env, **setup)


@pytest.mark.slow  # compiled: 17 s; the bf16 test below runs the offloaded blocks eagerly
def test_offloaded_blocks_train_to_the_losses_of_full_checkpointing(world_of_one, monkeypatch):
    """activation_offload with full checkpointing (trainer/offload.py: block inputs in CPU
    memory, MLPs in 3 slices, each block part compiled) on one rank: in fp32 the losses, grad
    norms and eval loss of full checkpointing."""
    offloaded, plain = _offloaded_and_plain(world_of_one, monkeypatch, mixed_precision="fp32",
                                            lora_rank=4, compile=True)
    for mine, theirs in zip(offloaded[:3], plain[:3], strict=True):
        assert mine == pytest.approx(theirs, rel=1e-5)


def test_offloaded_blocks_in_bf16_give_the_gradients_of_full_checkpointing(world_of_one,
                                                                           monkeypatch):
    """bf16 compute on fp32 masters, a full fine-tune whose weight gradients land in the GEMM
    (grad_accum 2: GradIntoLinear): one step's fp32 gradients equal to the fp32 sums' order
    (the tiles add the slices' GEMMs; 1e-7 here). Later steps part as any two bf16 runs whose
    masters differ in the last bits."""
    monkeypatch.setattr("trainer.parallel.MLP_TILE_TOKENS", 24)  # 64 tokens: 3 slices
    grads = []
    for offload in (True, False):
        model, _, _ = build(world_of_one, strategy="SHARD_GRAD_OP", mixed_precision="bf16",
                            activation_checkpointing="full", grad_accum=2,
                            activation_offload=offload)
        assert any(isinstance(m, GradIntoLinear) for m in model.modules())
        train_step(model, batches(model.config.vocab_size, 2), world_of_one)
        grads.append({n.replace("_checkpoint_wrapped_module.", ""): p.grad
                      for n, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    for name, grad in grads[1].items():
        assert grads[0][name].dtype == torch.float32
        torch.testing.assert_close(grads[0][name], grad, rtol=1e-5, atol=1e-8, msg=name)


def test_a_lora_runs_frozen_base_is_made_in_the_compute_dtype_and_never_held_in_fp32(world_of_one):
    """The frozen weights are allocated in bf16 (no fp32 copy at any time, the first step's
    included: 8B LoRA's start peak), the adapters as fp32 masters; the losses are those of FSDP's
    (the test above)."""
    model, _, _ = build(world_of_one, strategy="SHARD_GRAD_OP", mixed_precision="bf16",
                        lora_rank=4)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    trained = {p.dtype for p in model.parameters() if p.requires_grad}
    assert ({p.dtype for p in frozen}, trained) == ({torch.bfloat16}, {torch.float32})
    pointers = [p.data_ptr() for p in frozen]
    train_step(model, batches(model.config.vocab_size, 2), world_of_one)
    # the compute read the frozen weights where they were made: no copy was allocated
    assert [p.data_ptr() for p in frozen] == pointers


def _block_copy_bytes(model) -> list[int]:
    """Per decoder block, the bytes its trained weights' compute copies hold now."""
    master_weights = getattr(model, ATTRIBUTE)
    return [sum(master_weights.copies[i].untyped_storage().nbytes() for i in indices)
            for indices in master_weights.block_params]


RESHARD_MODES = {
    "no-checkpointing": {},
    "full-checkpointing": {"activation_checkpointing": "full"},
    # the fast tier keeps four modes; these two run with the slow tests
    "selective-per-op": pytest.param({"activation_checkpointing": "selective",
                                      "selective_ac": "op"}, marks=pytest.mark.slow),
    "offloaded": {"activation_checkpointing": "full", "activation_offload": True},
    "in-the-gemm": {"grad_accum": 2},
    "lora": pytest.param({"lora_rank": 4, "lora_alpha": 8}, marks=pytest.mark.slow),
    "compiled-full": pytest.param({"activation_checkpointing": "full", "compile": True},
                                  marks=pytest.mark.slow),
}


@pytest.mark.parametrize("mode", RESHARD_MODES.values(), ids=RESHARD_MODES.keys())
def test_full_shard_at_one_rank_holds_a_blocks_copies_only_while_it_runs_to_the_same_losses(
    world_of_one, monkeypatch, mode
):
    """FULL_SHARD on one process: no FSDP, each block's compute copies made before its forward,
    freed after it, made again when backward reaches it and freed when backward leaves it. At
    no point of a step do more than two blocks hold copies (one in the middle of forward, two
    where backward passes from one block to the next), none between steps; and the numbers are
    those of keeping every copy (SHARD_GRAD_OP), exactly: the copies are the same casts."""
    monkeypatch.setenv("TRAINER_COMPILE_BACKEND", "aot_eager")
    options = {"mixed_precision": "bf16", **mode}
    kept = train(world_of_one, **options, strategy="SHARD_GRAD_OP")
    model, optimizer, config = build(world_of_one, **options, strategy="FULL_SHARD")
    assert not isinstance(model, FSDPModule)
    seen: list[int] = []

    def count(*_):
        made = [n for n in _block_copy_bytes(model) if n]
        seen.append(len(made))

    for block in decoder_blocks(model):
        block.register_forward_pre_hook(count)
        block.register_forward_hook(count)
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(count)
    data = batches(model.config.vocab_size, 2 * STEPS + 2)
    losses, norms = [], []
    for step in range(STEPS):
        loss, _ = train_step(model, data[2 * step : 2 * step + 2], world_of_one)
        assert sum(_block_copy_bytes(model)) == 0  # none between steps
        norm, _ = optimizer_step(model, optimizer, config.max_grad_norm)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss)
        norms.append(norm)
    assert (losses, norms) == (kept[0], kept[1])
    assert evaluate(model, data[-2:], world_of_one.device) == kept[2]
    assert seen and max(seen) <= 2
    assert 1 in seen  # a block alone in forward


def test_a_failure_entering_compute_weights_puts_the_fp32_masters_back(world_of_one, monkeypatch):
    """The fused GEMMs' fp32 gradients are allocated on entry (the first micro batch): if that
    runs out of memory, the parameters are the fp32 masters again, none left as a freed copy."""
    model, _, _ = build(world_of_one, strategy="FULL_SHARD", mixed_precision="bf16",
                        grad_accum=2)
    masters = [p.data for p in model.parameters()]

    def out_of_memory(*_, **__):
        raise torch.OutOfMemoryError("no memory for the fused gradients")

    monkeypatch.setattr("trainer.master_weights.torch.zeros_like", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError), compute_weights(model):
        pass
    assert [p.data.data_ptr() for p in model.parameters()] == [m.data_ptr() for m in masters]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
