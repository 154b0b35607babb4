"""QLoRA (`quantize_base: nf4`): the frozen block Linears in 4-bit NF4 under LoRA adapters.

A real run needs a GPU (refused elsewhere, naming the field); torchao's NF4 is plain torch code,
so these tests run it on the CPU with TRAINER_NF4_ON_CPU=1, the switch the trainer keeps for that.
"""

import functools
import json

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks
from torchao.quantization import NF4Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune_contract.data import PROMPT_TEMPLATE
from finetune_contract.fields import ContractError
from tests.support.training import demo_rows, lm_step, torchrun, write_jsonl
from trainer.checkpoint import Checkpointer
from trainer.config import load_config
from trainer.demo import DEMO_TOKENIZER
from trainer.export import export_hf
from trainer.lora import apply_lora
from trainer.master_weights import compute_weights
from trainer.model import build_model, materialize_weights
from trainer.optim import build_optimizer
from trainer.parallel import QUANTIZE_ON_CPU_ENV, apply_parallelism, check_start, quantize_dtype
from trainer.qlora import dequantized, quantized_weight_fqns

PROMPT = PROMPT_TEMPLATE.format(prompt="Which month comes after May?")


def qlora_model(env, tokenizer, seed, quantize_base="nf4", **options):
    config = load_config(None, {"lora_rank": 4, "seed": seed, "mixed_precision": "bf16",
                                "quantize_base": quantize_base, **options})
    model = build_model(config.model, tokenizer)
    apply_lora(model, config)
    apply_parallelism(model, config, env)
    materialize_weights(model, config.model, config.seed, env.device, quantize_dtype(config))
    return model, build_optimizer(model, config, env.device)


@pytest.fixture
def nf4_on_cpu(monkeypatch):
    monkeypatch.setenv(QUANTIZE_ON_CPU_ENV, "1")


def test_the_frozen_block_linears_are_nf4_of_the_unquantized_models_weights(
    world_of_one, nf4_on_cpu
):
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    quantized, _ = qlora_model(world_of_one, tokenizer, seed=3)
    plain, _ = qlora_model(world_of_one, tokenizer, seed=3, quantize_base="none")
    fqns = quantized_weight_fqns(quantized)
    # Every Linear of every block: 7 projections per block, the adapters not among them.
    assert len(fqns) == 7 * quantized.config.num_hidden_layers
    params = dict(quantized.named_parameters())
    plain_params = dict(plain.named_parameters())
    for fqn in fqns:
        assert isinstance(params[fqn].data, NF4Tensor) and not params[fqn].requires_grad
        # The same draw as the unquantized model's, within NF4's error (absmax/8 per block).
        original = plain_params[fqn].detach().to(torch.bfloat16)
        error = (dequantized(params[fqn]).float() - original.float()).abs().max()
        assert 0 < error < original.abs().max() / 4
    # Nothing else is quantized: embeddings, norms, head and adapters keep their dtype.
    others = [p for n, p in quantized.named_parameters() if n not in fqns]
    assert others and not any(isinstance(p.data, NF4Tensor) for p in others)


def keep(saved: list[torch.Tensor], tensor: torch.Tensor) -> torch.Tensor:
    saved.append(tensor)
    return tensor


@pytest.mark.parametrize(("compile", "checkpointing", "selective_ac", "lora_dropout"), [
    (False, "none", "op", 0.0), pytest.param(True, "none", "op", 0.0, marks=pytest.mark.slow),
    pytest.param(True, "none", "op", 0.1, marks=pytest.mark.slow),
    pytest.param(True, "selective", "op", 0.0, marks=pytest.mark.slow),
    pytest.param(True, "selective", "2", 0.0, marks=pytest.mark.slow),
    pytest.param(True, "full", "op", 0.0, marks=pytest.mark.slow)])
def test_a_qlora_forward_keeps_no_dequantized_weight_for_backward(
    world_of_one, nf4_on_cpu, monkeypatch, compile, checkpointing, selective_ac, lora_dropout
):
    """Backward dequantizes each 4-bit weight again: a forward keeps none of the dequantized
    ones (bf16, 4x the 4-bit one; 13 GiB at 8B), in any checkpointing mode, with dropout too.
    Compiled, the partitioner would merge the two dequantizations and keep the bf16 weight of
    every block not checkpointed (trainer/lora.py's `_base_weight` says how that is stopped)."""
    monkeypatch.setenv("TRAINER_COMPILE_BACKEND", "aot_eager")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    input_ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    model, _ = qlora_model(world_of_one, tokenizer, seed=2, strategy="SHARD_GRAD_OP",
                           compile=compile, activation_checkpointing=checkpointing,
                           selective_ac=selective_ac, lora_dropout=lora_dropout)
    weights = [tuple(model.get_parameter(fqn).shape) for fqn in quantized_weight_fqns(model)]
    saved: list[torch.Tensor] = []
    with compute_weights(model), saved_tensors_hooks(functools.partial(keep, saved),
                                                     lambda t: t):
        model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
    dequantized = [t for t in saved if tuple(t.shape) in weights
                   and t.dtype == torch.bfloat16 and not isinstance(t, NF4Tensor)]
    assert saved and not dequantized
    assert any(p.grad is not None for p in model.parameters())


@pytest.mark.slow
def test_qlora_trains_only_adapters_resumes_exactly_and_exports_the_dequantized_merge(
    world_of_one, nf4_on_cpu, tmp_path
):
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    model, optimizer = qlora_model(world_of_one, tokenizer, seed=1)
    input_ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]

    def step(model, optimizer) -> float:
        return lm_step(model, optimizer, input_ids)

    first = step(model, optimizer)
    for _ in range(3):
        last = step(model, optimizer)
    assert last < first  # the adapters learn through the 4-bit base
    checkpointer = Checkpointer(str(tmp_path / "run"), keep=1, rank=world_of_one.rank)
    path = checkpointer.save(4, model, optimizer, {})
    expected_loss = step(model, optimizer)
    resumed, resumed_optimizer = qlora_model(world_of_one, tokenizer, seed=1)
    checkpointer.load(path, resumed, resumed_optimizer)
    assert step(resumed, resumed_optimizer) == pytest.approx(expected_loss, rel=1e-6)

    export_hf(model, model.config, tokenizer, tmp_path / "model", world_of_one.rank,
              torch.float32)
    with torch.no_grad():
        expected = model.eval()(input_ids=input_ids).logits.float()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    with torch.no_grad():
        actual = exported(input_ids=input_ids).logits
    # The merge is of the dequantized base, in fp32; the run computes in bf16.
    torch.testing.assert_close(actual, expected, rtol=0.05, atol=0.05)


def test_quantize_base_is_refused_on_a_cpu_and_without_lora_naming_the_field(
    world_of_one, monkeypatch
):
    with pytest.raises(ContractError, match="quantize_base: nf4 needs CUDA GPUs"):
        check_start(load_config(None, {"lora_rank": 4, "quantize_base": "nf4"}), world_of_one)
    monkeypatch.setenv(QUANTIZE_ON_CPU_ENV, "1")
    with pytest.raises(ContractError, match="quantize_base: nf4 quantizes .* lora_rank is 0"):
        check_start(load_config(None, {"quantize_base": "nf4"}), world_of_one)


@pytest.mark.slow
def test_a_two_process_qlora_run_learns_checkpoints_resumes_and_exports(tmp_path, nf4_on_cpu):
    dataset = write_jsonl(tmp_path / "rows.jsonl", demo_rows(80))
    args = ["-m", "trainer.train", "--dataset", str(dataset), "--output_dir",
            str(tmp_path / "run"), "--lora_rank", "8", "--quantize_base", "nf4",
            "--mixed_precision", "bf16", "--lr", "1e-2", "--micro_batch", "4",
            "--max_steps", "6", "--warmup_steps", "2", "--eval_interval", "6",
            "--checkpoint_interval", "3", "--log_interval", "3"]  # fmt: skip
    torchrun(args)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.1
    assert summary["config"]["quantize_base"] == "nf4"
    # Resume: a rerun of the finished run starts from its last checkpoint.
    rerun = torchrun([*args[:-2], "--max_steps", "7", "--log_interval", "1"])
    assert "resumed from" in rerun.stdout
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "model") is not None
