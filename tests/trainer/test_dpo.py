"""DPO: the loss equals TRL's DPOTrainer on the same batch (loss and gradients, fp32 on CPU);
the references (frozen copy, precomputed, LoRA's base) start at the policy."""

import copy
import dataclasses
import json
import math
import shutil
import types
from collections import defaultdict

import pytest
import torch
import trl.trainer.dpo_trainer as trl_dpo
import trl.trainer.utils as trl_utils
from transformers import LlamaConfig, LlamaForCausalLM

from finetune_contract.data import IGNORE_INDEX
from tests.support.training import torchrun
from trainer.batch import Batch
from trainer.config import load_config
from trainer.dpo import dpo_scores, dpo_train_step, response_tokens, sequence_logps
from trainer.loss import add_loss_method
from trainer.model import build_model, materialize_weights
from trainer.optim import build_optimizer, optimizer_step
from trainer.parallel import apply_parallelism

PAD = 0


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=PAD)
    return LlamaForCausalLM(config).float()


def pairs_batch():
    """Two prompts, each with a chosen and a rejected response of different lengths; rows are
    chosen then rejected (TRL's order), right-padded."""
    generator = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(1, 61, (n,), generator=generator).tolist()

    prompts = [ids(5), ids(3)]
    responses = [ids(4), ids(6), ids(2), ids(5)]  # chosen 0, chosen 1, rejected 0, rejected 1
    rows = [prompts[i % 2] + responses[i] for i in range(4)]
    length = max(len(row) for row in rows)
    input_ids = torch.full((4, length), PAD)
    labels = torch.full((4, length), IGNORE_INDEX)
    completion = torch.zeros((4, length), dtype=torch.long)
    attention = torch.zeros((4, length), dtype=torch.long)
    for i, row in enumerate(rows):
        start = len(prompts[i % 2])
        input_ids[i, :len(row)] = torch.tensor(row)
        labels[i, start:len(row)] = input_ids[i, start:len(row)]
        completion[i, start:len(row)] = 1
        attention[i, :len(row)] = 1
    batch = Batch(input_ids, labels, int(attention.sum()))
    return batch, {"input_ids": input_ids, "attention_mask": attention,
                   "completion_mask": completion}


def trl_loss_and_grads(policy, reference, inputs, *, beta, loss_type, label_smoothing):
    """TRL's own DPOTrainer._compute_loss on a stand-in trainer holding what it reads."""
    policy, reference = copy.deepcopy(policy), copy.deepcopy(reference)
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1")
    trl_utils.add_fused_lm_head(policy, outputs=outputs)
    trl_utils.add_fused_lm_head(reference, outputs=outputs)
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), gather=lambda t: t,
                                        gather_for_metrics=lambda t: t,
                                        unwrap_model=lambda m: m)
    trainer = types.SimpleNamespace(
        model=policy, ref_model=reference, accelerator=accelerator, aux_loss_enabled=False,
        ld_alpha=None, precompute_ref_logps=False, f_divergence_type="reverse_kl",
        loss_types=[loss_type], loss_weights=[1.0], beta=beta, label_smoothing=label_smoothing,
        use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1,
        args=types.SimpleNamespace(gradient_checkpointing_kwargs=None))
    policy.train()
    loss = trl_dpo.DPOTrainer._compute_loss(trainer, policy, inputs, False)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in policy.named_parameters()}, trainer._metrics


def our_loss_and_grads(policy, reference, batch, *, beta, loss_type, label_smoothing):
    policy, reference = copy.deepcopy(policy), copy.deepcopy(reference)
    add_loss_method(policy)
    add_loss_method(reference)
    policy.train()
    with torch.no_grad():
        reference_logps = sequence_logps(reference, batch)
    scores = dpo_scores(sequence_logps(policy, batch), reference_logps, response_tokens(batch),
                        beta=beta, loss=loss_type, label_smoothing=label_smoothing)
    loss = scores.losses.mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in policy.named_parameters()}, scores


def trained_away(model):
    """The policy a few updates away from the reference, so the margins are not zero."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    return model


@pytest.mark.parametrize(("loss_type", "trl_loss_type", "label_smoothing", "pairs"), [
    ("sigmoid", "sigmoid", 0.0, 2),
    ("ipo", "ipo", 0.0, 2),
    # TRL 1.16's sigmoid has no smoothing; its "aot" loss is cDPO's formula on sorted margins,
    # which for one pair is cDPO itself.
    ("sigmoid", "aot", 0.2, 1),
])
def test_dpo_loss_and_gradients_equal_trls_on_the_same_batch(loss_type, trl_loss_type,
                                                             label_smoothing, pairs):
    reference = tiny_llama()
    policy = trained_away(reference)
    batch, inputs = pairs_batch()
    if pairs == 1:  # the first pair: rows 0 (chosen) and 2 (rejected)
        keep = torch.tensor([0, 2])
        batch = Batch(batch.input_ids[keep], batch.labels[keep], 0)
        inputs = {k: v[keep] for k, v in inputs.items()}
    beta = 0.3
    trl_loss, trl_grads, metrics = trl_loss_and_grads(
        policy, reference, inputs, beta=beta, loss_type=trl_loss_type,
        label_smoothing=label_smoothing)
    loss, grads, scores = our_loss_and_grads(policy, reference, batch, beta=beta,
                                             loss_type=loss_type, label_smoothing=label_smoothing)
    assert abs(loss.item() - trl_loss.item()) < 1e-5
    assert trl_loss.item() > 0
    worst = max((grads[n] - trl_grads[n]).abs().max().item() for n in grads)
    assert worst < 1e-5, f"largest gradient difference {worst:.3g}"
    assert any(g.abs().max() > 1e-4 for g in grads.values())  # the comparison is not of zeros
    train = metrics["train"]
    assert scores.chosen_rewards.mean().item() == pytest.approx(train["rewards/chosen"][0],
                                                               abs=1e-6)
    assert scores.rejected_rewards.mean().item() == pytest.approx(train["rewards/rejected"][0],
                                                                 abs=1e-6)


def dpo_losses(env, steps: int = 3, **overrides) -> list[tuple[float, float]]:
    """(loss, reward margin) of `steps` DPO steps on one batch of pairs, the trainer's pieces in
    this process; the reference is a frozen, uncompiled copy."""
    config = load_config(None, {"method": "dpo", "lr": 1e-2, "seed": 3, "dpo_beta": 0.5,
                                **overrides})

    def built(compile_blocks: bool):
        model = build_model(config.model)
        apply_parallelism(model, dataclasses.replace(config, compile=compile_blocks), env)
        materialize_weights(model, config.model, config.seed, env.device)
        add_loss_method(model)
        return model

    model, reference = built(config.compile), built(False)
    reference.requires_grad_(False)
    optimizer = build_optimizer(model, config, env.device)
    batch, _ = pairs_batch()
    out = []
    for _ in range(steps):
        loss, _, metrics = dpo_train_step(model, reference, [batch], config, env)
        optimizer_step(model, optimizer, config.max_grad_norm)
        optimizer.zero_grad(set_to_none=True)
        out.append((loss, metrics["reward_margin"]))
    return out


@pytest.mark.slow  # Dynamo and AOT autograd on CPU: half a minute
def test_compiled_blocks_give_the_same_dpo_losses_and_margins(world_of_one, monkeypatch):
    monkeypatch.setenv("TRAINER_COMPILE_BACKEND", "aot_eager")  # as tests/trainer/test_compile
    torch._dynamo.reset()
    eager = dpo_losses(world_of_one)
    compiled = dpo_losses(world_of_one, compile=True)
    assert eager[0][0] == pytest.approx(math.log(2), abs=1e-6)  # policy == reference at step 1
    assert eager[-1][1] > 1e-3  # the margin grew: later steps compare trained policies
    for (loss, margin), (want_loss, want_margin) in zip(compiled, eager, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5)
        assert margin == pytest.approx(want_margin, rel=1e-4, abs=1e-7)


# -- 2-process runs (gloo) ---------------------------------------------------------------------

DPO_STEPS, CHECKPOINT_AT = 4, 2


def dpo_run(output_dir, *extra):
    torchrun(["-m", "trainer.train", "--method", "dpo", "--output_dir", str(output_dir),
              "--micro_batch", "4", "--max_steps", str(DPO_STEPS), "--eval_interval", "0",
              "--log_interval", "1", "--lr", "1e-2", "--warmup_steps", "0", *extra])
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("type") == "train"]


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """Both references under SHARD_GRAD_OP, whose blocks keep their weights after a forward
    (precompute's reference pass has no backward to free them); checkpoints at CHECKPOINT_AT."""
    runs = {}
    for reference in ("model", "precompute"):
        output_dir = tmp_path_factory.mktemp(reference)
        runs[reference] = output_dir, dpo_run(
            output_dir, "--dpo_reference", reference, "--strategy", "SHARD_GRAD_OP",
            "--checkpoint_interval", str(CHECKPOINT_AT))
    return runs


@pytest.mark.slow
def test_precomputed_reference_gives_the_frozen_copys_losses_and_the_first_is_log_2(
    sharded_runs
):
    frozen, precomputed = sharded_runs["model"][1], sharded_runs["precompute"][1]
    # Step 1: policy == reference, so every margin is 0 and the loss log(2).
    assert frozen[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert frozen[0]["reward_margin"] == pytest.approx(0, abs=1e-6)
    assert [r["step"] for r in precomputed] == list(range(1, DPO_STEPS + 1))
    for a, b in zip(frozen, precomputed, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5), a["step"]
        assert a["reward_accuracy"] == b["reward_accuracy"]
    assert frozen[-1]["reward_margin"] != pytest.approx(0, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("reference", ["model", "precompute"])
def test_a_dpo_run_resumed_from_its_checkpoint_reproduces_the_uninterrupted_losses(
    sharded_runs, reference, tmp_path
):
    """The frozen copy is made again from the initial weights, and precompute scores the pairs
    again with them, not with the restored policy."""
    full_dir, uninterrupted = sharded_runs[reference]
    step = f"step_{CHECKPOINT_AT:08d}"
    shutil.copytree(full_dir / "checkpoints" / step, tmp_path / "checkpoints" / step)
    resumed = dpo_run(tmp_path, "--dpo_reference", reference, "--strategy", "SHARD_GRAD_OP",
                      "--checkpoint_interval", str(CHECKPOINT_AT))
    assert [r["step"] for r in resumed] == list(range(CHECKPOINT_AT + 1, DPO_STEPS + 1))
    for a, b in zip(uninterrupted[CHECKPOINT_AT:], resumed, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5), a["step"]
        assert b["reward_margin"] == pytest.approx(a["reward_margin"], abs=1e-5)


@pytest.mark.slow
def test_lora_reference_is_the_base_with_adapters_disabled(tmp_path):
    steps = dpo_run(tmp_path / "lora", "--lora_rank", "4", "--lora_alpha", "8")
    # B starts at 0: the first step's policy is the base; later the adapters move it away from
    # the reference (a reference that kept the adapters would stay at log 2).
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert any(abs(s["reward_margin"]) > 1e-4 for s in steps[1:])
    assert (tmp_path / "lora" / "model" / "config.json").is_file()  # the merged export
