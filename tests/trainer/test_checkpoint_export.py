"""Checkpoints and export on a world of one process, inside the test process."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from finetune_contract.data import PROMPT_TEMPLATE
from trainer.checkpoint import Checkpointer
from trainer.config import load_config
from trainer.demo import DEMO_TOKENIZER
from trainer.export import export_hf
from trainer.model import build_model, materialize_weights
from trainer.optim import build_optimizer
from trainer.parallel import apply_parallelism
from trainer.train import warmup_cosine


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_TOKENIZER)


def sharded_model(env, tokenizer, **overrides):
    """FSDP's DTensors, as a run of several ranks has them: at one rank only CPU offload keeps
    FSDP (otherwise trainer/master_weights.py)."""
    config = load_config(None, {"cpu_offload": True, **overrides})
    model = build_model(config.model, tokenizer)
    model_config = model.config
    apply_parallelism(model, config, env)
    materialize_weights(model, config.model, config.seed, env.device)
    return model, model_config, build_optimizer(model, config, env.device)


def take_a_step(model, optimizer, tokenizer, device):
    ids = tokenizer(PROMPT_TEMPLATE.format(prompt="Repeat owl 3 times."), return_tensors="pt")
    input_ids = ids["input_ids"].to(device)
    loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_the_exported_model_gives_the_trainers_logits(world_of_one, tokenizer, tmp_path):
    model, model_config, optimizer = sharded_model(world_of_one, tokenizer)
    take_a_step(model, optimizer, tokenizer, world_of_one.device)
    export_hf(model, model_config, tokenizer, tmp_path, world_of_one.rank)

    exported = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    reloaded_tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    text = PROMPT_TEMPLATE.format(prompt="Which month comes after May?")
    input_ids = reloaded_tokenizer(text, return_tensors="pt")["input_ids"]
    assert input_ids.tolist() == tokenizer(text, return_tensors="pt")["input_ids"].tolist()
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=input_ids.to(world_of_one.device)).logits.cpu()
        actual = exported(input_ids=input_ids).logits
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    assert (tmp_path / "generation_config.json").is_file()


def test_the_export_is_readable_like_the_runs_other_files_and_saves_only_tokenizer_settings(
        world_of_one, tokenizer, tmp_path):
    import json
    import os
    import stat

    model, model_config, _ = sharded_model(world_of_one, tokenizer)
    old = os.umask(0o022)
    try:
        export_hf(model, model_config, tokenizer, tmp_path / "model", world_of_one.rank)
        (tmp_path / "sibling.json").write_text("{}")  # how the run's other outputs are made
    finally:
        os.umask(old)
    expected = stat.S_IMODE((tmp_path / "sibling.json").stat().st_mode)
    files = [p for p in (tmp_path / "model").rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {
        p.name: expected for p in files}
    saved = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
    assert not {"local_files_only", "is_local", "cache_dir", "_commit_hash"} & set(saved)
    assert AutoTokenizer.from_pretrained(tmp_path / "model")("owl")["input_ids"] == \
        tokenizer("owl")["input_ids"]


def test_a_bf16_run_exports_bf16_weights(world_of_one, tokenizer, tmp_path):
    model, model_config, _ = sharded_model(world_of_one, tokenizer, mixed_precision="bf16")
    export_hf(model, model_config, tokenizer, tmp_path, world_of_one.rank, torch.bfloat16)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert exported.dtype == torch.bfloat16


def test_only_the_newest_complete_checkpoints_are_kept_and_interrupted_ones_ignored(
    world_of_one, tokenizer, tmp_path
):
    model, _, optimizer = sharded_model(world_of_one, tokenizer)
    checkpointer = Checkpointer(str(tmp_path), keep=2, rank=world_of_one.rank)
    for step in range(1, 5):
        checkpointer.save(step, model, optimizer, {"sampler": {"epoch": 0, "index": step}})
    (tmp_path / "checkpoints" / "step_00000009.tmp").mkdir()
    assert [p.name for p in checkpointer.complete()] == ["step_00000003", "step_00000004"]
    assert checkpointer.latest().name == "step_00000004"


def test_loading_a_checkpoint_restores_weights_and_optimizer_state(
    world_of_one, tokenizer, tmp_path
):
    model, _, optimizer = sharded_model(world_of_one, tokenizer)
    device = world_of_one.device
    take_a_step(model, optimizer, tokenizer, device)
    checkpointer = Checkpointer(str(tmp_path), keep=1, rank=world_of_one.rank)
    path = checkpointer.save(1, model, optimizer, {"sampler": {"epoch": 0, "index": 1}})
    saved = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    take_a_step(model, optimizer, tokenizer, device)

    fresh, _, fresh_optimizer = sharded_model(world_of_one, tokenizer, seed=99)
    state = checkpointer.load(path, fresh, fresh_optimizer)
    assert state == {"step": 1, "sampler": {"epoch": 0, "index": 1}}
    for name, param in fresh.named_parameters():
        torch.testing.assert_close(param.full_tensor(), saved[name], rtol=0, atol=0)
    steps = {int(s["step"]) for s in fresh_optimizer.state_dict()["state"].values()}
    assert steps == {1}


def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    multiplier = warmup_cosine(warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [multiplier(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert multiplier(9) == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert multiplier(14) == pytest.approx(0.1)
    values = [multiplier(i) for i in range(3, 15)]
    assert values == sorted(values, reverse=True)


def test_an_async_save_holds_the_weights_of_when_it_was_called_and_completes_at_wait(
    world_of_one, tokenizer, tmp_path
):
    model, _, optimizer = sharded_model(world_of_one, tokenizer)
    device = world_of_one.device
    checkpointer = Checkpointer(str(tmp_path), keep=2, rank=world_of_one.rank, async_save=True)
    take_a_step(model, optimizer, tokenizer, device)
    saved = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    checkpointer.save(1, model, optimizer, {"sampler": {"epoch": 0, "index": 1}})
    take_a_step(model, optimizer, tokenizer, device)  # while the save may still be writing
    checkpointer.wait()
    assert [p.name for p in checkpointer.complete()] == ["step_00000001"]

    fresh, _, fresh_optimizer = sharded_model(world_of_one, tokenizer, seed=99)
    state = checkpointer.load(checkpointer.latest(), fresh, fresh_optimizer)
    assert state == {"step": 1, "sampler": {"epoch": 0, "index": 1}}
    for name, param in fresh.named_parameters():
        torch.testing.assert_close(param.full_tensor(), saved[name], rtol=0, atol=0)
    checkpointer.close()


def test_async_saves_finish_one_before_the_next_and_prune_to_the_newest(
    world_of_one, tokenizer, tmp_path
):
    model, _, optimizer = sharded_model(world_of_one, tokenizer)
    checkpointer = Checkpointer(str(tmp_path), keep=2, rank=world_of_one.rank, async_save=True)
    for step in range(1, 5):
        checkpointer.save(step, model, optimizer, {"sampler": {"epoch": 0, "index": step}})
        # The previous save is complete (renamed, pruned) once the next one has started.
        done = [p.name for p in checkpointer.complete()]
        assert done == [f"step_{s:08d}" for s in range(max(1, step - 2), step)]
    checkpointer.close()
    assert [p.name for p in checkpointer.complete()] == ["step_00000003", "step_00000004"]
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


@pytest.mark.parametrize("remote", [False, True], ids=["path", "s3"])
def test_restating_a_complete_checkpoint_keeps_its_shards_and_rewrites_only_its_state(
    world_of_one, tokenizer, tmp_path, remote, request
):
    """A notice after the last step, whose checkpoint is saved: its trainer state is rewritten
    in place (Checkpointer.restate), never deleted and saved again (on S3 a save first deletes
    what is there: a notice killing that save would leave no checkpoint with keep 1)."""
    output = str(tmp_path)
    if remote:
        _, bucket = request.getfixturevalue("s3")
        output = f"s3://{bucket}/runs/restate"
    model, _, optimizer = sharded_model(world_of_one, tokenizer)
    checkpointer = Checkpointer(output, keep=1, rank=world_of_one.rank)
    checkpointer.save(2, model, optimizer, {"sampler": {"epoch": 0, "index": 2}})
    shards = sorted(checkpointer.remote.list_files("checkpoints/step_00000002")) if remote else \
        sorted(p.name for p in (tmp_path / "checkpoints" / "step_00000002").iterdir())
    checkpointer.restate(2, {"sampler": {"epoch": 0, "index": 2}, "last_eval_step": 2})
    assert checkpointer.complete_names() == ["step_00000002"]
    after = sorted(checkpointer.remote.list_files("checkpoints/step_00000002")) if remote else \
        sorted(p.name for p in (tmp_path / "checkpoints" / "step_00000002").iterdir())
    assert after == shards
    fresh, _, fresh_optimizer = sharded_model(world_of_one, tokenizer, seed=99)
    state = checkpointer.load(checkpointer.latest(), fresh, fresh_optimizer)
    assert state == {"step": 2, "sampler": {"epoch": 0, "index": 2}, "last_eval_step": 2}
