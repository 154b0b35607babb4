"""float8 (torchao): refused where it cannot run; trains a tiny model (emulated on CPU, real on a
GPU of compute capability FLOAT8_MIN_CAPABILITY or later)."""

import pytest
import torch
from transformers import AutoTokenizer

from finetune_contract.data import PROMPT_TEMPLATE
from finetune_contract.fields import FLOAT8_MIN_CAPABILITY, ContractError, capability_text
from finetune_contract.rules import float8_reads_masters
from trainer.config import load_config
from trainer.demo import DEMO_TOKENIZER
from trainer.float8 import EMULATE_ENV
from trainer.master_weights import FLOAT8_MASTERS_ENV, compute_weights
from trainer.model import build_model, materialize_weights
from trainer.optim import build_optimizer, optimizer_step
from trainer.parallel import DistEnv, apply_parallelism, check_start

HAS_FLOAT8_GPU = (torch.cuda.is_available()
                  and torch.cuda.get_device_capability() >= FLOAT8_MIN_CAPABILITY)
NEEDED = capability_text(FLOAT8_MIN_CAPABILITY)


CPU_PROCESS = DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1,
                      device=torch.device("cpu"))


def test_float8_on_a_cpu_fails_at_start_naming_the_option(monkeypatch):
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    config = load_config(None, {"float8": True, "mixed_precision": "bf16"})
    with pytest.raises(ContractError, match=f"float8: .*{NEEDED} or later.*no CUDA GPU: set "
                       "float8 to false"):
        check_start(config, CPU_PROCESS)


def test_the_benchmark_refuses_float8_on_a_cpu_before_it_builds_the_model(monkeypatch):
    import bench.train

    monkeypatch.delenv(EMULATE_ENV, raising=False)
    monkeypatch.setattr(bench.train, "build_bench_model", lambda *_: pytest.fail("model built"))
    args = bench.train.parse_args(["--models", "tiny", "--float8", "--seq-len", "64"])
    with pytest.raises(ContractError, match="float8: .*no CUDA GPU: set float8 to false"):
        bench.train.run_trainer("tiny-llama", args, CPU_PROCESS, None)


def test_emulated_float8_starts_on_a_cpu(monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "1")  # the tests' stand-in for float8 tensor cores
    check_start(load_config(None, {"float8": True, "mixed_precision": "bf16"}), CPU_PROCESS)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("mode", [
    "emulated",
    pytest.param("cuda", marks=pytest.mark.skipif(
        not HAS_FLOAT8_GPU, reason=f"needs a GPU of compute capability {NEEDED} or later")),
])  # fmt: skip
def test_a_tiny_model_trains_with_float8_linear_layers_in_its_blocks(
    mode, recipe, world_of_one, monkeypatch
):
    if mode == "emulated":
        if world_of_one.device.type == "cuda":
            pytest.skip("emulation is the CPU stand-in")
        monkeypatch.setenv(EMULATE_ENV, "1")  # torchao's float8 casts, matmuls in bf16
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    config = load_config(None, {"float8": True, "float8_recipe": recipe,
                                "mixed_precision": "bf16", "lr": 3e-3})
    check_start(config, world_of_one)
    model = build_model(config.model, tokenizer)
    apply_parallelism(model, config, world_of_one)
    materialize_weights(model, config.model, config.seed, world_of_one.device)
    kinds = {name.rsplit(".", 1)[-1]: type(m).__name__ for name, m in model.named_modules()}
    assert kinds["q_proj"] == kinds["down_proj"] == "Float8Linear"
    assert kinds["lm_head"] == "Linear"  # the head and embeddings stay bf16
    q_proj = next(m for n, m in model.named_modules() if n.endswith("q_proj"))
    granularity = q_proj.config.cast_config_input.scaling_granularity.name
    assert granularity == ("TENSORWISE" if recipe == "tensorwise" else "AXISWISE")
    optimizer = build_optimizer(model, config, world_of_one.device)
    text = PROMPT_TEMPLATE.format(prompt="Repeat owl 3 times.") + " owl owl owl"
    input_ids = tokenizer(text, return_tensors="pt")["input_ids"].to(world_of_one.device)
    losses = []
    for _ in range(8):
        with compute_weights(model):  # one process: bf16 copies of fp32 masters
            loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
        optimizer_step(model, optimizer, config.max_grad_norm)
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.5, losses


def _float8_losses(world_of_one, monkeypatch, from_masters: bool, grad_accum: int,
                   strategy: str = "SHARD_GRAD_OP", recipe: str = "tensorwise"
                   ) -> tuple[list[float], dict[str, torch.dtype], set[torch.dtype],
                              dict[str, torch.Tensor]]:
    """Three steps of emulated float8 on the tiny model; the losses, the dtypes the block
    weights hold inside compute_weights, those of the gradients the masters got, and the
    masters' gradients of the first step (its micro-batches accumulated)."""
    monkeypatch.setenv(EMULATE_ENV, "1")
    monkeypatch.setenv(FLOAT8_MASTERS_ENV, "1" if from_masters else "0")
    config = load_config(None, {"float8": True, "float8_recipe": recipe,
                                "mixed_precision": "bf16", "lr": 1e-3,
                                "grad_accum": grad_accum, "strategy": strategy})
    model = build_model(config.model)
    apply_parallelism(model, config, world_of_one)
    materialize_weights(model, config.model, config.seed, world_of_one.device, random_init=True)
    optimizer = build_optimizer(model, config, world_of_one.device)
    generator = torch.Generator().manual_seed(7)
    losses, held, grads, first = [], {}, set(), {}
    for _ in range(3):
        for _ in range(grad_accum):
            ids = torch.randint(0, model.config.vocab_size, (2, 32), generator=generator)
            with compute_weights(model):
                held = {n.rsplit(".", 2)[-2]: p.dtype for n, p in model.named_parameters()
                        if ".layers.0." in n}
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
            losses.append(loss.item())
        grads |= {p.grad.dtype for p in model.parameters() if p.grad is not None}
        first = first or {n: p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None}
        optimizer_step(model, optimizer, config.max_grad_norm)
        optimizer.zero_grad(set_to_none=True)
    return losses, held, grads, first


@pytest.mark.parametrize("grad_accum,recipe,strategy,reads", [
    (1, "tensorwise", "SHARD_GRAD_OP", True), (2, "tensorwise", "SHARD_GRAD_OP", False),
    (2, "rowwise", "SHARD_GRAD_OP", True),  # accumulated: rowwise alone reads its masters
    (2, "rowwise", "FULL_SHARD", True),
    (1, "tensorwise", "FULL_SHARD", True),  # one process: each block's copies made and freed
])  # fmt: skip
def test_float8_linears_cast_their_fp32_masters_where_the_rule_says_with_the_same_losses(
    grad_accum, recipe, strategy, reads, world_of_one, monkeypatch
):
    """One process with master weights: where rules.float8_reads_masters says so (no
    micro-batches accumulated, or rowwise), a float8 Linear's weight is cast to float8 from its
    fp32 master (no bf16 copy, as torchtitan's float8 reads its fp32 weights), the block's other
    weights from their bf16 copies; otherwise from bf16 copies. The gradients reach the masters
    in fp32 either way, and the losses are those of the bf16 copies (TRAINER_FLOAT8_MASTERS=0)
    but for float8's rounding."""
    if world_of_one.device.type == "cuda":
        pytest.skip("emulation is the CPU stand-in")
    assert float8_reads_masters(load_config(None, {
        "float8": True, "float8_recipe": recipe, "grad_accum": grad_accum})) == reads
    losses, held, grads, first = _float8_losses(world_of_one, monkeypatch, True, grad_accum,
                                                strategy, recipe)
    copies, held_copies, _, first_copies = _float8_losses(world_of_one, monkeypatch, False,
                                                          grad_accum, strategy, recipe)
    weight = torch.float32 if reads else torch.bfloat16
    assert held["q_proj"] == held["down_proj"] == weight
    assert held["input_layernorm"] == torch.bfloat16  # not float8: its bf16 copy
    assert held_copies["q_proj"] == torch.bfloat16
    assert grads == {torch.float32}
    assert first.keys() == first_copies.keys() and any("q_proj" in n for n in first)
    if reads:
        # Every micro-batch's gradient summed into each master: the same direction and size as
        # the copies' but for float8's rounding (seen here: cosine 0.98 or more, the norm within
        # 3%; one micro-batch's gradient kept in place of the sum gave 0.6-0.7 for both).
        for name, grad in first.items():
            other = first_copies[name]
            cosine = torch.nn.functional.cosine_similarity(grad.flatten(), other.flatten(), dim=0)
            size = grad.norm() / other.norm()
            assert cosine > 0.95 and 0.9 < size < 1.1, (name, cosine.item(), size.item())
        assert losses == pytest.approx(copies, rel=2e-3)
        assert losses != copies  # the casts differ in rounding: the two settings really ran
    else:
        assert losses == copies
        assert all(torch.equal(first[n], first_copies[n]) for n in first)
