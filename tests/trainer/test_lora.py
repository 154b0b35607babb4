"""LoRA: a 2-process run on a pretrained model dir, its checkpoints, exports and adapters."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from finetune_contract.data import PROMPT_TEMPLATE
from finetune_contract.throughput import flops_per_token
from tests.support import REPO_ROOT
from tests.support.training import demo_rows, lm_step, torchrun, write_jsonl
from trainer.checkpoint import Checkpointer
from trainer.config import load_config
from trainer.demo import DEMO_TOKENIZER
from trainer.export import export_hf
from trainer.lora import apply_lora
from trainer.model import build_model, builtin_config, materialize_weights
from trainer.optim import build_optimizer
from trainer.parallel import apply_parallelism

STEPS, CHECKPOINT_AT, RANK = 6, 3, 4  # a short run: loss falls, 2 checkpoints
PROMPT = PROMPT_TEMPLATE.format(prompt="Which month comes after May?")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A 'pretrained' tiny Llama with its tokenizer, as users bring one."""
    path = tmp_path_factory.mktemp("base")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    torch.manual_seed(0)
    LlamaForCausalLM(builtin_config("tiny-llama", tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def lora_args(base_dir, dataset, output_dir):
    return [
        "-m", "trainer.train", "--model", str(base_dir), "--dataset", str(dataset),
        "--output_dir", str(output_dir), "--lora_rank", str(RANK), "--lora_alpha", "8",
        "--lr", "1e-2", "--micro_batch", "4", "--max_steps", str(STEPS), "--warmup_steps", "2",
        "--eval_interval", str(STEPS), "--checkpoint_interval", str(CHECKPOINT_AT),
        "--log_interval", "3",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def lora_run(base_dir, tmp_path_factory):
    dataset = write_jsonl(tmp_path_factory.mktemp("data") / "rows.jsonl", demo_rows(80))
    output_dir = tmp_path_factory.mktemp("lora")
    torchrun(lora_args(base_dir, dataset, output_dir))
    return output_dir, dataset


def logits(model, tokenizer):
    input_ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return model.eval()(input_ids=input_ids).logits


@pytest.mark.slow
def test_lora_trains_only_the_adapters_and_leaves_the_base_weights_as_loaded(lora_run, base_dir):
    output_dir, _ = lora_run
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["final_eval_loss"] < summary["initial_eval_loss"] - 0.1
    # The checkpoint holds the adapters alone (the frozen base is made again from its source at
    # a resume or an export), and every one of them learnt.
    import torch.distributed.checkpoint as dcp

    checkpoint = output_dir / "checkpoints" / "step_00000006"
    saved = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    model_keys = [k for k in saved if k.startswith("model.")]
    # (a tied head is not a parameter of its own, so not left out as frozen: the tiny base's)
    assert model_keys and all(".lora_" in k or k == "model.lm_head.weight"
                              for k in model_keys), model_keys
    model = build_model(str(base_dir))
    apply_lora(model, load_config(None, {"model": str(base_dir), "lora_rank": RANK}))
    model.to_empty(device="cpu")
    state = {name: t for name, t in model.state_dict().items() if ".lora_" in name}
    dcp.load({"model": state}, checkpoint_id=checkpoint)
    lora_b = [t for name, t in state.items() if ".lora_B." in name]
    assert len(lora_b) == 4 * 7 and all(t.abs().sum() > 0 for t in lora_b)  # all of them learnt
    # The base as loaded: the run's merged export less each adapter's product is the base.
    merged = load_file(output_dir / "model" / "model.safetensors")
    base = load_file(base_dir / "model.safetensors")
    adapters = {name: t for name, t in state.items()}
    scale = 8 / RANK  # lora_alpha / rank
    for name, weight in base.items():
        prefix = "model." + name.removeprefix("model.").removesuffix(".weight")
        a = adapters.get(f"{prefix}.lora_A.default.weight")
        expected = weight if a is None else \
            weight + scale * adapters[f"{prefix}.lora_B.default.weight"] @ a
        torch.testing.assert_close(merged[name].float(), expected.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_lora_flops_count_no_weight_gradients_for_the_frozen_base(lora_run, base_dir):
    output_dir, _ = lora_run
    summary = json.loads((output_dir / "summary.json").read_text())
    config = AutoModelForCausalLM.from_pretrained(base_dir).config
    adapters = 4 * 4 * (  # per block: rank x (in + out) of q, k, v, o, gate, up, down
        (128 + 128) + (128 + 64) * 2 + (128 + 128) + (128 + 352) * 2 + (352 + 128)
    )
    assert summary["flops_per_token"] == flops_per_token(config, 128, adapters)
    assert summary["flops_per_token"] < flops_per_token(config, 128)


@pytest.mark.slow
def test_the_merged_export_gives_the_lora_models_logits_and_the_adapter_loads_with_peft(
    lora_run, base_dir
):
    from peft import PeftModel

    output_dir, _ = lora_run
    tokenizer = AutoTokenizer.from_pretrained(output_dir / "model")
    merged = AutoModelForCausalLM.from_pretrained(output_dir / "model")
    assert not any("lora" in name or "base_layer" in name for name, _ in merged.named_parameters())
    with_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir), output_dir / "model" / "adapter"
    )
    base_logits = logits(AutoModelForCausalLM.from_pretrained(base_dir), tokenizer)
    torch.testing.assert_close(logits(merged, tokenizer), logits(with_adapter, tokenizer))
    assert not torch.allclose(logits(merged, tokenizer), base_logits, atol=1e-3)


@pytest.mark.slow
def test_exporting_the_last_checkpoint_by_command_gives_the_runs_exported_model(
    lora_run, tmp_path
):
    output_dir, _ = lora_run
    result = torchrun_free_export(output_dir / "checkpoints" / "step_00000006", tmp_path)
    assert json.loads(result)["model"] == str(tmp_path)
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        exported, final = load_file(tmp_path / name), load_file(output_dir / "model" / name)
        assert exported.keys() == final.keys()
        for key, tensor in final.items():
            torch.testing.assert_close(exported[key], tensor, rtol=0, atol=0)
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["r"] == RANK


def torchrun_free_export(checkpoint, out) -> str:
    """`python -m trainer.export` as a user runs it: one process, no torchrun."""
    result = subprocess.run(
        [sys.executable, "-m", "trainer.export", "--checkpoint", str(checkpoint),
         "--out", str(out)],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def sharded_lora_model(env, tokenizer, seed):
    config = load_config(
        None, {"lora_rank": 2, "lora_target_modules": "q_proj, v_proj", "seed": seed}
    )
    model = build_model(config.model, tokenizer)
    adapters = apply_lora(model, config)
    apply_parallelism(model, config, env)
    materialize_weights(model, config.model, config.seed, env.device)
    return model, build_optimizer(model, config, env.device), adapters


def test_lora_trains_only_adapters_resumes_exactly_and_exports_the_sharded_models_logits(
    world_of_one, tmp_path
):
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TOKENIZER)
    model, optimizer, adapters = sharded_lora_model(world_of_one, tokenizer, seed=1)
    optimized = [p for group in optimizer.param_groups for p in group["params"]]
    assert sum(p.numel() for p in optimized) == adapters == 4 * 2 * ((128 + 128) + (128 + 64))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    input_ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]

    def step(model, optimizer) -> float:
        return lm_step(model, optimizer, input_ids)

    for _ in range(2):  # B starts at zero: steps make the adapters count
        step(model, optimizer)
    checkpointer = Checkpointer(str(tmp_path / "run"), keep=1, rank=world_of_one.rank)
    path = checkpointer.save(2, model, optimizer, {})
    # The frozen base is not in it: a resumed run makes it again from the model's source.
    saved = sum(f.stat().st_size for f in path.rglob("*.distcp"))
    base = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    assert saved < base / 4
    expected_loss = step(model, optimizer)
    # As a resumed run builds it: the same base, its adapters anything until the load.
    resumed, resumed_optimizer, _ = sharded_lora_model(world_of_one, tokenizer, seed=1)
    with torch.no_grad():
        for p in resumed.parameters():
            if p.requires_grad:
                p.normal_()
    checkpointer.load(path, resumed, resumed_optimizer)
    assert step(resumed, resumed_optimizer) == pytest.approx(expected_loss, rel=1e-6)

    export_hf(model, model.config, tokenizer, tmp_path / "model", world_of_one.rank)
    with torch.no_grad():
        expected = model.eval()(input_ids=input_ids).logits
    actual = logits(AutoModelForCausalLM.from_pretrained(tmp_path / "model"), tokenizer)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


def test_unknown_lora_target_modules_are_refused_naming_the_option_and_the_layers():
    config = load_config(None, {"lora_rank": 8, "lora_target_modules": "q_proj,query"})
    with pytest.raises(ValueError, match="lora_target_modules names query") as error:
        apply_lora(build_model(config.model), config)
    assert "gate_proj" in str(error.value)
